"""The pre-norm decoder layer every supported architecture shares, and the decoder stack."""

import torch
from torch import nn

from deployments.model_rank.forward_batch import ForwardBatch, LayerCacheSpec
from deployments.model_rank.layers.embedding import VocabEmbedding
from deployments.model_rank.layers.norm import RMSNorm


class DecoderLayer(nn.Module):
    """h + mixer(norm(h)), then h + mlp(norm(h)).

    The mixer is attention (cache_spec/bind_cache/forward(h, batch)), registered as `self_attn`, or in a
    hybrid model a RecurrentMixer, registered under the checkpoint's name for it (`mixer_name`, e.g.
    Qwen3-Next's `linear_attn`). `norm` builds the two norms (RMSNorm unless the architecture differs).
    """

    def __init__(
        self,
        self_attn: nn.Module,
        mlp: nn.Module,
        hidden_size: int,
        eps: float,
        norm: type[RMSNorm] = RMSNorm,
        mixer_name: str = "self_attn",
    ) -> None:
        super().__init__()
        self.input_layernorm = norm(hidden_size, eps)
        self.mixer_name = mixer_name
        self.add_module(mixer_name, self_attn)
        self.post_attention_layernorm = norm(hidden_size, eps)
        self.mlp = mlp
        # Living weights (docs/slide.md): the last layer's pocket, `pocket(x, out)`, set by the runner.
        self.pocket: nn.Module | None = None

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        attended = self.mixer(self.input_layernorm(hidden), batch)  # [T, H]
        normed, hidden = self.post_attention_layernorm.add_and_norm(attended, hidden)  # [T, H] each
        out = hidden + self.mlp(normed)  # [T, H]
        return out if self.pocket is None else self.pocket(normed, out)

    @property
    def mixer(self) -> nn.Module:
        """What mixes tokens in this layer: attention, or a hybrid model's recurrent mixer."""
        return getattr(self, self.mixer_name)

    def cache_spec(self) -> LayerCacheSpec:
        return self.mixer.cache_spec()

    def bind_cache(self, cache: tuple[torch.Tensor, ...]) -> None:
        self.mixer.bind_cache(cache)


class DecoderStack(nn.Module):
    """embed_tokens -> layers -> norm, named as in Hugging Face checkpoints (`model.*`)."""

    def __init__(
        self, vocab_size: int, hidden_size: int, layers: list[DecoderLayer], eps: float, norm: type[RMSNorm] = RMSNorm
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm(hidden_size, eps)

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        """The step's input rows [T, H]: token embeddings, image placeholders taking their image's rows."""
        hidden = self.embed_tokens(batch.input_ids)  # [T, H]
        if batch.image_rows is not None and batch.image_embeds is not None:
            hidden = hidden.index_copy(0, batch.image_rows, batch.image_embeds.to(hidden.dtype))
        return hidden

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed(batch)
        for layer in self.layers:
            hidden = layer(hidden, batch)
        return self.norm(hidden)  # [T, H]
