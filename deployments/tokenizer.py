"""Loading a checkpoint's tokenizer and the ids generation needs (end tokens, BOS)."""

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

GIL_FREE_CHARS = 4096  # texts this long are tokenised with the GIL released (other threads keep running)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be served; the message names the file and the problem."""


@dataclass
class TokenizerBundle:
    """A checkpoint's tokenizer plus the ids and strings around it (loaded by Renderer and Scheduler)."""

    tokenizer: Tokenizer
    eos_token_ids: list[int]  # every id that ends a reply (config, generation config, tokenizer config)
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None  # the checkpoint's default template text, if any
    named_templates: dict[str, str] = field(default_factory=dict)  # e.g. {"tool_use": ...}
    add_bos_token: bool = False

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if len(text) >= GIL_FREE_CHARS:  # `encode` holds the GIL throughout (seconds for megabytes)
            return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    @cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of input text one token covers, so a text of B bytes holds at
        least ceil(B / max_token_bytes) tokens (deployments/messages/window.py): the longest token, as
        stored or decoded alone (a stored `Ġ`/`▁` marker or `<0x..>` byte counts at least what it stands
        for), times 4 when a normaliser runs first (Unicode composition shortens text by at most 3 to 1,
        Hangul jamo to a syllable)."""
        ids = range(self.vocab_size)
        decoded = self.tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
        stored = (self.tokenizer.id_to_token(i) or "" for i in ids)
        longest = max((max(len(d.encode()), len(s.encode())) for d, s in zip(decoded, stored)), default=1)
        return max(longest, 1) * (4 if self.tokenizer.normalizer is not None else 1)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not readable JSON ({exc})") from exc


def _token_text(value: object) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


def _as_id_list(value: object) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def load_tokenizer(checkpoint_dir: str | Path) -> TokenizerBundle:
    root = Path(checkpoint_dir)
    tok_path = root / "tokenizer.json"
    if not tok_path.exists():
        raise CheckpointError(f"{tok_path}: missing (a fast tokenizer file is required)")
    try:
        tokenizer = Tokenizer.from_file(str(tok_path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise CheckpointError(f"{tok_path}: cannot load tokenizer ({exc})") from exc
    tok_cfg = _read_json(root / "tokenizer_config.json")
    model_cfg = _read_json(root / "config.json")
    gen_cfg = _read_json(root / "generation_config.json")

    eos_ids: list[int] = []
    for source in (gen_cfg.get("eos_token_id"), model_cfg.get("eos_token_id")):
        eos_ids.extend(i for i in _as_id_list(source) if i not in eos_ids)
    eos_token = _token_text(tok_cfg.get("eos_token"))
    if eos_token is not None:
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is not None and eos_id not in eos_ids:
            eos_ids.append(eos_id)

    template = tok_cfg.get("chat_template")
    named: dict[str, str] = {}
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t}
        template = named.get("default")
    jinja_path = root / "chat_template.jinja"
    if jinja_path.exists():
        template = jinja_path.read_text(encoding="utf-8")
    return TokenizerBundle(
        tokenizer=tokenizer,
        eos_token_ids=eos_ids,
        bos_token=_token_text(tok_cfg.get("bos_token")),
        eos_token=eos_token,
        pad_token=_token_text(tok_cfg.get("pad_token")),
        chat_template=template if isinstance(template, str) else None,
        named_templates=named,
        add_bos_token=bool(tok_cfg.get("add_bos_token", False)),
    )
