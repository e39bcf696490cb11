"""Which backend computes a rank's forward pass, and the settings an MLX rank refuses at startup."""

import importlib.util
import platform
import sys

from deployments.config import EngineConfig
from deployments.scheduler.memory import StartupError

MLX_INSTALL = "pip install 'tensorfold[mlx]'"


def mlx_importable() -> bool:
    if importlib.util.find_spec("mlx") is None:
        return False
    try:
        importlib.import_module("mlx.core")
    except (ImportError, OSError):  # a wheel for another platform, or a broken install
        return False
    return True


def is_apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def resolve_backend(config: EngineConfig) -> str:
    """'torch' or 'mlx'; raises StartupError (one line naming the fix) where MLX is asked for but cannot run."""
    if config.backend == "torch":
        return "torch"
    if config.backend == "auto":
        return "mlx" if is_apple_silicon() and mlx_importable() and config.device != "cuda" else "torch"
    if not mlx_importable():
        raise StartupError(f"backend mlx needs the mlx package, which does not import here: {MLX_INSTALL}, "
                           "or use --backend torch")  # fmt: skip
    refusals = [
        (config.device == "cuda", "device cuda (MLX computes on Metal or the CPU): use --device auto or cpu"),
        (config.tensor_parallel_size > 1, "tensor_parallel_size above 1 (an MLX rank holds the whole model): "
                                          "use --tensor-parallel-size 1 or --backend torch"),
        (config.engine_threads is not None, "engine_threads (MLX sizes its own CPU threads): drop --engine-threads"),
        (config.draft == "mtp", "draft mtp (the MLX rank drafts with n-gram lookup): use --draft ngram, auto or off"),
    ]
    for refused, message in refusals:
        if refused:
            raise StartupError(f"backend mlx does not support {message}")
    return "mlx"
