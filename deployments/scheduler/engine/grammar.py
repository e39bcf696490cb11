"""Grammar-constrained replies: compiled grammars (cached), one matcher per sequence, and its bitmask.

The Scheduler owns the matchers: before a row is drawn it fills the row's allowed-token bitmask (xgrammar's
packed int32 words) into the row's SeqDraw, and after the draw it advances the matcher with the token. The
rank only masks logits, so a constrained reply stays a pure function of (seed, position, masked logits).
With thinking on, the grammar starts after the think closer; before it the reply is unconstrained.
"""

import enum
import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from deployments.messages.replies import Refusal
from deployments.messages.requests import GrammarSpec
from deployments.tokenizer import TokenizerBundle

if TYPE_CHECKING:
    import xgrammar as xgr

log = logging.getLogger("tensorfold.engine")

MAX_JSON_BLANKS = 32  # blank characters allowed between two JSON tokens (pretty-printing fits)
MAX_BLANKS_AFTER_THINK = 4  # blank tokens allowed between the think closer and the answer ("\n\n"),
# holding at most MAX_JSON_BLANKS characters together (one tokenizer token may be a long run of spaces)
CACHE_ENTRIES = 256  # compiled grammars kept per engine
KINDS = ("json_object", "json_schema", "regex", "ebnf")


class GrammarFailure(RuntimeError):
    """The matcher rejected a drawn token: that request ends with an error, the others go on."""


class _Phase(enum.Enum):
    MAY_THINK = "may_think"  # the first reply token: the grammar's tokens, or the think opener
    THINKING = "thinking"  # inside a think block: unconstrained until the closer
    AFTER_THINK = "after_think"  # just past the closer: a few blank tokens may come before the grammar's
    ANSWER = "answer"  # the grammar holds


class ReplyGrammar:
    """One sequence's matcher plus the think-block gate in front of it."""

    def __init__(
        self,
        compiled: "xgr.CompiledGrammar",
        spec: GrammarSpec,
        vocab_size: int,
        stop_ids: list[int],
        blank_widths: dict[int, int],
    ) -> None:
        import xgrammar as xgr  # imported on first use: it pulls in transformers

        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_ids)
        self.spec = spec
        self.vocab_size = vocab_size
        self.blank_widths = blank_widths  # tokens whose text is only blanks -> their character count
        self.blanks_after_think = 0  # blank tokens written since the think closer
        self.blank_chars_after_think = 0  # and their characters
        self.dead_end = False  # the last mask allowed nothing: whatever is drawn next is refused
        self.matcher_steps = 0  # tokens the xgrammar matcher has accepted (what a rollback counts back)
        if spec.starts_in_think and spec.think_closer_id is not None:
            self.phase = _Phase.THINKING
        elif spec.think_opener_id is not None and spec.think_closer_id is not None:
            self.phase = _Phase.MAY_THINK
        else:
            self.phase = _Phase.ANSWER

    @property
    def terminated(self) -> bool:
        """The value is complete and its end token was accepted."""
        return self.matcher.is_terminated()

    def allowed(self) -> torch.Tensor | None:
        """The packed bitmask [ceil(V / 32)] for the next token (every id while thinking, save end tokens)."""
        bitmask = torch.full(((self.vocab_size + 31) // 32,), -1, dtype=torch.int32).unsqueeze(0)  # all allowed
        if self.phase is _Phase.THINKING:  # the value must still come: no end token before the closer
            words = bitmask[0].clone()  # allocated as all allowed
            for stop in self.matcher.stop_token_ids:
                _clear_bit(words, stop)
            return words
        if self.matcher.is_terminated():  # ignore_eos past a complete value: only end tokens stay possible
            bitmask.zero_()
            for stop in self.matcher.stop_token_ids:
                _set_bit(bitmask[0], stop)
        else:
            self.matcher.fill_next_token_bitmask(bitmask)
        words = bitmask[0].clone()
        if self.phase is _Phase.MAY_THINK:
            opener = self.spec.think_opener_id
            assert opener is not None
            _set_bit(words, opener)
        if self.phase is _Phase.AFTER_THINK:
            for blank in self.blank_widths:
                if self._blank_fits(blank):
                    _set_bit(words, blank)
        self.dead_end = not bool(words.any())
        return words

    def accept(self, token: int) -> None:
        """Advance past a drawn token (raises GrammarFailure if the grammar refuses it)."""
        if self.phase is _Phase.THINKING:
            if token == self.spec.think_closer_id:
                self.phase = _Phase.AFTER_THINK
            return
        if self.phase is _Phase.AFTER_THINK:
            if self._blank_fits(token):
                self.blanks_after_think += 1
                self.blank_chars_after_think += self.blank_widths[token]
                return
            self.phase = _Phase.ANSWER
        if self.phase is _Phase.MAY_THINK:
            if token == self.spec.think_opener_id:
                self.phase = _Phase.THINKING
                return
            self.phase = _Phase.ANSWER
        if self.matcher.is_terminated():
            return
        if self.matcher.accept_token(token):
            self.matcher_steps += 1
        else:
            if self.dead_end:  # nothing was allowed (e.g. the only continuation is an end id): say so
                raise GrammarFailure(
                    f"the grammar allows no token here (end ids {self.matcher.stop_token_ids} "
                    f"are never text to it); token {token} was drawn unconstrained"
                )
            raise GrammarFailure(f"the grammar refused token {token} while decoding")

    def checkpoint(self) -> tuple:
        """The state `restore` returns to (drafts are walked through the grammar, then taken back)."""
        return (self.phase, self.blanks_after_think, self.blank_chars_after_think, self.dead_end, self.matcher_steps)

    def restore(self, state: tuple) -> None:
        phase, blanks, chars, dead_end, steps = state
        if self.matcher_steps > steps:
            self.matcher.rollback(self.matcher_steps - steps)
        self.phase, self.blanks_after_think, self.blank_chars_after_think = phase, blanks, chars
        self.dead_end, self.matcher_steps = dead_end, steps

    def _blank_fits(self, token: int) -> bool:
        """Whether a blank token still fits the gap after the think closer (tokens and characters)."""
        width = self.blank_widths.get(token)
        return (
            width is not None
            and self.blanks_after_think < MAX_BLANKS_AFTER_THINK
            and self.blank_chars_after_think + width <= MAX_JSON_BLANKS
        )


def allows(words: torch.Tensor, token: int) -> bool:
    """Whether a packed bitmask [W] lets `token` through."""
    return 0 <= token < words.shape[0] * 32 and bool((int(words[token // 32]) >> (token % 32)) & 1)


def _clear_bit(words: torch.Tensor, token: int) -> None:
    words[token // 32] &= ~torch.tensor(1 << (token % 32), dtype=torch.int64).to(torch.int32)


def _set_bit(words: torch.Tensor, token: int) -> None:
    words[token // 32] |= torch.tensor(1 << (token % 32), dtype=torch.int64).to(torch.int32)


class GrammarBackend:
    """Compiles grammars for one engine's tokenizer (lazily: xgrammar is only set up on first use)."""

    def __init__(self, tokenizer: TokenizerBundle, vocab_size: int, stop_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self._compiler: "xgr.GrammarCompiler | None" = None
        self._blank_widths: dict[int, int] | None = None
        self._cache: OrderedDict[tuple[str, str], "xgr.CompiledGrammar"] = OrderedDict()
        self._lock = threading.Lock()  # check() may compile on a caller's thread, admission on the engine's
        self.compiles = 0  # grammars compiled so far (a cache hit does not count)
        textual = text_end_ids(tokenizer, self.stop_ids)
        if textual:  # a misconfigured checkpoint: grammars cannot write these, and a reply ends on them
            log.warning(
                "end token ids %s are ordinary text tokens %s of the tokenizer: constrained replies "
                "can never write them",
                textual,
                [tokenizer.decode([i]) for i in textual],
            )

    def _compiler_for_tokenizer(self) -> "xgr.GrammarCompiler":
        if self._compiler is None:
            import xgrammar as xgr
            from transformers import PreTrainedTokenizerFast

            hf = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.tokenizer)
            info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size, stop_token_ids=self.stop_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def _compile_uncached(self, spec: GrammarSpec) -> "xgr.CompiledGrammar":
        compiler = self._compiler_for_tokenizer()
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', max_whitespace_cnt=MAX_JSON_BLANKS)
        if spec.kind == "json_schema":
            return compiler.compile_json_schema(spec.source, max_whitespace_cnt=MAX_JSON_BLANKS)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.source)
        if spec.kind == "ebnf":
            return compiler.compile_grammar(spec.source)
        raise ValueError(f"unknown grammar kind {spec.kind!r}")

    def check(self, spec: GrammarSpec) -> Refusal | None:
        """Compile the spec ahead of its request (cached); a grammar that does not compile is refused, naming
        the request field it came from."""
        if spec.kind not in KINDS:
            return Refusal(f"unknown grammar kind {spec.kind!r}", spec.param)
        try:
            self.compile(spec)
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses with its reason
            return Refusal(f"{spec.param}: the grammar does not compile: {exc}", spec.param)
        return None

    def compile(self, spec: GrammarSpec) -> "xgr.CompiledGrammar":
        """The compiled grammar for a spec; the same (kind, source) is compiled once (raises what xgrammar
        raises for a grammar it cannot compile)."""
        key = (spec.kind, spec.source)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            compiled = self._compile_uncached(spec)
            self.compiles += 1
            self._cache[key] = compiled
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return compiled

    def blank_widths(self) -> dict[int, int]:
        """Ids whose text is nonempty and only blanks (what a template writes after the think closer), each
        with its number of characters."""
        if self._blank_widths is None:
            tokenizer = self._tokenizer
            size = min(tokenizer.vocab_size, self.vocab_size)
            texts = (tokenizer.decode([i]) for i in range(size))
            self._blank_widths = {i: len(text) for i, text in enumerate(texts) if text and not text.strip()}
        return self._blank_widths

    def reply_grammar(self, spec: GrammarSpec) -> ReplyGrammar:
        blanks = self.blank_widths() if spec.think_closer_id is not None else {}
        return ReplyGrammar(self.compile(spec), spec, self.vocab_size, self.stop_ids, blanks)


def text_end_ids(tokenizer: TokenizerBundle, end_ids: list[int]) -> list[int]:
    """End ids that the tokenizer knows as ordinary (not special, not added) vocabulary entries."""
    added = set(tokenizer.tokenizer.get_added_tokens_decoder())
    size = tokenizer.tokenizer.get_vocab_size(with_added_tokens=False)
    return [i for i in end_ids if i < size and i not in added]
