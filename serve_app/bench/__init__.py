"""`tensorfold bench ...`: benchmarks that print a table and compare side by side in one run.

Parsers only here; each benchmark's module (torch, Ray, transformers) is imported when it runs.
"""

import argparse
import importlib


def _runner(module: str):
    return lambda args: importlib.import_module(f"serve_app.bench.{module}").run(args)


def _add_draft(parser: argparse.ArgumentParser, default: str, help_text: str) -> None:
    parser.add_argument("--draft", default=default, choices=["off", "auto", "mtp", "ngram"], help=help_text)


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="run a benchmark and print a table")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)

    engine = kinds.add_parser("engine", help="engine vs transformers: prefill, decode at 1 and N, roofline")
    engine.add_argument("--checkpoint", help="checkpoint dir (default: a random bf16 Qwen3 model of --size)")
    engine.add_argument(
        "--size",
        default="qwen3-190m",
        choices=["qwen3-190m", "bench", "qwen3_5-200m", "gemma4-200m", "glm5_next-200m"],
        help="qwen3-190m: ~190M parameters with the real Qwen3 tokenizer; bench: ~130M, 32k vocab; "
        "qwen3_5-200m: a ~200M Qwen3.5-shaped hybrid (Gated DeltaNet and attention layers), 32k vocab; "
        "gemma4-200m: a ~200M Gemma 4-shaped model (512-token sliding and full layers), 32k vocab; "
        "glm5_next-200m: a ~200M GLM-5.3-Flash-shaped model (KDA, sparse MLA, experts), 32k vocab",
    )
    engine.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    engine.add_argument("--threads", type=int, default=0, help="intra-op threads (default: every core)")
    engine.add_argument("--prompt-tokens", type=int, default=256)
    engine.add_argument("--decode-tokens", type=int, default=128)
    engine.add_argument("--concurrency", type=int, default=16)
    engine.add_argument("--skip-transformers", action="store_true")
    engine.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sample every reply token at this temperature on both sides (default 0: greedy)",
    )
    _add_draft(engine, "off", "the engine's drafts (default off: plain decode, as transformers' generate runs)")
    engine.add_argument(
        "--backend",
        default="torch",
        choices=["torch", "mlx"],
        help="mlx: measure the MLX rank beside the torch rank, in the same run (needs tensorfold[mlx])",
    )
    engine.add_argument("--profile", action="store_true", help="also print where a step's time goes, by part")
    engine.set_defaults(func=_runner("engine_bench"))

    dsa = kinds.add_parser(
        "dsa", help="sparse attention at long context: decode and prefill, as selected vs reading every token"
    )
    dsa.add_argument("--checkpoint", help="a glm5_next / glm_moe_dsa checkpoint (default: a random one of --size)")
    dsa.add_argument("--size", default="glm5_next-200m", choices=["glm5_next-200m"])
    dsa.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    dsa.add_argument("--threads", type=int, default=0, help="intra-op threads (default: every core)")
    dsa.add_argument("--context", type=int, default=8192, help="the prompt's tokens before decoding")
    dsa.add_argument("--decode-tokens", type=int, default=32)
    dsa.set_defaults(func=_runner("dsa_bench"))

    vision = kinds.add_parser(
        "vision", help="image encode time and a one-image chat's TTFT vs transformers (Qwen3.5 with a vision tower)"
    )
    vision.add_argument("--checkpoint", help="a checkpoint with a vision tower (default: a random one of --size)")
    vision.add_argument("--size", default="qwen3_5-vl-bench", choices=["qwen3_5-vl-bench"])
    vision.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    vision.add_argument("--images", type=int, default=3, help="pictures measured (the median is reported)")
    vision.add_argument("--image-size", default="1024x768", help="each picture's WIDTHxHEIGHT in pixels")
    vision.add_argument("--threads", type=int, default=0, help="intra-op threads (default: every core)")
    vision.set_defaults(func=_runner("vision_bench"))

    store = kinds.add_parser(
        "store", help="a long conversation's first token: restored from the disk store vs prefilled"
    )
    store.add_argument("--checkpoint", help="checkpoint dir (default: a random bf16 Qwen3 model of --size)")
    store.add_argument("--size", default="qwen3-190m", choices=["qwen3-190m", "bench"])
    store.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    store.add_argument("--threads", type=int, default=0, help="intra-op threads (default: every core)")
    store.add_argument("--prompt-tokens", type=int, default=8192)
    store.set_defaults(func=_runner("store_bench"))

    snapshots = kinds.add_parser(
        "snapshots", help="hybrid models: prompts sharing a long prefix, per state_snapshot_tokens interval"
    )
    snapshots.add_argument("--checkpoint", help="a hybrid checkpoint dir (default: a random bf16 one of --size)")
    snapshots.add_argument("--size", default="qwen3_5-200m", choices=["qwen3_5-200m"])
    snapshots.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    snapshots.add_argument("--threads", type=int, default=0, help="intra-op threads (default: every core)")
    snapshots.add_argument("--shared-tokens", type=int, default=3000, help="the prefix every prompt shares")
    snapshots.add_argument("--question-tokens", type=int, default=64, help="each prompt's own part after it")
    snapshots.add_argument("--requests", type=int, default=4, help="prompts after the first (which warms)")
    snapshots.add_argument("--context", type=int, default=4096)
    snapshots.add_argument(
        "--every", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096], help="state_snapshot_tokens values"
    )
    snapshots.set_defaults(func=_runner("snapshot_bench"))

    grammar = kinds.add_parser("grammar", help="decode tok/s at N concurrent: json_schema grammar vs unconstrained")
    grammar.add_argument("--checkpoint", help="checkpoint dir (default: a random ~130M Qwen3-shaped bf16 model)")
    grammar.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    grammar.add_argument("--prompt-tokens", type=int, default=32)
    grammar.add_argument("--decode-tokens", type=int, default=64)
    grammar.add_argument("--concurrency", type=int, default=16)
    grammar.set_defaults(func=_runner("grammar_bench"))

    drafts = kinds.add_parser("drafts", help="decode tok/s drafted vs draft: false (MTP, n-gram, 16 streams)")
    drafts.add_argument("--model", default="builtin:tiny-glm", help="a checkpoint with an MTP layer")
    drafts.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    drafts.add_argument("--threads", type=int, default=0, help="intra-op threads (default: every core)")
    drafts.add_argument("--draft-tokens", type=int, default=None, help="most drafts per round (default: the method's)")
    drafts.add_argument("--draft-policy", default="measured", choices=["measured", "fixed"])
    drafts.add_argument("--max-tokens", type=int, default=64)
    drafts.add_argument("--concurrency", type=int, default=16)
    drafts.add_argument("--repeats", type=int, default=3)
    drafts.set_defaults(func=_runner("drafts_bench"))

    slide = kinds.add_parser(
        "slide", help="living weights: seconds to learn a fact, facts held, decode tok/s full pocket vs none"
    )
    slide.add_argument("--model", default="builtin:tiny-glm", help="an attention-only torch checkpoint")
    slide.add_argument("--facts", type=int, default=16, help="facts to learn at most (the pocket's capacity)")
    slide.add_argument("--context", type=int, default=512, help="the engine's window")
    slide.add_argument("--threads", type=int, default=0, help="intra-op threads (default: every core)")
    slide.add_argument("--prompt-tokens", type=int, default=32)
    slide.add_argument("--decode-tokens", type=int, default=64)
    slide.add_argument("--concurrency", type=int, default=8)
    slide.set_defaults(func=_runner("slide_bench"))

    sampler = kinds.add_parser("sampler", help="the keyed sampler alone: the vectorised draw vs the row-by-row one")
    sampler.add_argument("--rows", type=int, default=16)
    sampler.add_argument("--vocab", type=int, default=151936)
    sampler.add_argument("--repeats", type=int, default=5, help="timed runs of each side per case")
    sampler.add_argument("--top-logprobs", type=int, default=5, help="best tokens per row in the logprob cases")
    sampler.add_argument("--threads", type=int, default=0, help="intra-op threads (default: every core)")
    sampler.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    sampler.set_defaults(func=_runner("sampler_bench"))

    serve = kinds.add_parser("serve", help="TTFT / ITL / throughput through the graph vs the engine in-process")
    serve.add_argument("--url", help="a running server's base URL (default: start the graph here)")
    serve.add_argument("--model", default="builtin:tiny-glm")
    serve.add_argument("--dtype", default="auto", help="the graph's and the in-process engine's dtype")
    _add_draft(serve, "auto", "the graph's and the in-process engine's drafts (default auto, the server's)")
    serve.add_argument(
        "--peer",
        action="append",
        metavar="URL",
        help="another OpenAI-compatible server's /v1 URL (llama.cpp's llama-server, vLLM...), sent the same "
        "rounds after the graph here and shown beside it; repeatable",
    )
    serve.add_argument("--concurrency", type=int, default=16)
    serve.add_argument("--max-tokens", type=int, default=64)
    serve.add_argument("--prompt-tokens", type=int, default=64)
    serve.add_argument("--port", type=int, default=8311)
    serve.add_argument("--temperature", type=float, default=0.0, help="sample every stream (default 0: greedy)")
    serve.add_argument("--top-p", type=float, default=1.0, help="with --temperature: the nucleus kept")
    serve.add_argument("--top-k", type=int, default=0, help="with --temperature: the likeliest tokens kept")
    serve.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="bursts of --concurrency streams, each with new prompts; figures pool every round",
    )
    serve.add_argument(
        "--stream-interval-ms",
        type=float,
        default=None,
        help="the graph's stream_interval_ms (default: the server default)",
    )
    serve.add_argument(
        "--stream-events-per-second",
        type=float,
        default=None,
        help="the graph's stream_events_per_second (default: the server default; 0 = no cap)",
    )
    serve.add_argument(
        "--http-entry",
        choices=["ingress", "proxy", "both"],
        default="both",
        help="who answers HTTP in the graph started here: the Ingress replica (as `tensorfold "
        "serve`), Serve's proxy (as `serve run`), or both, one after the other",
    )
    serve.add_argument(
        "--multi-turn",
        action="store_true",
        help="conversations over --data-parallel-size replicas: prefix-affinity routing vs "
        "Serve's default, cached-token share and TTFT side by side",
    )
    serve.add_argument("--conversations", type=int, default=8, help="--multi-turn: conversations at once")
    serve.add_argument("--turns", type=int, default=4, help="--multi-turn: turns per conversation")
    serve.add_argument("--data-parallel-size", type=int, default=2, help="--multi-turn: Scheduler replicas")
    serve.set_defaults(func=_runner("serve_bench"))
