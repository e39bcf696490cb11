"""Gemma's decoder pieces: the sandwich-normed layer (a norm before and after each sublayer, a learned scalar
on the layer's output), its variant with an expert block beside the MLP, per-layer input embeddings, and
the GELU-tanh gated MLP.

Norms scale the float32 normalised row and round once (NativeWideRMSNorm), as transformers' Gemma4RMSNorm
does. Every op is row-wise, so a row's result never depends on the batch around it.
"""

import math

import torch
from torch import nn

from deployments.model_rank.forward_batch import ForwardBatch, ParallelContext
from deployments.model_rank.layers.decoder import DecoderStack
from deployments.model_rank.layers.embedding import VocabEmbedding
from deployments.model_rank.layers.linear import ReplicatedLinear
from deployments.model_rank.layers.mlp import GatedMLP
from deployments.model_rank.layers.moe import Experts, ScaledSoftmaxRouter
from deployments.model_rank.layers.norm import NativeWideRMSNorm
from deployments.model_rank.layers.parallel import all_reduce, default_loader
from kernels import dispatch
from kernels.activation import gelu_tanh


def scaled_by(value: float, dtype: torch.dtype) -> torch.Tensor:
    """A constant scale as transformers applies it to a tensor of `dtype`: a float32 scalar cast to it."""
    return torch.tensor(value, dtype=torch.float32).to(dtype)


class GeluTanhMLP(GatedMLP):
    """down(gelu_tanh(gate(x)) * up(x)): Gemma's MLP, sharded as GatedMLP."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(dispatch.gelu_tanh_mul(gate, up))  # [T, H]


class SandwichLayer(nn.Module):
    """h + post_attn(attn(pre(h))), then h + post_ff(ff(pre_ff(h))), then the per-layer input's residual
    (when the model has per-layer inputs), all times `layer_scalar`. `ff` is the MLP here, the MLP and an
    expert block beside it in SandwichMoELayer."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, per_layer: int) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = NativeWideRMSNorm(hidden_size, eps)
        self.post_attention_layernorm = NativeWideRMSNorm(hidden_size, eps)
        self.pre_feedforward_layernorm = NativeWideRMSNorm(hidden_size, eps)
        self.post_feedforward_layernorm = NativeWideRMSNorm(hidden_size, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.layer_scalar.weight_loader = default_loader
        self.per_layer = per_layer
        if per_layer:
            self.per_layer_input_gate = ReplicatedLinear(hidden_size, per_layer)
            self.per_layer_projection = ReplicatedLinear(per_layer, hidden_size)
            self.post_per_layer_input_norm = NativeWideRMSNorm(hidden_size, eps)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn

    def feed_forward(self, normed: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.mlp(normed)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch, per_layer_input: torch.Tensor | None) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), batch)  # [T, H]
        hidden = hidden + self.post_attention_layernorm(attended)
        fed = self.feed_forward(self.pre_feedforward_layernorm(hidden), hidden)  # [T, H]
        hidden = hidden + self.post_feedforward_layernorm(fed)
        if per_layer_input is not None:
            gated = gelu_tanh(self.per_layer_input_gate(hidden)) * per_layer_input  # [T, P]
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden * self.layer_scalar.to(hidden.dtype)

    def cache_spec(self):  # noqa: ANN201 (the attention's LayerCacheSpec)
        return self.self_attn.cache_spec()

    def bind_cache(self, cache: tuple[torch.Tensor, ...]) -> None:
        self.self_attn.bind_cache(cache)


class SandwichMoELayer(SandwichLayer):
    """A sandwich layer whose feed-forward is the MLP and an expert block beside it (Gemma 4's
    `enable_moe_block`): each normed on its way out, the experts routed on the layer's residual stream."""

    def __init__(
        self,
        self_attn: nn.Module,
        mlp: nn.Module,
        hidden_size: int,
        eps: float,
        per_layer: int,
        experts: tuple[int, int, int],  # (count, per token, intermediate size)
        parallel: ParallelContext,
    ) -> None:
        super().__init__(self_attn, mlp, hidden_size, eps, per_layer)
        count, top_k, intermediate = experts
        self.parallel = parallel
        self.router = ScaledSoftmaxRouter(hidden_size, count, top_k, eps)
        self.experts = Experts(count, hidden_size, intermediate, parallel, activation="gelu_tanh")
        self.post_feedforward_layernorm_1 = NativeWideRMSNorm(hidden_size, eps)
        self.pre_feedforward_layernorm_2 = NativeWideRMSNorm(hidden_size, eps)
        self.post_feedforward_layernorm_2 = NativeWideRMSNorm(hidden_size, eps)

    def feed_forward(self, normed: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        dense = self.post_feedforward_layernorm_1(self.mlp(normed))  # [T, H]
        weights, ids = self.router(residual)
        routed = self.experts(self.pre_feedforward_layernorm_2(residual), weights, ids)  # this rank's share
        return dense + self.post_feedforward_layernorm_2(all_reduce(routed, self.parallel))


class PerLayerInputs(nn.Module):
    """Each token's input to every layer [T, L, P]: its row of a second embedding table (scaled by sqrt(P)),
    plus a projection of its scaled main embedding (scaled by 1/sqrt(H), RMS-normed), times 1/sqrt(2)."""

    def __init__(self, vocab_size: int, hidden_size: int, layers: int, size: int, eps: float) -> None:
        super().__init__()
        self.layers, self.size, self.hidden_size = layers, size, hidden_size
        self.embed_tokens_per_layer = VocabEmbedding(vocab_size, layers * size)
        self.per_layer_model_projection = ReplicatedLinear(hidden_size, layers * size)
        self.per_layer_projection_norm = NativeWideRMSNorm(size, eps)

    def forward(self, input_ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        tokens = self.embed_tokens_per_layer(input_ids)  # [T, L*P]
        tokens = tokens * scaled_by(math.sqrt(self.size), tokens.dtype)
        projected = self.per_layer_model_projection(embedded) * self.hidden_size**-0.5  # a Python float, as there
        projected = self.per_layer_projection_norm(projected.view(-1, self.layers, self.size))  # [T, L, P]
        return (projected + tokens.view(-1, self.layers, self.size)) * 2**-0.5


class SandwichStack(DecoderStack):
    """The decoder stack of sandwich layers: the embedding scaled by sqrt(H), per-layer inputs where the
    model has them (`per_layer`), then the layers and the final norm."""

    def __init__(self, vocab_size: int, hidden_size: int, layers: list[SandwichLayer], eps: float) -> None:
        super().__init__(vocab_size, hidden_size, layers, eps, norm=NativeWideRMSNorm)  # type: ignore[arg-type]
        self.hidden_size = hidden_size
        self.per_layer_inputs: PerLayerInputs | None = None

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(batch.input_ids)  # [T, H]
        hidden = hidden * scaled_by(math.sqrt(self.hidden_size), hidden.dtype)
        inputs = None if self.per_layer_inputs is None else self.per_layer_inputs(batch.input_ids, hidden)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, batch, None if inputs is None else inputs[:, i])
        return self.norm(hidden)  # [T, H]
