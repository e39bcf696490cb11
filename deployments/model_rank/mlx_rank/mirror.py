"""Build the MLX model from a loaded torch CausalLM, module by module, releasing each torch tensor once copied."""

import mlx.core as mx
import torch
from torch import nn

from deployments.model_rank.layers.attention import SelfAttention as TorchSelfAttention
from deployments.model_rank.layers.decoder import DecoderLayer as TorchDecoderLayer
from deployments.model_rank.layers.mla import MLAAttention as TorchMLA
from deployments.model_rank.layers.mlp import GatedMLP as TorchGatedMLP
from deployments.model_rank.layers.moe import SparseMoE as TorchSparseMoE
from deployments.model_rank.layers.norm import RMSNorm as TorchRMSNorm
from deployments.model_rank.layers.rotary import RotaryEmbedding
from deployments.model_rank.mlx_rank.arrays import from_torch
from deployments.model_rank.mlx_rank.attention import DecoderLayer, DecoderStack, MLAAttention, SelfAttention
from deployments.model_rank.mlx_rank.layers import GatedMLP, Linear, RMSNorm, Rotary, Router, SparseMoE
from deployments.model_rank.mlx_rank.mtp import MtpLayer
from deployments.model_rank.models import CausalLM


class Mirror:
    """Copies parameters into MLX once each (tied ones are shared) and frees the torch storage behind them."""

    def __init__(self) -> None:
        self._copied: dict[int, mx.array] = {}
        self._rotaries: dict[int, Rotary] = {}

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

    def norm(self, module: TorchRMSNorm) -> RMSNorm:
        return RMSNorm(self.array(module.weight), module.eps)

    def rotary(self, module: RotaryEmbedding) -> Rotary:
        if id(module) not in self._rotaries:  # layers share one rotary, as in torch
            inv_freq = from_torch(module.inv_freq.float())
            self._rotaries[id(module)] = Rotary(inv_freq, module.attention_scaling, module.interleaved)
        return self._rotaries[id(module)]

    def mlp(self, module: nn.Module) -> GatedMLP | SparseMoE:
        if isinstance(module, TorchGatedMLP):
            return GatedMLP(self.linear(module.gate_proj), self.linear(module.up_proj), self.linear(module.down_proj))
        if isinstance(module, TorchSparseMoE):
            gate = module.gate
            bias = gate.e_score_correction_bias
            router = Router(self.array(gate.weight), self.array(bias) if bias is not None else None, gate.routing)
            experts = module.experts
            shared = self.mlp(module.shared_experts) if module.shared_experts is not None else None
            assert shared is None or isinstance(shared, GatedMLP)
            return SparseMoE(
                router,
                self.array(experts.gate_proj),
                self.array(experts.up_proj),
                self.array(experts.down_proj),
                shared,
            )
        raise TypeError(f"no MLX mirror for {type(module).__name__}")

    def attention(self, module: nn.Module) -> SelfAttention | MLAAttention:
        if isinstance(module, TorchSelfAttention):
            q_norm = self.norm(module.q_norm) if module.q_norm is not None else None
            k_norm = self.norm(module.k_norm) if module.k_norm is not None else None
            return SelfAttention(
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
        if isinstance(module, TorchMLA):
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

    def layer(self, module: TorchDecoderLayer) -> DecoderLayer:
        return DecoderLayer(
            self.norm(module.input_layernorm),
            self.attention(module.self_attn),
            self.norm(module.post_attention_layernorm),
            self.mlp(module.mlp),
        )


def mirror_model(model: CausalLM, mtp: bool) -> tuple[DecoderStack, MtpLayer | None]:
    """The MLX decoder of a torch CausalLM loaded on the CPU without packed weights (its tensors are freed),
    and its MTP layer where `mtp` asks for it and the model has one."""
    mirror = Mirror()
    stack = model.model
    layers = [mirror.layer(layer) for layer in stack.layers]  # type: ignore[arg-type]
    embed = mirror.array(stack.embed_tokens.weight)
    head = Linear(mirror.array(model.lm_head.weight), None)
    decoder = DecoderStack(embed, layers, mirror.norm(stack.norm), head)
    torch_mtp = getattr(model, "mtp", None)
    if not mtp or torch_mtp is None:
        return decoder, None
    shared = torch_mtp.shared_head
    layer = MtpLayer(
        mirror.array(torch_mtp.embed_tokens.weight),
        mirror.norm(torch_mtp.enorm),
        mirror.norm(torch_mtp.hnorm),
        mirror.linear(torch_mtp.eh_proj),
        mirror.layer(torch_mtp.layer),
        mirror.norm(shared.norm),
        Linear(mirror.array(shared.head.weight), None),
    )
    return decoder, layer
