"""Reading Gemma 4's argument syntax (markups/gemma.py says what the template writes) into JSON values."""

import json
from typing import Any

QUOTE = '<|"|>'  # Gemma's string quote, one token in its vocabulary
_BARE_END = ",}]"  # a bare value (number, boolean, None, an unquoted word) runs up to one of these
_SCALARS: dict[str, Any] = {"true": True, "false": False, "None": None, "null": None}


class ValueSyntaxError(ValueError):
    """The text is not a call in Gemma's syntax (the block then stays content)."""


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def expect(self, piece: str) -> None:
        if not self.text.startswith(piece, self.pos):
            raise ValueSyntaxError(f"expected {piece!r} at {self.pos}")
        self.pos += len(piece)

    def peek(self, piece: str) -> bool:
        return self.text.startswith(piece, self.pos)

    def value(self) -> Any:
        if self.peek(QUOTE):
            return self.quoted()
        if self.peek("{"):
            return self.mapping()
        if self.peek("["):
            return self.sequence()
        return self.bare()

    def quoted(self) -> str:
        self.expect(QUOTE)
        end = self.text.find(QUOTE, self.pos)
        if end < 0:
            raise ValueSyntaxError("an unclosed string")
        out, self.pos = self.text[self.pos : end], end + len(QUOTE)
        return out

    def bare(self) -> Any:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in _BARE_END:
            self.pos += 1
        word = self.text[start : self.pos].strip()
        if not word:
            raise ValueSyntaxError(f"a missing value at {start}")
        if word in _SCALARS:
            return _SCALARS[word]
        try:
            number = json.loads(word)
        except ValueError:
            return word  # an unquoted word: the model meant a string
        return number if isinstance(number, (int, float)) else word

    def key(self) -> str:
        if self.peek(QUOTE):
            return self.quoted()
        end = self.text.find(":", self.pos)
        word = self.text[self.pos : end].strip() if end >= 0 else ""
        if not word or any(c in word for c in "{}[],"):
            raise ValueSyntaxError(f"a missing key at {self.pos}")
        self.pos = end
        return word

    def mapping(self) -> dict[str, Any]:
        self.expect("{")
        out: dict[str, Any] = {}
        while not self.peek("}"):
            if out:
                self.expect(",")
            key = self.key()
            self.expect(":")
            out[key] = self.value()
        self.expect("}")
        return out

    def sequence(self) -> list[Any]:
        self.expect("[")
        out: list[Any] = []
        while not self.peek("]"):
            if out:
                self.expect(",")
            out.append(self.value())
        self.expect("]")
        return out


def read_call(body: str) -> tuple[str, dict[str, Any]]:
    """A call block's body, `call:name{...}`, as its name and arguments (ValueSyntaxError otherwise)."""
    text = body.strip()
    if not text.startswith("call:") or "{" not in text:
        raise ValueSyntaxError("not a call")
    brace = text.index("{")
    reader = _Reader(text)
    reader.pos = brace
    arguments = reader.mapping()
    if reader.text[reader.pos :].strip():
        raise ValueSyntaxError("text after the arguments")
    return text[len("call:") : brace].strip(), arguments
