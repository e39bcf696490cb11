"""Layers every model file is built from; tensor parallelism lives here, not in the model files.

linear (batch-invariant matmul, replicated / column / row-parallel projections), parallel (shard maths,
all-reduce), norm, rotary, activation, embedding (embedding + lm_head), attention (paged KV + GQA
self-attention, gated), mla (latent attention), mlp, moe (routers, experts), decoder (layer + stack),
recurrent (what state-slot layers share), gated_delta (Qwen3-Next / Qwen3.5's Gated DeltaNet).
"""
