"""Linear layers: a batch-invariant matmul plus replicated, column- and row-parallel projections.

Every projection, expert and the lm_head goes through `invariant_linear`, so that a token's result never
depends on how many other rows share the call (the engine's exactness promise).
"""

import torch
from torch import nn

from deployments.model_rank.forward_batch import ParallelContext
from deployments.model_rank.layers.parallel import (
    all_reduce,
    copy_part_shards,
    copy_shard,
    default_loader,
    divide,
)
from deployments.model_rank.layers.quantized import qtype_of
from kernels import cpu_gemm, dispatch, fp8_matmul, quant_gemm


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T (+ bias)` whose rows are bitwise independent of the number of rows in `x`.

    GGUF weights kept as blocks run on kernels/quant_gemm's fixed-order kernels (docs/gguf.md); weights
    packed at load (bf16 with the native kernels on, layers/packing.py) run on kernels/cpu_gemm's ones; on CUDA the rest run on kernels/matmul.py's Triton kernel (unless `cuda_matmul` is
    cublas, which gives that up), and elsewhere on torch's GEMMs in zero-padded 16-row tiles
    (`kernels.matmul.matmul_torch` says why). Weights an fp8 checkpoint keeps fp8 (on CUDA, fp8_weights.py)
    run on kernels/fp8_matmul.py with their block scales.
    The bias is added separately: a fused addmm is another kernel with its own row-count behaviour.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    qtype = qtype_of(weight)
    if qtype is not None:  # a GGUF weight kept as its blocks (layers/quantized.py)
        out = quant_gemm.matmul(x2, weight, qtype)  # [M, N]
    elif weight.dtype == fp8_matmul.FP8_DTYPE:
        out = fp8_matmul.fp8_matmul(x2, weight, weight.fp8_scales, weight.fp8_block_k)  # [M, N] in x's dtype
    elif cpu_gemm.is_packed(weight):
        out = cpu_gemm.matmul(x2, weight)  # [M, N]
    else:
        out = dispatch.linear(x2, weight)  # [M, N]
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, weight.shape[0])


class ReplicatedLinear(nn.Module):
    """A projection held whole on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = default_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = default_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)  # [..., out]


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks: rank r holds shard `shard_index` of `num_shards` along dim 0.

    Heads that fewer ranks than shards share (kv heads < TP size) pass their own shard_index/num_shards.
    `parts`: output blocks the checkpoint lays end to end ([all q | all k | all v]), each split on its own so
    that a rank holds its shard of every block, in the same order.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        parallel: ParallelContext,
        bias: bool = False,
        shard_index: int | None = None,
        num_shards: int | None = None,
        parts: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        if parts is not None and sum(parts) != out_features:
            raise ValueError(f"parts {parts} do not add up to {out_features} output features")
        self.parts = parts
        self.num_shards = parallel.tp_size if num_shards is None else num_shards
        self.shard_index = parallel.tp_rank if shard_index is None else shard_index
        local_out = divide(out_features, self.num_shards, "output features")
        self.weight = nn.Parameter(torch.empty(local_out, in_features), requires_grad=False)
        self.weight.weight_loader = self._load_rows
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(local_out), requires_grad=False)
            self.bias.weight_loader = self._load_rows

    def _load_rows(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        if self.parts is not None:
            copy_part_shards(param, loaded, self.parts, self.shard_index, self.num_shards)
        else:
            copy_shard(param, loaded, 0, self.shard_index, self.num_shards)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_linear(x, self.weight, self.bias)  # [..., out / shards]


class RowParallelLinear(nn.Module):
    """Input features split across ranks; partial outputs are summed with an all-reduce (when `reduce`)."""

    def __init__(
        self, in_features: int, out_features: int, parallel: ParallelContext, bias: bool = False, reduce: bool = True
    ) -> None:
        super().__init__()
        if bias and not reduce:
            raise ValueError("a row-parallel bias must be added after the reduction; keep reduce=True")
        self.parallel = parallel
        self.reduce = reduce
        local_in = divide(in_features, parallel.tp_size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, local_in), requires_grad=False)
        self.weight.weight_loader = self._load_columns
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = default_loader

    def _load_columns(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        copy_shard(param, loaded, 1, self.parallel.tp_rank, self.parallel.tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = invariant_linear(x, self.weight)  # [..., out] partial sum over this rank's inputs
        if self.reduce:
            out = all_reduce(out, self.parallel)
        if self.bias is not None:
            # Added once, after the reduction, so TP ranks do not each add it.
            out = out + self.bias
        return out


class FusedProjection:
    """Sibling projections of one input (q/k/v, gate/up) as one packed weight: one GEMM call streams all of
    them. Made after packing (layers/packing.py) where every sibling is packed, bias-free and whole groups of
    the pack's tiles, so the siblings' packs laid end to end are the fused pack, and each sibling's weight
    becomes a view of its own part (no copy kept). Each output column is the same tile ops either way.
    """

    def __init__(self, projections: list[nn.Module]) -> None:
        weights = [p.weight for p in projections]
        self.sizes = [w.shape[0] for w in weights]
        self.weight = torch.cat([w.data for w in weights])  # [sum N, K]: the packs end to end
        self.weight.bf16_packed = True
        for projection, part in zip(projections, self.weight.split(self.sizes)):
            view = nn.Parameter(part, requires_grad=False)
            view.bf16_packed = True
            projection.weight = view

    @staticmethod
    def fits(projections: list[nn.Module]) -> bool:
        weights = [p.weight for p in projections]
        return (
            all(p.bias is None and cpu_gemm.is_packed(w) and w.dim() == 2 for p, w in zip(projections, weights))
            and len({w.shape[1] for w in weights}) == 1
            and all(w.shape[0] % cpu_gemm.GROUP_ROWS == 0 for w in weights)
        )

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [..., K] -> each sibling's output [..., N_i], as views of one [..., sum N] result."""
        return list(invariant_linear(x, self.weight).split(self.sizes, dim=-1))
