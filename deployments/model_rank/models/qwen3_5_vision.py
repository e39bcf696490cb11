"""Qwen3.5's vision tower (`model.visual.*`): an image's patches to one embedding per placeholder token.

Patches (transformers' `pixel_values` rows: channels x temporal patch x patch x patch values each) go
through a 3D-conv patch embedding, plus the learned position table resampled bilinearly to the image's
grid, then pre-norm transformer blocks whose attention rotates q and k by each patch's (row, column) and
sees only its own frame; the merger folds each merge x merge square of patches into one language-model
embedding. Every rank holds the whole tower (it is small beside the language model), so an image is
encoded on each rank alike and no collective is needed. One image per call: its embeddings depend only
on its pixels, whatever else a step holds (docs/engine.md, Vision).
"""

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deployments.model_rank.layers.parallel import default_loader


@dataclass(frozen=True)
class VisionConfig:
    """config.json's `vision_config` keys the tower reads (defaults: transformers' Qwen3_5VisionConfig)."""

    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584  # the language model's hidden size
    num_position_embeddings: int = 2304  # a square table of learned positions
    rope_theta: float = 10000.0
    hidden_act: str = "gelu_pytorch_tanh"

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "VisionConfig":
        rope = raw.get("rope_parameters") or {}
        if rope.get("rope_type", "default") not in ("default", "axial"):
            raise ValueError(f"vision_config.rope_parameters.rope_type {rope['rope_type']!r} is not supported (axial)")
        act = str(raw.get("hidden_act", cls.hidden_act))
        if act not in ACTIVATIONS:
            raise ValueError(f"vision_config.hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})")
        sizes = {
            key.name: int(raw[key.name]) for key in fields(cls) if key.type is int and raw.get(key.name) is not None
        }
        theta = float(rope.get("rope_theta", raw.get("rope_theta", cls.rope_theta)))
        return cls(**sizes, rope_theta=theta, hidden_act=act)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


ACTIVATIONS = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "silu": F.silu,
}


class VisionBlock(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)); attention within each frame, no mask."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.attn.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.mlp.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frame: int) -> torch.Tensor:
        x = x + self.attention(self.norm1(x), cos, sin, frame)
        act = ACTIVATIONS[self.cfg.hidden_act]
        return x + self.mlp.linear_fc2(act(self.mlp.linear_fc1(self.norm2(x))))

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, frame: int) -> torch.Tensor:
        """x [N, D] -> [N, D]; cos/sin [N, head_dim] float32; each run of `frame` patches attends alone."""
        n, heads = x.shape[0], self.cfg.num_heads
        q, k, v = self.attn.qkv(x).view(n, 3, heads, -1).unbind(1)  # [N, heads, hd] each
        q, k = (_rotate(t, cos, sin) for t in (q, k))
        outs = []
        for start in range(0, n, frame):  # [1, heads, frame, hd]
            part = [t[start : start + frame].transpose(0, 1)[None] for t in (q, k, v)]
            outs.append(F.scaled_dot_product_attention(*part)[0].transpose(0, 1))
        return self.attn.proj(torch.cat(outs).reshape(n, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the whole head, in float32 (as transformers' vision attention does)."""
    xf, c, s = x.float(), cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * c + rotated * s).to(x.dtype)


class VisionTower(nn.Module):
    """transformers' Qwen3_5VisionModel with the merger's output: `forward(patches, grid) -> [tokens, H]`."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel, stride=kernel)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        merged = cfg.hidden_size * cfg.spatial_merge_size**2
        self.merger = nn.Module()
        self.merger.norm = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.merger.linear_fc1 = nn.Linear(merged, merged)
        self.merger.linear_fc2 = nn.Linear(merged, cfg.out_hidden_size)
        spatial = cfg.head_dim // 2
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32) / spatial))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for param in self.parameters():
            param.requires_grad_(False)
            param.weight_loader = default_loader  # type: ignore[attr-defined]

    @torch.no_grad()
    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """patches [t * h * w, C * Tp * P * P] (any float dtype) -> [t * h * w / merge^2, out_hidden_size]."""
        cfg, dtype = self.cfg, self.patch_embed.proj.weight.dtype
        shape = (-1, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        x = self.patch_embed.proj(patches.to(dtype).view(shape)).view(-1, cfg.hidden_size)
        rows, cols = merge_order(grid, cfg.spatial_merge_size)  # each patch's (row, column), [N] each
        x = x + self._positions(rows, cols, grid).to(x.dtype)
        cos, sin = self._rotary(rows, cols)
        for block in self.blocks:
            x = block(x, cos, sin, frame=grid[1] * grid[2])
        merged = self.merger.norm(x).view(-1, cfg.hidden_size * cfg.spatial_merge_size**2)
        return self.merger.linear_fc2(F.gelu(self.merger.linear_fc1(merged)))

    def _positions(self, rows: torch.Tensor, cols: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """The square learned table resampled to the grid (bilinear, corners aligned), per patch [N, D]."""
        index, weight = position_taps(rows, cols, grid, int(self.cfg.num_position_embeddings**0.5))
        return (self.pos_embed(index) * weight[:, :, None]).sum(1)  # float32 weights, as transformers

    def _rotary(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, head_dim] float32: the first quarter of the pairs turn with the row, the next with
        the column, and the second half repeats the first."""
        freqs = torch.stack([rows, cols], dim=1)[..., None].float() * self.inv_freq  # [N, 2, hd/4]
        cos, sin = freqs.cos(), freqs.sin()
        cos, sin = (torch.cat([t[:, 0], t[:, 1]], dim=-1) for t in (cos, sin))
        return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


def merge_order(grid: tuple[int, int, int], merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (row, column), in the preprocessor's order: frame by frame, merge x merge squares in
    raster order, raster order inside each square."""
    t, h, w = grid
    rows = torch.arange(h)[:, None].expand(h, w).reshape(h // merge, merge, w // merge, merge)
    cols = torch.arange(w)[None, :].expand(h, w).reshape(h // merge, merge, w // merge, merge)
    rows, cols = (x.transpose(1, 2).flatten() for x in (rows, cols))
    return rows.repeat(t), cols.repeat(t)


def position_taps(
    rows: torch.Tensor, cols: torch.Tensor, grid: tuple[int, int, int], side: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's four entries of the square position table [N, 4] and their float32 weights [N, 4]."""
    h_taps, h_weights = _bilinear_taps(rows, grid[1], side)
    w_taps, w_weights = _bilinear_taps(cols, grid[2], side)
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    return index, (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)


def _bilinear_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two taps into a `side`-long axis and their weights for positions 0..size-1 (corners aligned)."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    taps = (floor.long()[:, None] + torch.arange(2)).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - torch.arange(2)).abs()).clamp(min=0)
    return taps, weights
