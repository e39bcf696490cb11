"""The disk prompt-state store for hybrid models: a conversation's state snapshots are written beside its KV
rows, and a fresh engine over the same folder resumes its next turn from them, token for token the reply
a fresh prompt pass gives; a damaged snapshot is never restored; the imprint answer reports the disk's part.
One model per mixer (Gated DeltaNet, Mamba2), in float32 and bfloat16."""

from dataclasses import replace
from pathlib import Path

import pytest

from deployments.config import EngineConfig
from deployments.messages.requests import EngineRequest, GrammarSpec, ImprintQuery, SamplingParams
from deployments.prompt_store.links import LocalStoreLink
from deployments.scheduler.engine.core import Engine
from tests.support.requests import greedy

CASES = [(arch, dtype) for arch in ("qwen3_5_text", "nemotron_h") for dtype in ("float32", "bfloat16")]
PROMPT = [(13 * j) % 400 + 20 for j in range(150)]


@pytest.fixture(scope="module", params=CASES, ids=lambda case: "-".join(case))
def checkpoint(request, tmp_path_factory) -> tuple[str, str]:
    from serve_app.fixtures.checkpoints import build_random_checkpoint
    from serve_app.fixtures.tokenizer_builder import build_tokenizer

    arch, dtype = request.param
    out = tmp_path_factory.mktemp(f"{arch}-{dtype}")
    build_random_checkpoint(arch, out, seed=5, dtype=dtype)
    build_tokenizer(out, family="qwen")
    return str(out), dtype


def _config(checkpoint: tuple[str, str], learn_dir: Path | None, **overrides: object) -> EngineConfig:
    path, dtype = checkpoint
    settings = dict(model=path, dtype=dtype, kv_cache_gib=0.02, parallel=4, prefill_chunk_size=64, draft="off")
    if learn_dir is not None:
        settings.update(learn_dir=str(learn_dir), learn_conversations=True)
    settings.update(overrides)
    return EngineConfig(**settings)


def _engine(checkpoint: tuple[str, str], learn_dir: Path | None, **overrides: object) -> Engine:
    config = _config(checkpoint, learn_dir, **overrides)
    return Engine(config, None if learn_dir is None else LocalStoreLink(config))


def _reply(engine: Engine, prompt: list[int], request_id: str) -> tuple[list[int], object]:
    reply = engine.generate([greedy(request_id, prompt, 12)])[request_id]
    assert reply.finish_reason is not None and reply.stats is not None
    return reply.token_ids, reply.stats


def _first_turn(checkpoint: tuple[str, str], learn_dir: Path, **overrides: object) -> list[int]:
    """Run the first turn, write its states to disk, and return the next turn's prompt."""
    engine = _engine(checkpoint, learn_dir, **overrides)
    reply, _ = _reply(engine, PROMPT, "first")
    engine.disk.write_waiting()
    held = engine.disk.latest
    assert held.states_written >= 1 and held.pieces_written >= 1
    engine.shutdown()
    return PROMPT + reply + [40, 41, 42]


def test_a_hybrid_conversation_resumes_from_disk_exactly(checkpoint, tmp_path: Path) -> None:
    next_turn = _first_turn(checkpoint, tmp_path)
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert list(folder.glob("*.state")) and list(folder.glob("*.piece"))
    restarted = _engine(checkpoint, tmp_path)  # a fresh RAM cache (no blocks, no snapshots) over the folder
    answer = restarted.imprint(ImprintQuery(next_turn))
    assert answer.resume_from == "disk" and answer.ram_tokens == 0 and answer.disk_tokens >= len(PROMPT) - 16
    blocks_bytes = answer.disk_tokens // 16 * restarted.disk.block_bytes
    assert answer.disk_bytes == blocks_bytes + restarted.runner_info.state_bytes_per_slot  # KV rows and a snapshot
    resumed, stats = _reply(restarted, next_turn, "resumed")
    assert stats.disk_tokens == answer.disk_tokens and stats.cached_tokens == stats.disk_tokens
    restarted.disk.refresh_stats()
    assert restarted.disk.latest.states_read == 1 and restarted.disk.latest.damaged_pieces == 0
    fresh, fresh_stats = _reply(_engine(checkpoint, None), next_turn, "fresh")
    assert resumed == fresh and fresh_stats.cached_tokens == 0  # the same reply as a fresh prompt pass


def test_a_damaged_snapshot_is_never_restored(checkpoint, tmp_path: Path) -> None:
    next_turn = _first_turn(checkpoint, tmp_path)
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    states = list(folder.glob("*.state"))
    for path in states:  # every snapshot: no block boundary is left to resume at
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
    restarted = _engine(checkpoint, tmp_path)
    assert restarted.imprint(ImprintQuery(next_turn)).resume_from == "disk"  # headers only: not read yet
    resumed, stats = _reply(restarted, next_turn, "resumed")
    assert stats.disk_tokens == 0 and stats.cached_tokens == 0
    restarted.disk.refresh_stats()
    assert restarted.disk.latest.damaged_pieces == 1 and len(list(folder.glob("*.state"))) == len(states) - 1
    answer = restarted.imprint(ImprintQuery(next_turn))
    assert answer.resume_from != "disk"
    fresh, _ = _reply(_engine(checkpoint, None), next_turn, "fresh")
    assert resumed == fresh


def test_a_drafted_and_sampled_turn_resumed_from_disk_equals_a_fresh_serial_one(checkpoint, tmp_path: Path) -> None:
    """Drafts (Nemotron-H's MTP layer, else n-gram lookup over a reply a grammar makes repeat) over the
    restored state (an MTP layer's KV rows restored too), and a sampled draw (a rejected draft resumes from
    the last kept row's states)."""
    drafts = dict(draft="auto", draft_policy="fixed", draft_tokens=3)
    next_turn = _first_turn(checkpoint, tmp_path, **drafts)  # the same KV layout (an MTP layer's rows included)
    restarted = _engine(checkpoint, tmp_path, **drafts)
    repeats = None if restarted.draft_method == "mtp" else GrammarSpec("regex", "[ab]{24}")  # MTP drafts freely
    sampling = SamplingParams(temperature=1.0, seed=21, ignore_eos=True)
    request = EngineRequest("resumed", next_turn, sampling, max_tokens=30, grammar=repeats)
    resumed = restarted.generate([request])["resumed"]
    assert resumed.stats.disk_tokens >= len(PROMPT) - 16 and resumed.stats.drafted > 0
    fresh_engine = _engine(checkpoint, None, prompt_cache_gib=0)
    fresh = fresh_engine.generate([replace(request, request_id="fresh", draft=False)])["fresh"]
    assert resumed.token_ids == fresh.token_ids and len(fresh.token_ids) >= 24


def test_learn_alone_keeps_shared_prefixes_with_their_snapshots(checkpoint, tmp_path: Path) -> None:
    shared = [(7 * i) % 400 + 30 for i in range(160)]
    config = _config(checkpoint, tmp_path).model_copy(update={"learn_conversations": False, "learn": True})
    engine = Engine(config, LocalStoreLink(config))
    _reply(engine, shared + [1, 2, 3], "a")
    _, stats = _reply(engine, shared + [4, 5, 6], "b")  # resumes at the first prompt's snapshot: shared
    engine.disk.write_waiting()
    assert stats.cached_tokens == len(shared) and engine.disk.latest.states_written == 1
    engine.shutdown()
    restarted = Engine(config, LocalStoreLink(config))
    resumed, resumed_stats = _reply(restarted, shared + [7, 8, 9], "c")
    assert resumed_stats.disk_tokens == resumed_stats.cached_tokens == len(shared)
    fresh, _ = _reply(_engine(checkpoint, None), shared + [7, 8, 9], "fresh")
    assert resumed == fresh
