"""RMSNorm as the Hugging Face checkpoints define it (normalise in float32, scale in the model dtype)."""

import torch
from torch import nn

from deployments.model_rank.layers.parallel import default_loader
from kernels import dispatch


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


class WideScaleRMSNorm(RMSNorm):
    """RMSNorm whose weight scales the float32 normalised value, rounded to the input dtype once at the end
    (Nemotron-H's convention). In float32 the two conventions are the same computation, so float32 keeps
    the shared kernels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)  # [..., size]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return self(summed), summed  # [..., size] each
