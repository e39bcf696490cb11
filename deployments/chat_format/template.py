"""A sandboxed jinja2 chat-template renderer that produces what transformers' `apply_chat_template` does.

Chat templates ship with checkpoints from anywhere, so they are untrusted code: they render in jinja2's
immutable sandbox. To give the same text as transformers (and so the same prompt ids and prefix reuse),
the environment matches it: `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a no-op
`{% generation %}` block, json.dumps-style `tojson` (keys unsorted, no HTML escaping, `ensure_ascii`
off by default), and the globals `raise_exception` and `strftime_now`; the tokenizer's named special
tokens are template variables, and message keys whose value is None are dropped before rendering.
"""

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateRenderError(ValueError):
    """The template refused the request (raise_exception) or failed while rendering; becomes an HTTP 400."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps it."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _SafeNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes, which would otherwise reach Python internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja2's Namespace
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for key in attrs:
            _SafeNamespace._check(key)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, key: str, value: Any) -> None:
        _SafeNamespace._check(key)
        jinja2.utils.Namespace.__setitem__(self, key, value)

    @staticmethod
    def _check(key: Any) -> None:
        if isinstance(key, str) and key.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {key!r} is not allowed")


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _SafeNamespace
    return env.from_string(source)


def plain_data(value: Any) -> Any:
    """A copy made of JSON types only, so the template can neither mutate nor reach the caller's objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, dict):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_data(v) for v in value]
    return f"<{type(value).__name__}>"


class ChatTemplate:
    """One compiled template plus the special-token variables it sees."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        try:
            self._template = _compile(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"chat template does not compile: {exc} (line {exc.lineno})") from exc
        self._special = dict(special_tokens or {})
        self.source = source

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text; raises TemplateRenderError when the template refuses or breaks."""
        chat = [{k: v for k, v in m.items() if v is not None} for m in plain_data(messages)]
        variables = {**self._special, **plain_data(template_kwargs or {})}
        try:
            return self._template.render(
                messages=chat,
                tools=plain_data(tools),
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateRenderError(f"the chat template rejected the request: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise TemplateRenderError(f"the chat template failed on this request: {exc}") from exc
