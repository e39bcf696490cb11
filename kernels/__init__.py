"""Triton kernels for the CUDA path, each beside its plain-torch reference (the CPU path).

dispatch            what the layers call: Triton on CUDA tensors, torch otherwise (TENSORFOLD_KERNELS)
matmul              the projections' batch-invariant matmul (one reduction order for every row count)
paged_meta          one step's layout (rows for decode/drafts, prefill sequences) as device tensors
online_softmax      the fixed split/tile reduction tree all attention kernels share (batch invariance)
paged_decode_attention, paged_prefill_attention, attention_torch   paged GQA attention
mla_decode          MLA over the latent cache with absorbed projections (glm4_moe_lite)
sparse_mla          MLA over each query's DSA selection, absorbed (GLM-5.3 families; torch on every device)
hyper_mix           hyper-connection weights per token (GLM-5.3-Flash): torch, and one native call on CPU
rmsnorm, rotary, kv_write, moe_routing, fused_moe                  the rest of a decoder layer
recurrent_scan      Gated DeltaNet / KDA / Mamba2 per-token recurrence and causal conv over a step's sequences
causal_conv_scan, gated_delta_scan, kda_scan, mamba2_scan   the same in Triton, token after token per sequence
scan_meta           a step's recurrent sequences and captures as device tensors (and Triton's softplus)
cpu_native, cpu_gemm, cpu_attention, cpu_layer_ops   the CPU path's native kernels (cpu/*.c, cpu/*.h):
                    bf16 matmuls on weights packed at load, float32 paged attention in row tiles,
                    RMSNorm / RoPE / SiLU*up / greedy argmax; fixed per-row order, built on first use
                    at the level the CPU has: amx (AMX tiles), avx512 (AVX-512 BF16, no AMX), avx2
                    (AVX2 + FMA, bf16 widened to fp32) or, on aarch64, neon (avx2's sources on NEON),
                    one SIMD header (cpu/simd.h) for all
cpu_recurrent       the recurrent scans on CPU (cpu/recurrent.c, portable C: any CPU, no AMX), token after
                    token per sequence, threads over (sequence, head) pairs
checks, _triton     argument checks; Triton import guard (interpreter on CUDA-less machines)
testing             test helpers (poisoned outputs, float64 references, GPU-faithful interpreter dots)
compile_check       ahead-of-time sm_80/sm_90 compile of every kernel, no GPU needed
gpu_check, bench_cases   `python -m kernels.gpu_check`: compiled tests, timings and roofline on a GPU, then
                    the engine phase (serve_app/bench/gpu_engine.py, in its own process)
"""
