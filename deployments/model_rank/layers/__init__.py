"""Layers every model file is built from; tensor parallelism lives here, not in the model files.

linear (batch-invariant matmul, replicated / column / row-parallel projections), parallel (shard maths,
all-reduce), norm, rotary, activation, embedding (embedding + lm_head), attention (paged KV + GQA
self-attention), mla (latent attention), mlp, moe (routers, experts), decoder (layer + stack).
"""
