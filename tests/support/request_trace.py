"""The repository files whose code runs during one streamed chat completion, in-process over the real routes,
renderer and engine (docs/structure.md, "One chat completion"): `python -m tests.support.request_trace`.

Every thread's calls are watched (the engine steps on a thread of its own); only those made between the
request's first byte and its `[DONE]` are counted, after one warm-up request, so loading and first-call
imports are not.
"""

import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CODE = tuple(str(REPO / top) + "/" for top in ("deployments", "serve_app", "kernels"))
BODY = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "temperature": 0,
    "max_tokens": 8,
    "stream": True,
}


class Tracer:
    def __init__(self) -> None:
        self.on = False
        self.files: set[str] = set()

    def __call__(self, frame, event, arg):  # noqa: ANN001, ANN204 (the profiler's signature)
        if self.on and event == "call":
            name = frame.f_code.co_filename
            if name.startswith(CODE):
                self.files.add(name)


def traced_files(served_model: str) -> list[str]:
    """The files, relative to the repository, in sorted order."""
    from tests.support.local_app import local_client

    tracer = Tracer()
    threading.setprofile(tracer)
    sys.setprofile(tracer)
    try:
        with local_client(served_model) as client:
            client.post("/v1/chat/completions", json=BODY).read()  # warm-up: imports, first compiles
            tracer.on = True
            with client.stream("POST", "/v1/chat/completions", json=BODY) as reply:
                for _ in reply.iter_bytes():
                    pass
            tracer.on = False
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return sorted(str(Path(name).relative_to(REPO)) for name in tracer.files)


if __name__ == "__main__":
    files = traced_files(sys.argv[1] if len(sys.argv) > 1 else "builtin:tiny-glm")
    print("\n".join(files))
    print(f"{len(files)} files")
