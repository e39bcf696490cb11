"""Tensor-parallel helpers shared by the layers: shard arithmetic, sliced weight loading (whole tensors or
part by part), the all-reduce."""

import torch
import torch.distributed as dist
from torch import nn

from deployments.model_rank.forward_batch import ParallelContext


def divide(total: int, parts: int, what: str) -> int:
    """`total / parts`, refusing shapes that do not split evenly across ranks."""
    if total % parts != 0:
        raise ValueError(f"{what} ({total}) does not divide evenly into {parts} tensor-parallel shards")
    return total // parts


def copy_shard(param: torch.Tensor, loaded: torch.Tensor, dim: int | None, index: int, num_shards: int) -> None:
    """Copy shard `index` of `num_shards` (cut along `dim`, or the whole tensor when None) into `param`."""
    if dim is None:
        expected = tuple(param.shape)
    else:
        expected = tuple(n * num_shards if d == dim else n for d, n in enumerate(param.shape))
    if tuple(loaded.shape) != expected:
        raise ValueError(f"shape {tuple(loaded.shape)}, expected {expected}")
    if dim is not None and num_shards > 1:
        size = param.shape[dim]
        loaded = loaded.narrow(dim, index * size, size)
    with torch.no_grad():
        param.copy_(loaded.to(param.dtype))


def copy_part_shards(
    param: torch.Tensor, loaded: torch.Tensor, parts: tuple[int, ...], index: int, num_shards: int
) -> None:
    """Copy shard `index` of each part of `loaded` (parts of sizes `parts` laid end to end along dim 0, as
    [all q | all k | all v]) into `param`, which holds each part's shard end to end in the same order."""
    if loaded.shape[0] != sum(parts):
        raise ValueError(f"shape {tuple(loaded.shape)}, expected {sum(parts)} rows ({' + '.join(map(str, parts))})")
    local = [divide(part, num_shards, "a sharded part") for part in parts]
    for target, part in zip(param.split(local), loaded.split(list(parts))):
        copy_shard(target, part, 0, index, num_shards)


def default_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """Loader for replicated parameters: the checkpoint tensor must match exactly."""
    copy_shard(param, loaded, None, 0, 1)


def replicated_param(*shape: int) -> nn.Parameter:
    """A parameter held whole on every rank, loaded as the checkpoint stores it."""
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = default_loader
    return param


def sharded_vector(count: int, parallel: ParallelContext) -> nn.Parameter:
    """A per-head (or per-channel) parameter of `count` entries in the checkpoint: this rank's contiguous
    count / tp_size of them."""
    param = nn.Parameter(torch.empty(divide(count, parallel.tp_size, "per-head parameters")), requires_grad=False)
    param.weight_loader = lambda p, loaded: copy_shard(p, loaded, 0, parallel.tp_rank, parallel.tp_size)
    return param


def all_reduce(x: torch.Tensor, parallel: ParallelContext) -> torch.Tensor:
    """Sum the partial results of row-parallel layers across the TP group (no-op on one rank)."""
    if parallel.tp_size > 1:
        dist.all_reduce(x)
    return x
