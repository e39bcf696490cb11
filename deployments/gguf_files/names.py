"""GGUF tensor names -> the Hugging Face names our models load, for the architectures served from GGUF.

The table is the inverse of the naming llama.cpp's converter writes (`blk.N.attn_q.weight` for
`model.layers.N.self_attn.q_proj.weight`); llama's q/k rows are stored permuted for its rotary layout.
"""

import re

# GGUF `general.architecture` -> our model_type (what transformers' GGUF reader also makes of them).
ARCHITECTURES = {"llama": "llama", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}
PERMUTED_QK = frozenset({"llama"})  # llama.cpp's converter interleaves these archs' q/k rotary halves

GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
SKIPPED = frozenset({"rope_freqs"})  # recomputed from the config

_NAME = re.compile(r"^(?:blk\.(?P<layer>\d+)\.)?(?P<base>[a-z0-9_]+)\.(?P<kind>weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a non-expert GGUF tensor; None for tensors we skip. KeyError: unknown."""
    match = _NAME.match(gguf_name)
    if match is None:
        raise KeyError(gguf_name)
    base, kind, layer = match["base"], match["kind"], match["layer"]
    if base in SKIPPED:
        return None
    if layer is None and base in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[base]}.{kind}"
    if layer is not None and base in LAYER_TENSORS:
        return f"model.layers.{layer}.{LAYER_TENSORS[base]}.{kind}"
    raise KeyError(gguf_name)


def expert_names(gguf_name: str, experts: int) -> list[str] | None:
    """Per-expert Hugging Face names of a stacked `blk.N.ffn_*_exps.weight`; None if it is not one."""
    match = _NAME.match(gguf_name)
    if match is None or match["layer"] is None or match["base"] not in EXPERT_TENSORS:
        return None
    proj = EXPERT_TENSORS[match["base"]]
    return [f"model.layers.{match['layer']}.mlp.experts.{e}.{proj}.weight" for e in range(experts)]


def permuted_heads(arch: str, gguf_name: str, heads: int, kv_heads: int) -> int | None:
    """How many heads a permuted q/k tensor's rows interleave (None: stored in Hugging Face order)."""
    if arch not in PERMUTED_QK:
        return None
    if ".attn_q." in gguf_name:
        return heads
    if ".attn_k." in gguf_name:
        return kv_heads
    return None
