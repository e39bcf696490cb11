"""Images in the engine (Qwen3.5 on a tiny random multimodal checkpoint, float32): greedy replies equal
transformers' multimodal model fed the same patches, whatever mRoPE sections config.json holds or lacks;
replies are the same solo, batched with text, chunked through an image, cached, preempted and drafted;
block names carry each image's SHA-256, so a repeated image is a cache hit and another image behind the
same placeholder ids never is."""

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from deployments.config import EngineConfig
from deployments.messages.images import ImageInput
from deployments.messages.prefix import PromptHashes
from deployments.messages.requests import EngineRequest, GrammarSpec, ImprintQuery
from deployments.scheduler.engine.core import Engine
from deployments.scheduler.engine.kv_blocks import BlockManager, BlockTable
from tests.support.config_edits import with_config
from tests.support.images import ImagePrompts, hf_image_greedy, picture, vision_checkpoint
from tests.support.requests import greedy, sampled

REPLY = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return vision_checkpoint(tmp_path_factory.mktemp("qwen3_5-vision"))


@pytest.fixture(scope="module")
def prompts(checkpoint) -> ImagePrompts:
    return ImagePrompts(checkpoint)


def _engine(checkpoint: Path, **overrides) -> Engine:
    settings = dict(
        model=str(checkpoint),
        dtype="float32",
        kv_cache_gib=0.02,
        parallel=8,
        prefill_chunk_size=64,
        draft="off",
        vision=True,
    )
    settings.update(overrides)
    return Engine(EngineConfig(**settings))


def _ask(request_id: str, prompt: tuple[list[int], list[ImageInput]], tokens: int = REPLY, **fields) -> EngineRequest:
    ids, images = prompt
    return greedy(request_id, ids, tokens, to_limit=True, images=images, **fields)


@pytest.fixture(scope="module")
def one_image(prompts):
    return prompts.build([[30, 31, 32], picture(1, 40, 52), [40, 41, 42, 43]])


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    return _engine(checkpoint)


def test_one_and_two_images_reply_as_transformers(checkpoint, prompts, engine, one_image) -> None:
    two = prompts.build([[30, 31], picture(2, 16, 40), [40, 41, 42], picture(3, 48, 24), [50, 51]])
    for tag, prompt in (("one", one_image), ("two", two)):
        reply = engine.generate([_ask(tag, prompt)])[tag]
        assert reply.token_ids == hf_image_greedy(checkpoint, *prompt, REPLY), tag


def test_an_image_in_a_later_turn_and_the_first_turn_cached(checkpoint, prompts) -> None:
    engine = _engine(checkpoint)
    first_parts = [[30, 31, 32], picture(4, 40, 52), [40, 41, 42, 43]]
    first = engine.generate([_ask("t1", prompts.build(first_parts))])["t1"]
    second_prompt = prompts.build([*first_parts, first.token_ids, [60, 61], picture(5, 24, 24), [62]])
    second = engine.generate([_ask("t2", second_prompt)])["t2"]
    assert second.stats.cached_tokens > 0
    assert second.token_ids == hf_image_greedy(checkpoint, *second_prompt, REPLY)


def test_solo_equals_batched_with_text_and_chunked_through_the_image(checkpoint, one_image) -> None:
    solo_engine = _engine(checkpoint, prompt_cache_gib=0)
    solo = solo_engine.generate([_ask("img", one_image)])["img"].token_ids
    text = sampled("text", [(7 * j) % 300 + 20 for j in range(45)], seed=3, max_tokens=REPLY, to_limit=True)
    batched = _engine(checkpoint, prompt_cache_gib=0).generate([_ask("img", one_image), text])
    assert batched["img"].token_ids == solo
    assert batched["text"].token_ids == solo_engine.generate([replace(text, request_id="alone")])["alone"].token_ids
    for chunk in (5, 7):  # chunks start and end inside the image's 30 rows
        chunked = _engine(checkpoint, prefill_chunk_size=chunk, prompt_cache_gib=0).generate([_ask("img", one_image)])
        assert chunked["img"].token_ids == solo and max(chunked["img"].stats.prefill_widths) <= chunk


# transformers' Qwen3.5 rotary reads mrope_section with [11, 11, 10] as its default, interleaves the pairs
# whatever mrope_interleaved says, and takes sections of any sum (pairs past them turn with time).
MROPE_VARIANTS = {
    "no sections": lambda rope: [rope.pop(key, None) for key in ("mrope_section", "mrope_interleaved")],
    "sections short of the pairs": lambda rope: rope.update(mrope_section=[1, 1, 1]),
    "not interleaved": lambda rope: rope.update(mrope_section=[0, 4, 0], mrope_interleaved=False),
}


@pytest.mark.parametrize("variant", MROPE_VARIANTS)
def test_image_replies_read_the_mrope_sections_as_transformers(variant, checkpoint, one_image, tmp_path) -> None:
    edit = MROPE_VARIANTS[variant]
    path = with_config(checkpoint, tmp_path / "edited", lambda config: edit(config["text_config"]["rope_parameters"]))
    reply = _engine(path).generate([_ask("image", one_image)])["image"]
    assert reply.refusal is None and reply.token_ids == hf_image_greedy(path, *one_image, REPLY)


def test_a_repeated_image_hits_the_cache_and_a_swapped_one_never_does(checkpoint, prompts, one_image) -> None:
    engine = _engine(checkpoint)
    ids, images = one_image
    engine.generate([_ask("first", one_image)])
    longer = (ids + [70, 71, 72], images)
    again = engine.generate([_ask("again", longer)])["again"]
    # The prompt's last boundary (32) is inside the image (tokens 4..33): the rest starts mid-image.
    assert again.stats.cached_tokens == len(ids) // 16 * 16 == 32
    assert again.token_ids == hf_image_greedy(checkpoint, *longer, REPLY)
    swapped = prompts.build([[30, 31, 32], picture(9, 40, 52), [40, 41, 42, 43]])
    assert swapped[0] == ids and swapped[1][0].sha256 != images[0].sha256
    other = engine.generate([_ask("swapped", swapped)])["swapped"]
    assert other.stats.cached_tokens == 0  # every block touches the image
    assert other.token_ids == hf_image_greedy(checkpoint, *swapped, REPLY)


def test_preempted_image_requests_equal_uninterrupted(checkpoint, prompts) -> None:
    requests = [
        _ask(f"p{i}", prompts.build([[30 + i, 31], picture(20 + i, 32, 40), [40, 41 + i]]), 30) for i in range(5)
    ]
    roomy_engine = _engine(checkpoint)
    roomy = roomy_engine.generate(requests)
    block_bytes = roomy_engine.runner_info.kv_bytes_per_token * 16
    state_bytes = roomy_engine.runner_info.state_bytes_per_slot * 2 * 5
    # Nine blocks for five replies growing to ~55 tokens each: later ones are preempted and recomputed.
    tight_engine = _engine(
        checkpoint, kv_cache_gib=(9.5 * block_bytes + state_bytes) / 2**30, parallel=5, prompt_cache_gib=0
    )
    tight = tight_engine.generate(requests)
    assert tight_engine.counters.preemptions_total > 0
    assert [tight[r.request_id].token_ids for r in requests] == [roomy[r.request_id].token_ids for r in requests]


def test_drafted_replies_after_an_image_equal_serial_ones(checkpoint, prompts) -> None:
    """A grammar makes the reply repeat, so n-gram drafts are proposed and kept: their rows sit past the image."""
    engine = _engine(checkpoint, draft="ngram", draft_policy="fixed", draft_tokens=3)
    prompt = prompts.build([[30, 31], picture(6, 40, 40), [40, 41]])
    request = _ask("drafted", prompt, 24, grammar=GrammarSpec("regex", "(ab){12}"))
    drafted = engine.generate([request])["drafted"]
    serial = engine.generate([replace(request, request_id="serial", draft=False)])["serial"]
    assert drafted.token_ids == serial.token_ids
    assert drafted.stats.drafted > 0 and drafted.stats.accepted == drafted.stats.drafted


def test_images_are_refused_without_vision_and_placeholders_without_images(checkpoint, one_image) -> None:
    ids, images = one_image
    off = _engine(checkpoint, vision=False).generate([_ask("off", one_image)])["off"]
    assert off.refusal is not None and off.refusal.param == "messages" and "--vision" in off.refusal.message
    engine = _engine(checkpoint)
    bare = engine.generate([_ask("bare", (ids, []))])["bare"]
    assert bare.refusal is not None and "placeholders without an image" in bare.refusal.message
    short = replace(images[0], length=images[0].length - 1)
    wrong = engine.generate([_ask("wrong", (ids, [short]))])["wrong"]
    assert wrong.refusal is not None and wrong.refusal.message.startswith("image 0:")


def test_block_names_fold_in_images_as_the_router_names_them(one_image) -> None:
    ids, images = one_image  # 39 tokens, the image at 4..33: blocks 0 and 1 touch it, block 2 would not
    prompt = ids + [80] * 20
    router = PromptHashes.of(prompt, 16, images)
    blocks = BlockManager(8, 16)
    table = BlockTable()
    blocks.grow(table, len(prompt))
    blocks.register_full_blocks(table, prompt, len(prompt), images)
    assert [name for name, _, _ in blocks.resident_chain(table)] == router.hashes
    text_only = PromptHashes.of(prompt, 16)
    assert all(a != b for a, b in zip(router.hashes, text_only.hashes))  # the chain carries the image on
    other = replace(images[0], sha256=bytes(32))
    assert PromptHashes.of(prompt, 16, [other]).hashes[0] != router.hashes[0]
    pair = [replace(images[0], offset=2, length=4), replace(images[0], offset=8, length=4, sha256=bytes(32))]
    swapped_order = [replace(pair[0], sha256=pair[1].sha256), replace(pair[1], sha256=pair[0].sha256)]
    assert PromptHashes.of(prompt, 16, pair).hashes[0] != PromptHashes.of(prompt, 16, swapped_order).hashes[0]
    assert blocks.match_prefix(prompt, len(prompt), None, images) == table.block_ids[:3]
    assert blocks.match_prefix(prompt, len(prompt), None, [other]) == []


def test_a_conversation_with_an_image_resumes_from_disk_only_with_the_same_image(checkpoint, prompts, tmp_path) -> None:
    from deployments.prompt_store.links import LocalStoreLink

    def on_disk() -> Engine:
        config = EngineConfig(
            model=str(checkpoint), dtype="float32", kv_cache_gib=0.02, parallel=4, draft="off", vision=True,
            learn_dir=str(tmp_path), learn_conversations=True,
        )  # fmt: skip
        return Engine(config, LocalStoreLink(config))

    text = [(13 * j) % 400 + 20 for j in range(30)]
    first_parts = [[30, 31], picture(7, 40, 52), text]
    writer = on_disk()
    first = writer.generate([_ask("first", prompts.build(first_parts))])["first"]
    writer.disk.write_waiting()
    writer.shutdown()
    same = prompts.build([*first_parts, first.token_ids, [60, 61]])
    restarted = on_disk()  # a fresh RAM cache over the folder
    assert restarted.imprint(ImprintQuery(same[0], images=same[1])).disk_tokens >= 48
    assert restarted.imprint(ImprintQuery(same[0])).disk_tokens == 0  # the same ids without their image
    resumed = restarted.generate([_ask("same", same)])["same"]
    assert resumed.stats.disk_tokens >= 48 and resumed.stats.cached_tokens == resumed.stats.disk_tokens
    assert resumed.token_ids == hf_image_greedy(checkpoint, *same, REPLY)
    swapped = prompts.build([[30, 31], picture(8, 40, 52), text, first.token_ids, [60, 61]])
    assert swapped[0] == same[0]
    other = on_disk().generate([_ask("swapped", swapped)])["swapped"]
    assert other.stats.disk_tokens == 0 and other.stats.cached_tokens == 0


def test_moe_replies_with_an_image_as_transformers(tmp_path, one_image) -> None:
    checkpoint = vision_checkpoint(tmp_path / "moe", arch="qwen3_5_moe")
    prompt = ImagePrompts(checkpoint).build([[30, 31, 32], picture(1, 40, 52), [40, 41, 42, 43]])
    reply = _engine(checkpoint).generate([_ask("moe", prompt)])["moe"]
    assert reply.token_ids == hf_image_greedy(checkpoint, *prompt, REPLY)


@pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx is not installed")
def test_the_mlx_rank_replies_with_images_as_transformers(checkpoint, prompts) -> None:
    two = prompts.build([[30, 31], picture(2, 16, 40), [40, 41, 42], picture(3, 48, 24), [50, 51]])
    expected = hf_image_greedy(checkpoint, *two, REPLY)
    engine = _engine(checkpoint, backend="mlx", prefill_chunk_size=7)  # chunks through both images
    assert engine.runner_info.backend == "mlx"
    assert engine.generate([_ask("mlx", two)])["mlx"].token_ids == expected
    longer = (two[0] + [60], two[1])
    again = engine.generate([_ask("again", longer)])["again"]
    assert again.stats.cached_tokens > 0 and again.token_ids == hf_image_greedy(checkpoint, *longer, REPLY)
