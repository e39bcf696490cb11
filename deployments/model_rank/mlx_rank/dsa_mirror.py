"""Mirror the sparse-attention families' torch modules (GLM-5.3, GLM-5.3-Flash) into their MLX twins, through
mirror.py's `Mirror` (the `Mirror` protocol here is what they ask of it): the DSA layers with their
indexers and relays, and the hyper-connection layers (mirror.py builds their stack)."""

from collections.abc import Callable
from typing import Protocol

import mlx.core as mx
import torch
from torch import nn

from deployments.model_rank.layers import dsa_index as torch_dsa
from deployments.model_rank.layers.dsa_attention import IndexedMLAAttention as TorchIndexedMLA
from deployments.model_rank.layers.hyper_connections import HyperConnection as TorchHyperConnection
from deployments.model_rank.layers.hyper_connections import HyperLayer as TorchHyperLayer
from deployments.model_rank.layers.norm import RMSNorm as TorchRMSNorm
from deployments.model_rank.layers.rotary import RotaryEmbedding
from deployments.model_rank.mlx_rank.batch import MlxBatch
from deployments.model_rank.mlx_rank.dsa_index import (
    IndexKeyNorm,
    IndexProjections,
    PoolIndexer,
    SelectionRelay,
    TokenIndexer,
)
from deployments.model_rank.mlx_rank.hybrid_layers import ScaledRMSNorm
from deployments.model_rank.mlx_rank.hyper import HyperConnection, HyperLayer
from deployments.model_rank.mlx_rank.layers import Linear, RMSNorm, Rotary
from deployments.model_rank.mlx_rank.sparse_mla import IndexedMLAAttention


class Mirror(Protocol):
    """What these builders ask of mirror.py's `Mirror`."""

    def array(self, param: torch.Tensor) -> mx.array: ...

    def linear(self, module: nn.Module) -> Linear: ...

    def norm(self, module: TorchRMSNorm) -> RMSNorm | ScaledRMSNorm: ...

    def rotary(self, module: RotaryEmbedding | None) -> Rotary | None: ...

    def relay(self, relay: torch_dsa.SelectionRelay) -> SelectionRelay: ...

    def mixer(self, module: nn.Module) -> Callable[[mx.array, MlxBatch], mx.array]: ...

    def mlp(self, module: nn.Module) -> Callable[[mx.array], mx.array]: ...


def wide_linear(mirror: Mirror, weight: torch.Tensor) -> Linear:
    """A bias-free Linear whose weight is kept in float32 (read by float32 rows)."""
    wide = mirror.array(weight).astype(mx.float32)
    mx.eval(wide)  # MLX streams are per thread: not left for the engine's thread
    return Linear(wide, None)


def indexer(mirror: Mirror, module: torch_dsa.TokenIndexer | torch_dsa.PoolIndexer) -> TokenIndexer | PoolIndexer:
    norm = IndexKeyNorm(mirror.array(module.k_norm.weight), mirror.array(module.k_norm.bias))
    weights = wide_linear(mirror, module.weights_proj.weight)
    proj = IndexProjections(mirror.linear(module.wq_b), mirror.linear(module.wk), norm, weights, module.heads)
    if isinstance(module, torch_dsa.TokenIndexer):
        return TokenIndexer(proj, mirror.rotary(module.rotary), module.head_dim, module.topk)
    gate = Linear(mirror.array(module.index_kpool_compress_gate), None)
    ape = mirror.array(module.index_kpool_compress_ape)
    return PoolIndexer(proj, gate, ape, module.head_dim, module.pools_kept * module.pool, module.tail)


def indexed_mla(mirror: Mirror, module: TorchIndexedMLA) -> IndexedMLAAttention:
    d = module.dims
    norm, kv_norm = mirror.norm(module.q_a_layernorm), mirror.norm(module.kv_a_layernorm)
    assert isinstance(norm, RMSNorm) and isinstance(kv_norm, RMSNorm)
    projections = (
        mirror.linear(module.q_a_proj),
        norm,
        mirror.linear(module.q_b_proj),
        mirror.linear(module.kv_a_proj_with_mqa),
        kv_norm,
        mirror.linear(module.o_proj),
    )
    return IndexedMLAAttention(
        projections,
        mirror.array(module.kv_b_proj.weight),
        mirror.rotary(module.rotary),
        (module.local_heads, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim, d.kv_lora_rank),
        module.scale,
        None if module.indexer is None else indexer(mirror, module.indexer),
        mirror.relay(module.relay),
    )


def hyper_connection(mirror: Mirror, module: TorchHyperConnection) -> HyperConnection:
    fn = wide_linear(mirror, module.fn)
    base, scale = mirror.array(module.base), mirror.array(module.scale)
    return HyperConnection(fn, base, scale, module.n, module.eps, module.hc_eps, module.iters)


def hyper_layer(mirror: Mirror, module: TorchHyperLayer) -> HyperLayer:
    connections = (hyper_connection(mirror, module.attn_hc), hyper_connection(mirror, module.ffn_hc))
    return HyperLayer(
        mirror.norm(module.input_layernorm),
        mirror.mixer(module.mixer),
        mirror.norm(module.post_attention_layernorm),
        mirror.mlp(module.mlp),
        connections,
    )
