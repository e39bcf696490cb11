"""Build the MLX twin of a Gemma 4 model (models/gemma4.py) from its torch modules (mirror.py's Mirror)."""

from typing import Any, Protocol

import mlx.core as mx
import torch

from deployments.model_rank.layers import sandwich as torch_sandwich
from deployments.model_rank.mlx_rank.arrays import from_torch
from deployments.model_rank.mlx_rank.hybrid_layers import ScaledRMSNorm
from deployments.model_rank.mlx_rank.layers import Linear
from deployments.model_rank.mlx_rank.sandwich import (
    ExpertBlock,
    GeluMLP,
    GemmaAttention,
    PerLayerInputs,
    SandwichLayer,
    SandwichStack,
    SharedAttention,
)
from deployments.model_rank.models.gemma4 import Gemma4ForCausalLM


class Mirror(Protocol):
    """What this needs of mirror.py's Mirror (which imports this module)."""

    def array(self, param: torch.Tensor) -> mx.array: ...

    def linear(self, module: Any) -> Linear: ...

    def rotary(self, module: Any) -> Any: ...


def wide_norm(mirror: Mirror, module) -> ScaledRMSNorm:  # noqa: ANN001 (a NativeWideRMSNorm)
    return ScaledRMSNorm(mirror.array(module.weight).astype(mx.float32), module.eps)


def sandwich_stack(mirror: Mirror, model: Gemma4ForCausalLM) -> SandwichStack:
    """The whole decoder: each layer's attention (a kv-shared one reading its source's MLX cache), MLP, expert
    block, norms and per-layer input pieces, then the stack's embedding scale, per-layer inputs and softcap."""
    stack = model.model
    owners: dict[int, GemmaAttention] = {}
    layers = []
    for index, module in enumerate(stack.layers):
        layers.append(_layer(mirror, module, owners, index))
    per_layer = None
    if stack.per_layer_inputs is not None:
        p = stack.per_layer_inputs
        table = mirror.array(p.embed_tokens_per_layer.weight)
        projection = mirror.linear(p.per_layer_model_projection)
        per_layer = PerLayerInputs(
            table, projection, wide_norm(mirror, p.per_layer_projection_norm), (p.layers, p.size, p.hidden_size)
        )
    embed = mirror.array(stack.embed_tokens.weight)
    scale = mx.array(stack.hidden_size**0.5, mx.float32)
    head = Linear(mirror.array(model.lm_head.weight), None)
    return SandwichStack(embed, layers, wide_norm(mirror, stack.norm), head, (scale, per_layer, model.softcap))


def _layer(mirror: Mirror, module, owners: dict[int, GemmaAttention], index: int) -> SandwichLayer:  # noqa: ANN001
    attention = module.self_attn
    rotary = mirror.rotary(attention.rotary)
    assert rotary is not None
    if attention.shares is not None:
        source = owners[attention.shares]
        mixer = SharedAttention(
            mirror.linear(attention.q_proj),
            mirror.linear(attention.o_proj),
            wide_norm(mirror, attention.q_norm),
            rotary,
            source,
            attention.local_heads,
        )
    else:
        shape = (
            attention.local_heads,
            attention.local_kv_heads,
            attention.head_dim,
            attention.attn.window,
            attention.eps,
        )
        norms = (wide_norm(mirror, attention.q_norm), wide_norm(mirror, attention.k_norm))
        v = mirror.linear(attention.v_proj) if attention.v_proj is not None else None
        mixer = GemmaAttention(
            mirror.linear(attention.q_proj),
            mirror.linear(attention.k_proj),
            v,
            mirror.linear(attention.o_proj),
            norms,
            rotary,
            shape,
        )
        owners[index] = mixer
    mlp = GeluMLP(
        mirror.linear(module.mlp.gate_proj), mirror.linear(module.mlp.up_proj), mirror.linear(module.mlp.down_proj)
    )
    norms = tuple(
        wide_norm(mirror, getattr(module, name))
        for name in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        )
    )
    per_layer = None
    if module.per_layer:
        per_layer = (
            mirror.linear(module.per_layer_input_gate),
            mirror.linear(module.per_layer_projection),
            wide_norm(mirror, module.post_per_layer_input_norm),
        )
    layer = SandwichLayer(mixer, mlp, norms, per_layer, from_torch(module.layer_scalar.data.float()))
    if isinstance(module, torch_sandwich.SandwichMoELayer):
        router = module.router
        route = (
            mirror.linear(router.proj),
            mirror.array(router.scale),
            mirror.array(router.per_expert_scale),
            router.top_k,
            router.root,
        )
        experts = module.experts
        weights = (mirror.array(experts.gate_proj), mirror.array(experts.up_proj), mirror.array(experts.down_proj))
        block_norms = tuple(
            wide_norm(mirror, getattr(module, name))
            for name in ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2")
        )
        layer.experts = ExpertBlock(route, weights, block_norms, router.eps)
    return layer
