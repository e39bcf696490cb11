"""`tensorfold bench vision`: on the tiny multimodal checkpoint it prints both sides' encode and TTFT rows
from one run and the same greedy first tokens as transformers; the bench size keeps a 1024 x 768 image
whole (64 x 48 patches, 768 placeholder tokens)."""

import json

from deployments.renderer.vision.preprocess import Preprocessing, placeholder_count, smart_resize
from tests.support.images import vision_checkpoint


def test_the_vision_bench_prints_both_sides_and_agreeing_first_tokens(tmp_path, capsys) -> None:
    from serve_app.cli import main as cli_main

    checkpoint = vision_checkpoint(tmp_path / "tiny")
    argv = ["bench", "vision", "--checkpoint", str(checkpoint), "--image-size", "64x48", "--images", "2"]
    assert cli_main([*argv, "--threads", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("checkpoint:"))
    assert "grid (1, 12, 16), 48 image tokens" in header and "CPU kernels" in header
    rows = {line[:40].strip(): line[40:].split() for line in lines if not line.startswith("checkpoint:")}
    assert rows["figure"] == ["tensorfold", "transformers", "speedup"]
    for label in ("encode ms per 64x48 image", "TTFT ms, one-image chat"):
        ours, theirs, speedup = rows[label]
        assert float(ours) > 0 and float(theirs) > 0 and speedup.endswith("x")
    ours, theirs, verdict = rows["greedy first tokens"]
    assert ours == theirs and len(ours.split(",")) == 2 and verdict == "agree"


def test_the_bench_size_keeps_a_1024_by_768_image_whole(tmp_path) -> None:
    from serve_app.fixtures.checkpoints import BENCH_SHAPES
    from serve_app.fixtures.vision import PIXEL_BOUNDS, preprocessor_config

    arch, shape = BENCH_SHAPES["qwen3_5-vl-bench"]
    assert arch == "qwen3_5" and shape["vision_config"]["out_hidden_size"] == shape["text_config"]["hidden_size"]
    config = preprocessor_config(shape["vision_config"]["patch_size"], *PIXEL_BOUNDS["qwen3_5-vl-bench"])
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    prep = Preprocessing.read(tmp_path)
    assert prep is not None and prep.patch_size == 16
    assert smart_resize(768, 1024, prep) == (768, 1024)
    assert placeholder_count((1, 48, 64), prep) == 768
