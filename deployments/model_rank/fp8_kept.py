"""Block-scaled FP8 projections kept FP8 on CUDA: their parameters made float8_e4m3fn with per-row scales,
loaded shard by shard as their weights are, for kernels/fp8_matmul.py (docs/checkpoints.md)."""

from collections.abc import Callable

import torch
from torch import nn

from deployments.model_rank.fp8_weights import FP8_DTYPE, SCALE_SUFFIX, Fp8Scheme, TensorSource
from deployments.model_rank.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from deployments.model_rank.weights import WeightTarget


def keep_fp8_projections(
    model: nn.Module, files: TensorSource, scheme: Fp8Scheme, target_of: Callable[[str], WeightTarget | None]
) -> frozenset[str]:
    """Make the weights of the linear layers that fp8 tensors fill float8_e4m3fn, each with `fp8_scales`
    ([rows, ceil(cols / bk)] float32) and `fp8_block_k` for kernels/fp8_matmul.py, and their loaders copy
    both. Returns the checkpoint names so kept; every other fp8 tensor is dequantized."""
    modules = dict(model.named_modules())
    kept: set[str] = set()
    for name in files.weight_map:
        target = target_of(name) if name + SCALE_SUFFIX in files.weight_map else None
        if target is None or target.expert_id is not None or target.fused_gate_up:
            continue  # experts run in the fused MoE kernels, which read the model dtype
        owner, _, leaf = target.param.rpartition(".")
        module = modules.get(owner)
        if leaf == "weight" and _runs_through_invariant_linear(owner, module, scheme):
            if module.weight.dtype != FP8_DTYPE:
                _make_fp8(module.weight, scheme)
            kept.add(name)
    return frozenset(kept)


def _runs_through_invariant_linear(owner: str, module: nn.Module | None, scheme: Fp8Scheme) -> bool:
    if not isinstance(module, ReplicatedLinear | ColumnParallelLinear | RowParallelLinear):
        return False
    if owner.endswith("kv_b_proj"):
        return False  # layers/mla.py reads this weight itself, in the model dtype
    # A rank's share of a row-parallel weight's columns must be whole scale blocks to keep its scales.
    return not (isinstance(module, RowParallelLinear) and module.weight.shape[1] % scheme.block_k)


def _make_fp8(param: nn.Parameter, scheme: Fp8Scheme) -> None:
    rows, cols = param.shape
    param.data = torch.empty(rows, cols, dtype=FP8_DTYPE, device=param.device)
    param.fp8_scales = torch.empty(rows, -(-cols // scheme.block_k), dtype=torch.float32, device=param.device)
    param.fp8_block_k = scheme.block_k
    load = param.weight_loader

    def load_with_scales(target: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.dtype != FP8_DTYPE:
            raise ValueError(f"{loaded.dtype} tensor for a weight kept fp8 (an fp8 checkpoint has it fp8)")
        load(target, loaded)
        load(target.fp8_scales, loaded.fp8_scales)  # the layer's own shard of the rows (or column blocks)

    param.weight_loader = load_with_scales
