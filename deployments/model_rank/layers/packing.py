"""Packing a loaded model's projection weights for the CPU matmul kernel (kernels/cpu_gemm.py), once, and
fusing sibling projections of one input (layers/linear.py FusedProjection) over the packs.

Only weights that go through `invariant_linear` (and the embedding tied to a packed lm_head, which reads
rows back out of the pack) are packed; each tensor is packed once even when modules share it.
"""

import torch
from torch import nn

from deployments.model_rank.layers.embedding import LMHead, VocabEmbedding
from deployments.model_rank.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from deployments.model_rank.layers.moe import Experts
from kernels import cpu_gemm

PROJECTIONS = (ReplicatedLinear, ColumnParallelLinear, RowParallelLinear, LMHead)


def projection_weights(model: nn.Module) -> list[torch.Tensor]:
    """Every distinct weight tensor the model multiplies through invariant_linear."""
    found: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, PROJECTIONS):
            found.setdefault(module.weight.data_ptr(), module.weight)
        elif isinstance(module, Experts):
            for stack in (module.gate_proj, module.up_proj, module.down_proj):
                found.setdefault(stack.data_ptr(), stack)
    return list(found.values())


def pack_projections(model: nn.Module) -> int:
    """Pack every projection the kernel can take; returns how many tensors were packed (0: kernel off)."""
    if not cpu_gemm.available():
        return 0
    packed: set[int] = set()
    for weight in projection_weights(model):
        if cpu_gemm.can_pack(weight):
            cpu_gemm.pack_(weight)
            packed.add(weight.data_ptr())
    for param in model.parameters():  # another Parameter over a packed storage reads it packed too
        if param.data_ptr() in packed:
            param.bf16_packed = True
    for module in model.modules():  # q/k/v and gate/up: one call each where their packs line up
        fuse = getattr(module, "fuse_projections", None)
        if fuse is not None:
            fuse()
    return len(packed)


def mark_block_params(model: nn.Module) -> int:
    """Let every projection, expert stack and vocabulary table take a GGUF file's raw blocks
    (layers/quantized.py); returns how many parameters may."""
    params = projection_weights(model)
    params += [m.weight for m in model.modules() if isinstance(m, VocabEmbedding)]
    for param in params:
        param.takes_blocks = True
    return len({id(p) for p in params})
