"""Thinking toggle, reasoning effort and --chat-template files (pure logic, no model)."""

from pathlib import Path

import pytest

from deployments.chat_format.effort import check_effort, nearest_level, template_kwargs, template_levels
from deployments.chat_format.template_file import MAX_TEMPLATE_BYTES, load_template_file

GLM53 = ("low", "high", "max")  # the levels GLM-5.3's template names
QWEN38 = ("low", "medium", "xhigh")  # the levels Qwen3.8's template names


@pytest.mark.parametrize(
    ("effort", "named", "heard"),
    [
        ("max", GLM53, "max"),
        ("medium", GLM53, "high"),
        ("minimal", GLM53, "low"),
        ("xhigh", GLM53, "max"),
        ("high", QWEN38, "xhigh"),
        ("max", QWEN38, "xhigh"),
        ("xhigh", QWEN38, "xhigh"),
        ("minimal", QWEN38, "low"),
        ("max", (), "xhigh"),
        ("low", (), "low"),
    ],
)
def test_mapping_examples(effort: str, named: tuple[str, ...], heard: str) -> None:
    assert nearest_level(effort, named) == heard


def test_levels_a_template_names() -> None:
    source = "{% if reasoning_effort == 'low' %}L{% elif reasoning_effort == \"xhigh\" %}X{% endif %} medium"
    assert template_levels(source) == ("low", "xhigh")
    assert template_levels("{{ 'low' }}") == ()  # no reasoning_effort variable: no levels


def test_effort_sources_and_precedence() -> None:
    # Top-level wins over chat_template_kwargs; the server default fills in; omitted stays omitted.
    assert template_kwargs({"reasoning_effort": "low"}, "high", None, QWEN38) == {
        "enable_thinking": True,
        "reasoning_effort": "xhigh",
    }
    assert template_kwargs({"reasoning_effort": "low"}, None, "high", QWEN38)["reasoning_effort"] == "low"
    assert template_kwargs({}, None, "medium", GLM53)["reasoning_effort"] == "high"
    assert template_kwargs({}, None, None, GLM53) == {}
    # none turns thinking off and says no level; an explicit enable_thinking wins over the effort.
    assert template_kwargs({}, "none", None, GLM53) == {"enable_thinking": False}
    assert template_kwargs({"enable_thinking": False}, "high", None, GLM53) == {"enable_thinking": False}
    assert template_kwargs({"enable_thinking": True}, "none", None, GLM53) == {"enable_thinking": True}
    # `thinking` (DeepSeek-V4 clients) is read when enable_thinking is absent; other values are ignored.
    assert template_kwargs({"thinking": {"type": "disabled"}}, None, None, ())["enable_thinking"] is False
    assert template_kwargs({"thinking": True}, None, None, ())["enable_thinking"] is True
    assert "enable_thinking" not in template_kwargs({"thinking": "maybe"}, None, None, ())


def test_effort_values_are_checked() -> None:
    assert check_effort(" High ", "reasoning_effort") == "high" and check_effort(None, "x") is None
    with pytest.raises(ValueError, match="reasoning_effort must be one of"):
        check_effort("ultra", "reasoning_effort")


def test_template_file_rules(tmp_path: Path) -> None:
    good = tmp_path / "t.jinja"
    good.write_text("{% for m in messages %}{{ m.content }}ü{% endfor %}", encoding="utf-8")
    assert load_template_file(good).endswith("{% endfor %}")
    empty = tmp_path / "empty.jinja"
    empty.write_text("", encoding="utf-8")
    assert load_template_file(empty) == ""
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}", encoding="utf-8")
    latin = tmp_path / "latin.jinja"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    big = tmp_path / "big.jinja"
    big.write_bytes(b" " * (MAX_TEMPLATE_BYTES + 1))
    for path, why in (
        (broken, "does not compile"),
        (latin, "not UTF-8"),
        (big, "16 MiB"),
        (tmp_path / "missing.jinja", "cannot read"),
    ):
        with pytest.raises(ValueError, match=why):
            load_template_file(path)


def test_cli_flags_reach_the_args() -> None:
    import argparse

    from serve_app.cli_serve import app_args_from, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    namespace = parser.parse_args(
        [
            "serve",
            "builtin:tiny-glm",
            "--chat-template",
            "t.jinja",
            "--reasoning-effort",
            "low",
            "--thinking-budget",
            "64",
            "--loop-guard",
        ]
    )
    args = app_args_from(namespace)
    assert (args.chat_template, args.reasoning_effort, args.thinking_budget, args.loop_guard) == (
        "t.jinja",
        "low",
        64,
        True,
    )
    assert app_args_from(parser.parse_args(["serve", "builtin:tiny-glm"])).loop_guard is False
