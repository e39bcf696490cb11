"""RMSNorm as the Hugging Face checkpoints define it (normalise in float32, scale in the model dtype), and the
hybrid families' variants: the float32-scaled norm (Nemotron-H), the zero-centred one scaled by (1 + weight)
(Qwen3-Next / Qwen3.5), and the gated norm of a Gated DeltaNet output."""

import torch
from torch import nn

from deployments.model_rank.layers.parallel import default_loader
from kernels import dispatch, rmsnorm
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


class WideScaleRMSNorm(RMSNorm):
    """RMSNorm whose scale multiplies the float32 normalised row, rounded to the input dtype once at the end
    (Nemotron-H's convention). In float32 that is the shared kernels' computation, so float32 keeps them."""

    shares_float32_kernels = True

    def scale(self) -> torch.Tensor:
        return self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.shares_float32_kernels:
            return super().forward(x)
        return rmsnorm.wide_rms_norm_torch(x, self.scale(), self.eps)  # [..., size]

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        summed = x + residual
        return self(summed), summed  # [..., size] each


class NativeWideRMSNorm(WideScaleRMSNorm):
    """WideScaleRMSNorm in one native call in bfloat16/float16 (Gemma 4's norms: four a layer). Nemotron-H
    keeps torch's ops, which its MLX mirror reproduces bit for bit."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x)
        return dispatch.wide_rms_norm(x, self.weight, self.eps)  # [..., size]


class ZeroCentredRMSNorm(WideScaleRMSNorm):
    """Qwen3-Next / Qwen3.5: the checkpoint stores `weight` around zero and the scale is (1 + weight), as
    transformers' Qwen3NextRMSNorm computes it."""

    shares_float32_kernels = False

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__(size, eps)
        nn.init.zeros_(self.weight)  # the identity scale

    def scale(self) -> torch.Tensor:
        return 1.0 + self.weight.float()


class GatedRMSNorm(RMSNorm):
    """RMSNorm(x) * silu(gate), the gate in float32 (Gated DeltaNet's output norm; norm before gate)."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return (super().forward(x) * silu(gate.float())).to(x.dtype)  # [..., size]


def unscaled_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (Gemma's value norm and router input), in float32, rounded once."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
