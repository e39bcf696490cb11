"""Grammar-constrained replies in the engine on a random checkpoint: only the grammar makes them valid.

Constrained replies must parse and validate, equal their solo run when batched with 8 others, compile
each grammar once, refuse an uncompilable grammar before any token, and gate the grammar behind a think
block. A model vocabulary wider than its tokenizer (the bench's shape) keeps every row inside its
grammar; an end id that is ordinary text (`"`) is a dead end the engine names.
"""

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from deployments.config import EngineConfig
from deployments.messages.replies import FinishReason, Refusal
from deployments.messages.requests import EngineRequest, GrammarSpec, SamplingParams
from deployments.messages.step import SeqDraw
from deployments.model_rank.sampler import sample_rows, unpack_bitmask
from deployments.scheduler.engine.core import Engine
from deployments.scheduler.engine.grammar import GrammarBackend, GrammarFailure, text_end_ids
from deployments.tokenizer import load_tokenizer
from serve_app.bench.engine_bench import bench_checkpoint
from serve_app.bench.grammar_bench import SCHEMA as BENCH_SCHEMA
from tests.conftest import end_token_checkpoint

SCHEMA = {  # small on purpose: a random model fills every gap with up to 32 blanks
    "type": "object",
    "properties": {"c": {"enum": ["red", "blue"]}, "n": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["c", "n"],
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    model = end_token_checkpoint(tmp_path_factory.mktemp("grammar-glm"))
    return Engine(EngineConfig(model=str(model), kv_cache_gib=0.02, parallel=16, device="cpu"))


def _request(rid: str, spec: GrammarSpec | None, seed: int, max_tokens: int = 70) -> EngineRequest:
    prompt = [20 + (seed * 7 + j) % 300 for j in range(6 + seed % 5)]
    sampling = SamplingParams(temperature=0.0 if seed % 3 == 0 else 0.9, seed=seed)
    return EngineRequest(rid, prompt, sampling=sampling, max_tokens=max_tokens, grammar=spec)


def test_json_schema_replies_validate_and_batched_equals_solo(engine: Engine) -> None:
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    constrained = [_request(f"j{i}", spec, seed=i, max_tokens=45) for i in (0, 1)]  # one greedy, one sampled
    others = [_request(f"o{i}", None, seed=10 + i, max_tokens=3) for i in range(7)]
    batched = engine.generate(constrained + others)
    for rid in ("j0", "j1"):
        assert batched[rid].finish_reason == FinishReason.STOP, batched[rid].text
        jsonschema.validate(json.loads(batched[rid].text), SCHEMA)
    solo = engine.generate([_request("solo", spec, seed=1, max_tokens=45)])["solo"]
    assert solo.token_ids == batched["j1"].token_ids


PROOF_SCHEMAS: list[dict] = [  # nested objects, arrays with item bounds, enums, bounded numbers; each ends fast
    {
        "type": "object",
        "properties": {
            "at": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -5, "maximum": 5},
                    "y": {"type": "integer", "minimum": 0, "maximum": 20},
                },
                "required": ["x", "y"],
            }
        },
        "required": ["at"],
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "mode": {"enum": ["fast", "slow"]},
            "on": {"type": "boolean"},
            "level": {"type": "integer", "minimum": 1, "maximum": 3},
        },
        "required": ["mode", "on", "level"],
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"enum": ["u", "v"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["k", "n"],
        },
        "minItems": 1,
        "maxItems": 2,
    },
    {
        "type": "object",
        "properties": {
            "p": {"type": "number", "minimum": 0, "maximum": 1},
            "q": {
                "type": "array",
                "items": {"type": "integer", "minimum": 1, "maximum": 4},
                "minItems": 2,
                "maxItems": 2,
            },
        },
        "required": ["p", "q"],
    },
]


def test_fifty_batched_schema_replies_all_validate(engine: Engine) -> None:
    """5 schemas x 10 seeds (greedy every third seed, sampled otherwise), all in the engine together."""
    requests = [
        _request(f"s{k}-{seed}", GrammarSpec("json_schema", json.dumps(schema)), seed=seed, max_tokens=400)
        for k, schema in enumerate(PROOF_SCHEMAS)
        for seed in range(10)
    ]
    replies = engine.generate(requests)
    assert len(replies) == 50
    for k, schema in enumerate(PROOF_SCHEMAS):
        for seed in range(10):
            reply = replies[f"s{k}-{seed}"]
            assert reply.finish_reason == FinishReason.STOP, (k, seed, reply.text)
            jsonschema.validate(json.loads(reply.text), schema)


def test_regex_choice_and_ebnf_replies_match(engine: Engine) -> None:
    specs = {
        "regex": (GrammarSpec("regex", r"[a-d]{2}-\d{3}"), r"[a-d]{2}-\d{3}"),
        "choice": (GrammarSpec("regex", r"(yes|no|maybe)"), r"(yes|no|maybe)"),
        "ebnf": (GrammarSpec("ebnf", 'root ::= "(" [0-9] ("+" [0-9])? ")"'), r"\(\d(\+\d)?\)"),
    }
    requests = [_request(name, spec, seed=4 + i, max_tokens=12) for i, (name, (spec, _)) in enumerate(specs.items())]
    replies = engine.generate(requests)
    for name, (_, pattern) in specs.items():
        assert replies[name].finish_reason == FinishReason.STOP
        assert re.fullmatch(pattern, replies[name].text), (name, replies[name].text)


def test_a_reply_cut_at_its_limit_is_length(engine: Engine) -> None:
    reply = engine.generate([_request("cut", GrammarSpec("json_schema", json.dumps(SCHEMA)), seed=2, max_tokens=3)])
    assert reply["cut"].finish_reason == FinishReason.LENGTH


def test_grammars_compile_once_and_bad_ones_are_refused(engine: Engine) -> None:
    spec = GrammarSpec("regex", r"x+y")
    before = engine.grammars.compiles
    assert engine.check(_request("a", spec, 1)) is None
    assert engine.check(_request("b", GrammarSpec("regex", r"x+y"), 2)) is None
    assert engine.grammars.compiles == before + 1
    refused = engine.check(_request("c", GrammarSpec("ebnf", "root ::= (", param="guided_grammar"), 1))
    assert refused is not None and refused.param == "guided_grammar" and refused.status == 400
    assert refused.message.startswith("guided_grammar: the grammar does not compile: ")
    unknown = engine.check(_request("d", GrammarSpec("yaml", "a: 1"), 1))
    assert unknown == Refusal("unknown grammar kind 'yaml'", "response_format")


def test_the_grammar_starts_after_the_think_block(engine: Engine) -> None:
    backend: GrammarBackend = engine.grammars
    opener, closer = 300, 301
    spec = GrammarSpec("regex", "ab", think_opener_id=opener, think_closer_id=closer)
    grammar = backend.reply_grammar(spec)
    first = unpack_bitmask(grammar.allowed(), backend.vocab_size)
    assert bool(first[opener]) and not bool(first[closer])
    grammar.accept(opener)
    thinking = unpack_bitmask(grammar.allowed(), backend.vocab_size)  # free inside the block, save end tokens
    assert bool(thinking[closer]) and not any(bool(thinking[s]) for s in backend.stop_ids)
    grammar.accept(42)
    grammar.accept(closer)
    allowed = unpack_bitmask(grammar.allowed(), backend.vocab_size)
    assert not bool(allowed[opener]) and int(allowed.sum()) < backend.vocab_size
    inside = backend.reply_grammar(GrammarSpec("regex", "ab", think_closer_id=closer, starts_in_think=True))
    assert bool(unpack_bitmask(inside.allowed(), backend.vocab_size)[42])


def test_a_row_mask_leaves_only_allowed_tokens() -> None:
    words = torch.zeros(2, dtype=torch.int32)
    words[0] = 1 << 5
    words[1] = torch.tensor(1 << 31, dtype=torch.int64).to(torch.int32)
    mask = unpack_bitmask(words, 70)
    assert mask.nonzero().flatten().tolist() == [5, 63]


def test_a_refused_token_ends_only_that_request(engine: Engine) -> None:
    from deployments.scheduler.engine.reply_writer import follow_written
    from deployments.scheduler.engine.sequence import Sequence
    from deployments.scheduler.engine.text_output import IncrementalText

    def sequence(spec: GrammarSpec | None) -> Sequence:
        request = _request("s", spec, 1)
        seq = Sequence(request, 1, 10, IncrementalText(engine.tokenizer.decode, []), 0, list(request.prompt_token_ids))
        seq.grammar = None if spec is None else engine.grammars.reply_grammar(spec)
        return seq

    letter_a = engine.tokenizer.encode("a")[0]
    constrained, free = sequence(GrammarSpec("regex", "a+")), sequence(None)
    for seq in (constrained, free):
        seq.token_ids.append(letter_a + 1)  # "b": outside the grammar
    assert "refused" in (follow_written(constrained, 0) or "")
    assert follow_written(free, 0) is None
    dead_end = torch.zeros(engine.grammars.vocab_size // 32 + 1, dtype=torch.int32)
    logits = torch.randn(2, engine.grammars.vocab_size)
    draws = [_draw(dead_end), _draw(None)]
    assert [r.token for r in sample_rows(logits, draws)] == logits.argmax(dim=-1).tolist()


def _draw(allowed: torch.Tensor | None) -> SeqDraw:
    return SeqDraw(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=1, reply_position=0, allowed=allowed)


@pytest.fixture(scope="module")
def wide_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bench's checkpoint at tiny size: a 32k model vocabulary over a ~512-id tokenizer."""
    return bench_checkpoint(tmp_path_factory.mktemp("wide-vocab"), size="tiny")


def test_rows_of_a_wide_vocabulary_stay_in_their_grammar(wide_vocab_dir: Path) -> None:
    """Greedy ignore_eos rows of the bench's schema decode to their limit; none is driven to a dead end."""
    engine = Engine(EngineConfig(model=str(wide_vocab_dir), kv_cache_gib=0.05, parallel=8, device="cpu"))
    assert engine.runner_info.vocab_size > 16 * engine.tokenizer.vocab_size
    spec = GrammarSpec("json_schema", json.dumps(BENCH_SCHEMA))
    prompts = torch.randint(0, engine.runner_info.vocab_size, (8, 16), generator=torch.Generator().manual_seed(0))
    sampling = SamplingParams(temperature=0.0, ignore_eos=True)
    requests = [
        EngineRequest(f"w{i}", p.tolist(), sampling=sampling, max_tokens=64, grammar=spec)
        for i, p in enumerate(prompts)
    ]
    replies = engine.generate(requests)
    assert {rid: r.finish_reason for rid, r in replies.items()} == {r.request_id: FinishReason.LENGTH for r in requests}
    assert text_end_ids(engine.tokenizer, sorted(engine.eos_ids)) == []  # `"` is no end token
    engine.shutdown()


def test_an_end_id_that_is_text_is_a_named_dead_end(wide_vocab_dir: Path) -> None:
    """With `"` an end id, `{` plus the most blanks leaves JSON no token: the refusal says why."""
    tokenizer = load_tokenizer(wide_vocab_dir)
    quote, end, blank = tokenizer.encode('"')[0], tokenizer.token_to_id("<|im_end|>"), tokenizer.encode(" ")[0]
    assert text_end_ids(tokenizer, [quote, end]) == [quote]
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    for stops, quote_allowed in (([end], True), ([quote, end], False)):
        grammar = GrammarBackend(tokenizer, 32768, stops).reply_grammar(spec)
        for token in [tokenizer.encode("{")[0]] + [blank] * 32:
            grammar.accept(token)
        allowed = unpack_bitmask(grammar.allowed(), 32768)
        assert bool(allowed[quote]) is quote_allowed and grammar.dead_end is not quote_allowed
    with pytest.raises(GrammarFailure, match="allows no token"):
        grammar.accept(20000)
