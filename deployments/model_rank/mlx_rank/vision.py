"""The MLX twin of Qwen3.5's vision tower (deployments/model_rank/models/qwen3_5_vision.py), mirrored from
the torch tower as it loads: the same computation over MLX arrays, one image per call."""

import math

import mlx.core as mx
import numpy as np

from deployments.model_rank.mlx_rank.arrays import from_torch
from deployments.model_rank.models.qwen3_5_vision import VisionTower, merge_order, position_taps

GELU_TANH = math.sqrt(2 / math.pi)


def _layer_norm(x: mx.array, weight: mx.array, bias: mx.array) -> mx.array:
    return mx.fast.layer_norm(x, weight, bias, 1e-6)


def _gelu(x: mx.array, tanh: bool) -> mx.array:
    if tanh:
        return 0.5 * x * (1 + mx.tanh(GELU_TANH * (x + 0.044715 * x * x * x)))
    return 0.5 * x * (1 + mx.erf(x / math.sqrt(2)))


def _rotate(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """Rotate-half RoPE over the whole head in float32: x [N, heads, hd], cos/sin [N, 1, hd]."""
    xf = x.astype(mx.float32)
    half = x.shape[-1] // 2
    rotated = mx.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


class MlxVisionTower:
    """`tower(patches [t * h * w, C * Tp * P * P], grid) -> [placeholders, out_hidden_size]`."""

    def __init__(self, torch_tower: VisionTower) -> None:
        self.cfg = cfg = torch_tower.cfg
        params = {name: from_torch(p) for name, p in torch_tower.named_parameters()}
        self.p = params
        # A conv whose stride is its kernel over inputs of exactly the kernel's size is one matmul.
        self.patch_weight = params["patch_embed.proj.weight"].reshape(cfg.hidden_size, -1)
        self.inv_freq = np.asarray(torch_tower.inv_freq.numpy(), dtype=np.float32)
        self.side = int(cfg.num_position_embeddings**0.5)
        self.tanh_mlp = cfg.hidden_act == "gelu_pytorch_tanh"
        if cfg.hidden_act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"the MLX vision tower does not run hidden_act {cfg.hidden_act!r}")

    def linear(self, name: str, x: mx.array) -> mx.array:
        return x @ self.p[f"{name}.weight"].T + self.p[f"{name}.bias"]

    def __call__(self, patches: mx.array, grid: tuple[int, int, int]) -> mx.array:
        cfg, dtype = self.cfg, self.patch_weight.dtype
        x = patches.astype(dtype) @ self.patch_weight.T + self.p["patch_embed.proj.bias"]  # [N, D]
        rows, cols = merge_order(grid, cfg.spatial_merge_size)
        index, weight = position_taps(rows, cols, grid, self.side)  # host index maths
        table = self.p["pos_embed.weight"][mx.array(index.numpy())]  # [N, 4, D]
        x = x + (table * mx.array(weight.numpy())[:, :, None]).sum(axis=1).astype(x.dtype)
        angles = np.stack([rows.numpy(), cols.numpy()], axis=1)[..., None].astype(np.float32) * self.inv_freq
        emb = np.concatenate([angles[:, 0], angles[:, 1]], axis=-1)  # [N, hd/2]
        cos = mx.array(np.concatenate([np.cos(emb), np.cos(emb)], axis=-1))[:, None, :]
        sin = mx.array(np.concatenate([np.sin(emb), np.sin(emb)], axis=-1))[:, None, :]
        for index in range(cfg.depth):
            x = self._block(f"blocks.{index}", x, cos, sin, grid[1] * grid[2])
        merged = _layer_norm(x, self.p["merger.norm.weight"], self.p["merger.norm.bias"])
        merged = merged.reshape(-1, cfg.hidden_size * cfg.spatial_merge_size**2)
        return self.linear("merger.linear_fc2", _gelu(self.linear("merger.linear_fc1", merged), tanh=False))

    def _block(self, name: str, x: mx.array, cos: mx.array, sin: mx.array, frame: int) -> mx.array:
        p, n, heads = self.p, x.shape[0], self.cfg.num_heads
        normed = _layer_norm(x, p[f"{name}.norm1.weight"], p[f"{name}.norm1.bias"])
        qkv = self.linear(f"{name}.attn.qkv", normed).reshape(n, 3, heads, -1)
        q, k, v = _rotate(qkv[:, 0], cos, sin), _rotate(qkv[:, 1], cos, sin), qkv[:, 2]
        outs = []
        for start in range(0, n, frame):  # each frame attends alone, no mask
            part = [t[start : start + frame].transpose(1, 0, 2)[None] for t in (q, k, v)]
            scale = 1 / math.sqrt(q.shape[-1])
            outs.append(mx.fast.scaled_dot_product_attention(*part, scale=scale)[0].transpose(1, 0, 2))
        x = x + self.linear(f"{name}.attn.proj", mx.concatenate(outs).reshape(n, -1))
        normed = _layer_norm(x, p[f"{name}.norm2.weight"], p[f"{name}.norm2.bias"])
        hidden = _gelu(self.linear(f"{name}.mlp.linear_fc1", normed), tanh=self.tanh_mlp)
        return x + self.linear(f"{name}.mlp.linear_fc2", hidden)
