"""Which backend computes a rank's forward pass, and the settings an MLX rank refuses at startup."""

import importlib.util
import platform
import sys

from deployments.config import EngineConfig, StartupError

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
    """'torch' or 'mlx'; raises StartupError (one line naming the fix) where MLX is asked for but cannot run.

    auto takes MLX on an Apple-silicon Mac where mlx imports and no setting needs the torch rank.
    """
    if config.backend == "torch":
        return "torch"
    if config.backend == "auto":
        usable = is_apple_silicon() and mlx_importable() and not _mlx_refusals(config)
        return "mlx" if usable else "torch"
    if not mlx_importable():
        raise StartupError(
            f"backend mlx needs the mlx package, which does not import here: {MLX_INSTALL}, or use --backend torch"
        )
    refusals = _mlx_refusals(config)
    if refusals:
        raise StartupError(f"backend mlx does not support {refusals[0]}")
    return "mlx"


def _mlx_refusals(config: EngineConfig) -> list[str]:
    """The settings of `config` the MLX rank cannot honour, each with its fix."""
    checks = [
        (config.device == "cuda", "device cuda (MLX computes on Metal or the CPU): use --device auto or cpu"),
        (
            config.tensor_parallel_size > 1,
            "tensor_parallel_size above 1 (an MLX rank holds the whole model): "
            "use --tensor-parallel-size 1 or --backend torch",
        ),
        (config.engine_threads is not None, "engine_threads (MLX sizes its own CPU threads): drop --engine-threads"),
    ]
    return [message for refused, message in checks if refused]
