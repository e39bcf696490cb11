"""Mirror the hybrid families' torch modules (recurrent mixers, gated shared experts, Nemotron-H's blocks)
into their MLX twins, through mirror.py's `Mirror` (which copies each tensor once and frees it; the `Mirror`
protocol here is what they ask of it)."""

from collections.abc import Callable
from typing import Protocol

import mlx.core as mx
import torch
from torch import nn

from deployments.model_rank.layers.gated_delta import GatedDeltaNet as TorchGatedDeltaNet
from deployments.model_rank.layers.gated_delta import GroupedProjectionDeltaNet
from deployments.model_rank.layers.kda import KimiDeltaAttention as TorchKda
from deployments.model_rank.layers.latent_moe import LatentMoE as TorchLatentMoE
from deployments.model_rank.layers.mamba2 import Mamba2Mixer as TorchMamba2
from deployments.model_rank.layers.mlp import ReluSquaredMLP as TorchReluSquaredMLP
from deployments.model_rank.layers.moe import Router as TorchRouter
from deployments.model_rank.layers.moe import SharedExpertGateMoE
from deployments.model_rank.layers.norm import RMSNorm as TorchRMSNorm
from deployments.model_rank.layers.recurrent import RecurrentMixer as TorchRecurrentMixer
from deployments.model_rank.mlx_rank.attention import MLAAttention, SelfAttention
from deployments.model_rank.mlx_rank.gated_delta import GatedDeltaNet, GroupedProjections, SplitProjections
from deployments.model_rank.mlx_rank.hybrid_layers import (
    GatedSharedExpert,
    LatentMoE,
    NemotronBlock,
    ReluSquaredMLP,
    ScaledRMSNorm,
)
from deployments.model_rank.mlx_rank.kda import KimiDeltaAttention, SigmoidGatedRMSNorm
from deployments.model_rank.mlx_rank.layers import GatedMLP, Linear, RMSNorm, Router, SparseMoE
from deployments.model_rank.mlx_rank.mamba2 import GatedGroupRMSNorm, Mamba2Mixer
from deployments.model_rank.mlx_rank.recurrent import RecurrentMixer
from deployments.model_rank.models.nemotron_h import NemotronHBlock


class Mirror(Protocol):
    """What these builders ask of mirror.py's `Mirror`."""

    def array(self, param: torch.Tensor) -> mx.array: ...

    def linear(self, module: nn.Module) -> Linear: ...

    def norm(self, module: TorchRMSNorm) -> RMSNorm | ScaledRMSNorm: ...

    def router(self, gate: TorchRouter) -> Router: ...

    def mlp(self, module: nn.Module) -> Callable[[mx.array], mx.array]: ...

    def attention(self, module: nn.Module) -> SelfAttention | MLAAttention: ...


def conv_taps(mirror: Mirror, weight: nn.Parameter) -> mx.array:
    """A depthwise conv's weight [C, 1, K] as [C, K]."""
    taps = mirror.array(weight)
    taps = taps.reshape(taps.shape[0], taps.shape[2])
    mx.eval(taps)  # MLX streams are per thread: not left for the engine's thread
    return taps


def gated_delta_net(mirror: Mirror, module: TorchGatedDeltaNet) -> GatedDeltaNet:
    s = module.shape
    project: GroupedProjections | SplitProjections
    if isinstance(module, GroupedProjectionDeltaNet):
        project = GroupedProjections(mirror.linear(module.in_proj_qkvz), mirror.linear(module.in_proj_ba), s)
    else:
        linears = [mirror.linear(getattr(module, f"in_proj_{part}")) for part in ("qkv", "z", "b", "a")]
        project = SplitProjections(*linears, s)
    norm = mirror.norm(module.norm)
    assert not isinstance(norm, ScaledRMSNorm)
    return GatedDeltaNet(
        s,
        project,
        conv_taps(mirror, module.conv1d.weight),
        mirror.array(module.A_log),
        mirror.array(module.dt_bias),
        norm,
        mirror.linear(module.out_proj),
    )


def mamba2(mirror: Mirror, module: TorchMamba2) -> Mamba2Mixer:
    bias = module.conv1d.bias
    return Mamba2Mixer(
        module.shape,
        mirror.linear(module.in_proj),
        conv_taps(mirror, module.conv1d.weight),
        mirror.array(bias) if bias is not None else None,
        mirror.array(module.dt_bias),
        mirror.array(module.A_log),
        mirror.array(module.D),
        GatedGroupRMSNorm(mirror.array(module.norm.weight), module.norm.group_size, module.norm.eps),
        mirror.linear(module.out_proj),
    )


def kimi_delta_attention(mirror: Mirror, module: TorchKda) -> KimiDeltaAttention:
    taps = mx.concatenate([conv_taps(mirror, getattr(module, f"{name}_conv1d").weight) for name in "qkv"])
    mx.eval(taps)  # MLX streams are per thread: not left for the engine's thread
    qkv = (mirror.linear(module.q_proj), mirror.linear(module.k_proj), mirror.linear(module.v_proj))
    decay = (mirror.linear(module.f_a_proj), mirror.linear(module.f_b_proj))
    return KimiDeltaAttention(
        module.shape,
        qkv,
        taps,
        (*decay, mirror.array(module.A_log), mirror.array(module.dt_bias)),
        mirror.linear(module.b_proj),
        (mirror.linear(module.g_a_proj), mirror.linear(module.g_b_proj)),
        (SigmoidGatedRMSNorm(mirror.array(module.o_norm.weight), module.o_norm.eps), mirror.linear(module.o_proj)),
    )


def recurrent_mixer(mirror: Mirror, module: TorchRecurrentMixer) -> RecurrentMixer:
    if isinstance(module, TorchGatedDeltaNet):
        return gated_delta_net(mirror, module)
    if isinstance(module, TorchKda):
        return kimi_delta_attention(mirror, module)
    if isinstance(module, TorchMamba2):
        return mamba2(mirror, module)
    raise TypeError(f"no MLX mirror for {type(module).__name__}")


def relu_squared_mlp(mirror: Mirror, module: TorchReluSquaredMLP) -> ReluSquaredMLP:
    return ReluSquaredMLP(mirror.linear(module.up_proj), mirror.linear(module.down_proj))


def hybrid_mlp(mirror: Mirror, module: nn.Module) -> Callable[[mx.array], mx.array] | None:
    """The MLX twin of a hybrid family's feed-forward block (None: not one of theirs)."""
    if isinstance(module, SharedExpertGateMoE):
        expert = mirror.mlp(module.shared_expert)
        assert isinstance(expert, GatedMLP)
        shared = GatedSharedExpert(expert, mirror.linear(module.shared_expert_gate))
        experts = module.experts
        gate, up, down = (mirror.array(p) for p in (experts.gate_proj, experts.up_proj, experts.down_proj))
        return SparseMoE(mirror.router(module.gate), gate, up, down, shared)
    if isinstance(module, TorchReluSquaredMLP):
        return relu_squared_mlp(mirror, module)
    if isinstance(module, TorchLatentMoE):
        fc1, fc2 = module.fc1_latent_proj, module.fc2_latent_proj
        return LatentMoE(
            mirror.router(module.gate),
            mirror.array(module.experts.up_proj),
            mirror.array(module.experts.down_proj),
            relu_squared_mlp(mirror, module.shared_experts),
            mirror.linear(fc1) if fc1 is not None else None,
            mirror.linear(fc2) if fc2 is not None else None,
        )
    return None


def nemotron_block(mirror: Mirror, module: NemotronHBlock) -> NemotronBlock:
    norm = mirror.norm(module.norm)
    assert isinstance(norm, ScaledRMSNorm)
    mixer: Callable
    if module.kind == "mamba":
        mixer = mamba2(mirror, module.mixer)
    elif module.kind == "attention":
        mixer = mirror.attention(module.mixer)
    else:
        mlp = hybrid_mlp(mirror, module.mixer)
        assert mlp is not None
        mixer = mlp
    return NemotronBlock(module.kind, norm, mixer)
