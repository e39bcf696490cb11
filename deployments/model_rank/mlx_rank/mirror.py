"""Build the MLX model from a loaded torch CausalLM, module by module, releasing each torch tensor once copied."""

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import torch
from torch import nn

from deployments.model_rank.layers.attention import GatedSelfAttention as TorchGatedSelfAttention
from deployments.model_rank.layers.attention import SelfAttention as TorchSelfAttention
from deployments.model_rank.layers.decoder import DecoderLayer as TorchDecoderLayer
from deployments.model_rank.layers.dsa_attention import IndexedMLAAttention as TorchIndexedMLA
from deployments.model_rank.layers.dsa_index import SelectionRelay as TorchSelectionRelay
from deployments.model_rank.layers.hyper_connections import HyperLayer as TorchHyperLayer
from deployments.model_rank.layers.hyper_connections import HyperStack as TorchHyperStack
from deployments.model_rank.layers.mla import MLAAttention as TorchMLA
from deployments.model_rank.layers.mlp import GatedMLP as TorchGatedMLP
from deployments.model_rank.layers.moe import Router as TorchRouter
from deployments.model_rank.layers.moe import SparseMoE as TorchSparseMoE
from deployments.model_rank.layers.norm import RMSNorm as TorchRMSNorm
from deployments.model_rank.layers.norm import WideScaleRMSNorm, ZeroCentredRMSNorm
from deployments.model_rank.layers.recurrent import RecurrentMixer as TorchRecurrentMixer
from deployments.model_rank.layers.rotary import RotaryEmbedding
from deployments.model_rank.mlx_rank.arrays import from_torch
from deployments.model_rank.mlx_rank.attention import DecoderLayer, DecoderStack, MLAAttention, SelfAttention
from deployments.model_rank.mlx_rank.batch import MlxBatch
from deployments.model_rank.mlx_rank.dsa_index import SelectionRelay
from deployments.model_rank.mlx_rank.dsa_mirror import hyper_layer, indexed_mla
from deployments.model_rank.mlx_rank.hybrid_layers import GatedSelfAttention, ScaledRMSNorm
from deployments.model_rank.mlx_rank.hybrid_mirror import hybrid_mlp, nemotron_block, recurrent_mixer
from deployments.model_rank.mlx_rank.hyper import HyperStack
from deployments.model_rank.mlx_rank.layers import GatedMLP, Linear, RMSNorm, Rotary, Router, SparseMoE
from deployments.model_rank.mlx_rank.mtp import MtpLayer
from deployments.model_rank.mlx_rank.recurrent import RecurrentMixer
from deployments.model_rank.mlx_rank.sandwich_mirror import sandwich_stack
from deployments.model_rank.models import CausalLM
from deployments.model_rank.models.gemma4 import Gemma4ForCausalLM
from deployments.model_rank.models.nemotron_h import NemotronHBlock
from deployments.model_rank.models.nemotron_h_mtp import NemotronHMTP


class Mirror:
    """Copies parameters into MLX once each (tied ones are shared) and frees the torch storage behind them."""

    def __init__(self) -> None:
        self._copied: dict[int, mx.array] = {}
        self._rotaries: dict[int, Rotary] = {}
        self._relays: dict[int, SelectionRelay] = {}

    def array(self, param: torch.Tensor) -> mx.array:
        key = id(param)
        if key not in self._copied:
            self._copied[key] = from_torch(param.data)
            mx.eval(self._copied[key])
            param.data = torch.empty(0, dtype=param.dtype)  # the torch model is not used again
        return self._copied[key]

    def linear(self, module: nn.Module) -> Linear:
        bias = getattr(module, "bias", None)
        return Linear(self.array(module.weight), self.array(bias) if bias is not None else None)

    def norm(self, module: TorchRMSNorm) -> RMSNorm | ScaledRMSNorm:
        if isinstance(module, ZeroCentredRMSNorm):  # before WideScaleRMSNorm: it is one
            return ScaledRMSNorm(1.0 + self.array(module.weight).astype(mx.float32), module.eps)
        if isinstance(module, WideScaleRMSNorm):
            return ScaledRMSNorm(self.array(module.weight).astype(mx.float32), module.eps)
        return RMSNorm(self.array(module.weight), module.eps)

    def router(self, gate: TorchRouter) -> Router:
        bias = gate.e_score_correction_bias
        return Router(self.array(gate.weight), self.array(bias) if bias is not None else None, gate.routing)

    def rotary(self, module: RotaryEmbedding | None) -> Rotary | None:
        if module is None:
            return None  # no position encoding (Nemotron-H's attention)
        if id(module) not in self._rotaries:  # layers share one rotary, as in torch
            inv_freq = from_torch(module.inv_freq.float())
            axes = None if module.mrope_axes is None else from_torch(module.mrope_axes.to(torch.int32))
            self._rotaries[id(module)] = Rotary(inv_freq, module.attention_scaling, module.interleaved, axes)
        return self._rotaries[id(module)]

    def relay(self, relay: TorchSelectionRelay) -> SelectionRelay:
        """The MLX relay of a torch one (a full DSA layer and the shared layers after it share it)."""
        return self._relays.setdefault(id(relay), SelectionRelay())

    def mlp(self, module: nn.Module) -> Callable[[mx.array], mx.array]:
        if isinstance(module, TorchGatedMLP):
            linears = (self.linear(module.gate_proj), self.linear(module.up_proj), self.linear(module.down_proj))
            return GatedMLP(*linears, module.limit)
        hybrid = hybrid_mlp(self, module)
        if hybrid is not None:
            return hybrid
        if isinstance(module, TorchSparseMoE):
            experts = module.experts
            shared = self.mlp(module.shared_experts) if module.shared_experts is not None else None
            return SparseMoE(
                self.router(module.gate),
                self.array(experts.gate_proj),
                self.array(experts.up_proj),
                self.array(experts.down_proj),
                shared,
                experts.swiglu_limit,
            )
        raise TypeError(f"no MLX mirror for {type(module).__name__}")

    def attention(self, module: nn.Module) -> SelfAttention | MLAAttention:
        if isinstance(module, TorchIndexedMLA):
            return indexed_mla(self, module)
        if isinstance(module, TorchSelfAttention):
            q_norm = self.norm(module.q_norm) if module.q_norm is not None else None
            k_norm = self.norm(module.k_norm) if module.k_norm is not None else None
            kind = GatedSelfAttention if isinstance(module, TorchGatedSelfAttention) else SelfAttention
            return kind(
                self.linear(module.q_proj),
                self.linear(module.k_proj),
                self.linear(module.v_proj),
                self.linear(module.o_proj),
                q_norm,
                k_norm,
                self.rotary(module.rotary),
                module.local_heads,
                module.local_kv_heads,
                module.head_dim,
                module.attn.scale,
            )
        if type(module) is TorchMLA:  # subclasses unknown here are refused
            d = module.dims
            direct = d.q_lora_rank is None
            return MLAAttention(
                self.linear(module.q_proj) if direct else None,
                None if direct else self.linear(module.q_a_proj),
                None if direct else self.norm(module.q_a_layernorm),
                None if direct else self.linear(module.q_b_proj),
                self.linear(module.kv_a_proj_with_mqa),
                self.norm(module.kv_a_layernorm),
                self.linear(module.kv_b_proj),
                self.linear(module.o_proj),
                self.rotary(module.rotary),
                module.local_heads,
                d.qk_nope_head_dim,
                d.qk_rope_head_dim,
                d.v_head_dim,
                d.kv_lora_rank,
                module.scale,
            )
        raise TypeError(f"no MLX mirror for {type(module).__name__}")

    def mixer(self, module: nn.Module) -> Callable[[mx.array, MlxBatch], mx.array]:
        """What mixes tokens in a decoder layer: a recurrent mixer, or attention."""
        return recurrent_mixer(self, module) if isinstance(module, TorchRecurrentMixer) else self.attention(module)

    def layer(self, module: nn.Module) -> Callable[[mx.array, MlxBatch], mx.array]:
        if isinstance(module, NemotronHBlock):
            return nemotron_block(self, module)
        if isinstance(module, TorchHyperLayer):
            return hyper_layer(self, module)
        if type(module) is not TorchDecoderLayer:  # other subclasses unknown here are refused
            raise TypeError(f"no MLX mirror for {type(module).__name__}")
        return DecoderLayer(
            self.norm(module.input_layernorm),
            self.mixer(module.mixer),
            self.norm(module.post_attention_layernorm),
            self.mlp(module.mlp),
        )


@dataclass
class MirroredModel:
    """The MLX model, and the modules holding per-sequence memory, in the order the torch model lists them."""

    decoder: DecoderStack
    mtp: MtpLayer | None  # where asked for and the checkpoint has one that drafts
    attentions: list[SelfAttention | MLAAttention]  # the decoder's, then the MTP layer's: kv_cache_specs order
    recurrents: list[RecurrentMixer]  # state_specs order


def token_mixers(layers: list) -> list[Callable]:
    """What mixes tokens (or, in a Nemotron-H MLP or MoE block, does not) in each MLX layer, in order."""
    return [layer.attn if isinstance(layer, DecoderLayer) else layer.mixer for layer in layers]


def attention_modules(layers: list) -> list[SelfAttention | MLAAttention]:
    """The attention mixers of a list of MLX layers (DecoderLayer or NemotronBlock), in order."""
    return [m for m in token_mixers(layers) if isinstance(m, SelfAttention | MLAAttention)]


def mirror_model(model: CausalLM, mtp: bool) -> MirroredModel:
    """The MLX twin of a torch CausalLM loaded on the CPU without packed weights (its tensors are freed),
    with its MTP layer where `mtp` asks for it and the model has one."""
    mirror = Mirror()
    if isinstance(model, Gemma4ForCausalLM):  # sandwich layers, shared caches: mlx_rank/sandwich_mirror.py
        decoder = sandwich_stack(mirror, model)
        return MirroredModel(decoder, None, attention_modules(decoder.layers), [])
    stack = model.model
    layers = [mirror.layer(layer) for layer in stack.layers]
    embed = mirror.array(stack.embed_tokens.weight)
    head = Linear(mirror.array(model.lm_head.weight), None)
    if isinstance(stack, TorchHyperStack):  # residual streams: mlx_rank/hyper.py
        decoder: DecoderStack = HyperStack(embed, layers, mirror.norm(stack.norm), head, stack.streams)
    else:
        decoder = DecoderStack(embed, layers, mirror.norm(stack.norm), head)
    recurrents = [m for m in token_mixers(layers) if isinstance(m, RecurrentMixer)]
    torch_mtp = getattr(model, "mtp", None)
    layer = mirror_mtp(mirror, torch_mtp, head) if mtp and torch_mtp is not None else None
    attentions = attention_modules(layers) + (attention_modules(layer.layers) if layer is not None else [])
    return MirroredModel(decoder, layer, attentions, recurrents)


def mirror_mtp(mirror: Mirror, module: nn.Module, head: Linear) -> MtpLayer:
    """GLM's MTP layer (one decoder layer, then `shared_head`'s norm and head) or Nemotron-H's MTP step
    (blocks, then `final_layernorm`, whose output is both fed back and read by the trunk's head)."""
    fusion = (mirror.array(module.embed_tokens.weight), mirror.norm(module.enorm), mirror.norm(module.hnorm))
    if isinstance(module, NemotronHMTP):
        blocks = [mirror.layer(block) for block in module.layers]
        return MtpLayer(*fusion, mirror.linear(module.eh_proj), blocks, mirror.norm(module.final_layernorm), None, head)
    shared = module.shared_head
    return MtpLayer(
        *fusion,
        mirror.linear(module.eh_proj),
        [mirror.layer(module.layer)],
        None,
        mirror.norm(shared.norm),
        Linear(mirror.array(shared.head.weight), None),
    )
