"""RMSNorm as the Hugging Face checkpoints define it (normalise in float32, scale in the model dtype), and the
two variants Qwen3-Next / Qwen3.5 add: the zero-centred norm scaled by (1 + weight), and the gated norm of
their Gated DeltaNet output."""

import torch
from torch import nn

from deployments.model_rank.layers.parallel import default_loader
from kernels import dispatch
from kernels.activation import silu


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.weight.weight_loader = default_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.rms_norm(x, self.weight, self.eps)  # [..., size]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual): a sublayer's output joins the residual stream, normed."""
        return dispatch.add_rms_norm(x, residual, self.weight, self.eps)  # [..., size] each


class ZeroCentredRMSNorm(RMSNorm):
    """Qwen3-Next / Qwen3.5: the checkpoint stores `weight` around zero and the scale is (1 + weight); the
    normalised row is scaled in float32 and rounded once, as transformers' Qwen3NextRMSNorm does."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__(size, eps)
        nn.init.zeros_(self.weight)  # the identity scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)  # [..., size]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return self(summed), summed


class GatedRMSNorm(RMSNorm):
    """RMSNorm(x) * silu(gate), the gate in float32 (Gated DeltaNet's output norm; norm before gate)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return (super().forward(x) * silu(gate.float())).to(x.dtype)  # [..., size]
