"""The forced-call grammar of Gemma 4's markup (markups/gemma.py): one call, arguments inside the schema.

Written as EBNF, since its values nest in a syntax of their own: strings between `<|"|>` quotes (raw text
without `<`, as the XML-like families' strings), objects and arrays in Gemma's braces with keys in sorted
order as the template writes them, and numbers, integers and booleans as JSON spells them, embedded from
xgrammar's JSON-schema grammar of that scalar (its rules renamed apart). No blanks are allowed between
tokens: the template writes none.
"""

import json
import re
from typing import Any

import xgrammar as xgr

from deployments.chat_format.markups import grammar_pieces as g
from deployments.chat_format.markups.gemma_values import QUOTE

_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\w+|.', re.DOTALL)
_ANY = """gv ::= gstr | "true" | "false" | "None" | gnum | "{" (gkey ":" gv ("," gkey ":" gv)*)? "}" | "[" (gv ("," gv)*)? "]"
gnum ::= "-"? [0-9]+ ("." [0-9]+)? ([eE] [+\\-]? [0-9]+)?
gkey ::= [A-Za-z0-9_.\\-]+ | gstr
gstr ::= {quote} [^<]* {quote}"""


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class _Rules:
    """EBNF rules under construction: each schema gets a rule named apart."""

    def __init__(self) -> None:
        self.lines: list[str] = [_ANY.replace("{quote}", _lit(QUOTE))]
        self.count = 0

    def add(self, body: str) -> str:
        self.count += 1
        name = f"gr{self.count}"
        self.lines.append(f"{name} ::= {body}")
        return name

    def embed(self, grammar: xgr.Grammar) -> str:
        """Another grammar's rules, renamed apart; returns its root's new name."""
        self.count += 1
        prefix = f"ge{self.count}_"
        text = str(grammar)
        names = set(re.findall(r"^(\w+) ::=", text, re.MULTILINE))
        renamed = "".join(prefix + t if t in names else t for t in _TOKEN.findall(text))
        self.lines.extend(line for line in renamed.splitlines() if line.strip())
        return prefix + "root"

    def value(self, schema: Any) -> str:
        """The rule of one value under `schema`."""
        if not isinstance(schema, dict):
            return "gv"
        choices = [schema["const"]] if "const" in schema else schema.get("enum")
        if isinstance(choices, list):
            spelled = [_lit(QUOTE + c + QUOTE) if isinstance(c, str) else _scalar(c) for c in choices]
            return self.add(" | ".join(spelled))
        kind = schema.get("type")
        if kind == "string":
            low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
            chars = "[^<]*" if high is None and not low else f"[^<]{{{low},{'' if high is None else int(high)}}}"
            return self.add(f"{_lit(QUOTE)} {chars} {_lit(QUOTE)}")
        if kind in ("integer", "number", "boolean"):
            return self.embed(g.json_value(schema))
        if kind == "null":
            return self.add('"None"')
        if kind == "object" and isinstance(schema.get("properties"), dict):
            return self.add(f'"{{" {self.arguments(schema)} "}}"')
        if kind == "array" and isinstance(schema.get("items"), dict):
            return self.array(schema)
        return "gv"

    def array(self, schema: dict[str, Any]) -> str:
        item = self.value(schema["items"])
        low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
        if high is not None and int(high) == 0:
            return self.add('"[" "]"')
        if high is not None and int(high) == 1:
            items = item
        else:
            items = f'{item} ("," {item}){{{max(low - 1, 0)},{"" if high is None else int(high) - 1}}}'
        return self.add(f'"[" {items} "]"' if low > 0 else f'"[" ({items})? "]"')

    def arguments(self, parameters: dict[str, Any]) -> str:
        """An object's `key:value` pairs, keys sorted, commas between; optional ones may be left out."""
        properties = parameters.get("properties") or {}
        required = set(parameters.get("required") or [])
        keys = sorted(properties)
        pairs = [self.add(f"{_lit(key + ':')} {self.value(properties[key])}") for key in keys]
        first_required = next((i for i, key in enumerate(keys) if key in required), None)

        def after(i: int) -> str:  # the pairs past the i-th, each with its comma
            return " ".join(
                f'"," {pairs[j]}' if keys[j] in required else f'("," {pairs[j]})?' for j in range(i + 1, len(keys))
            )

        if first_required is not None:
            before = " ".join(f'({pairs[i]} ",")?' for i in range(first_required))
            return self.add(f"{before} {pairs[first_required]} {after(first_required)}".strip())
        if not keys:
            return '""'
        firsts = [f"({pairs[i]} {after(i)})" for i in range(len(keys))]
        return self.add(" | ".join([*firsts, '""']))


def _scalar(value: Any) -> str:
    return _lit("None" if value is None else json.dumps(value))


def call_grammar(call_open: str, call_close: str, tool: dict[str, Any]) -> xgr.Grammar:
    """One call to `tool` in Gemma's markup, markers included."""
    name, parameters = g.signature(tool)
    rules = _Rules()
    arguments = rules.arguments(parameters or {})
    root = f"root ::= {_lit(call_open + 'call:' + name + '{')} {arguments} {_lit('}' + call_close)}"
    return xgr.Grammar.from_ebnf("\n".join([root, *rules.lines]))
