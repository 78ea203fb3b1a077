"""Constrained decoding: a request's output held to a JSON schema, any JSON object, a regular
expression, one of several strings, or an EBNF grammar, with xgrammar (the engine vLLM and
SGLang use).

In a request's path: the front checks the constraint (`StructuredOutput.check`, which
parses it without a tokenizer and names the client's field on failure); a worker compiles it
for its tokenizer off the engine thread, once per distinct constraint (`GrammarCompiler`'s
bounded cache); the engine gives the request a `GrammarMatcher`, which every step fills a
token bitmask from (applied to that request's row only, `apply_bitmasks`) and which advances
with each token the request accepts. A request prefilled elsewhere, or resumed after a lost
leg, replays the tokens it already has through a fresh matcher (`Constraint.replay`), so the
decode worker continues from the very state the prefill worker left: the grammar state is
rebuilt from the constraint and the accepted tokens, never sent."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.common.errors import InvalidRequestError

if TYPE_CHECKING:  # torch and xgrammar load where constraints run (workers), not on import
    from torch import Tensor

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar; larger ones are refused
MAX_CHOICES = 256
CACHE_BYTES = 64 << 20  # compiled grammars kept per worker (xgrammar's own LRU bound)


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. `kind`: "json" (a JSON schema, as text), "json_object"
    (any JSON object; `spec` empty), "regex", "choice" (`choices`) or "grammar" (EBNF as
    xgrammar reads it). `strict` (json): no properties beyond the schema's unless it allows
    them (OpenAI's `strict: true`); otherwise xgrammar's default, as vLLM's."""

    kind: str
    spec: str = ""
    choices: tuple[str, ...] = ()
    strict: bool = False
    # How the client named it, for errors (e.g. "response_format.json_schema.schema").
    field: str = "structured_output"

    def key(self) -> tuple[str, str, tuple[str, ...], bool]:
        return (self.kind, self.spec, self.choices, self.strict)

    def check(self) -> StructuredOutput:
        """Raise `InvalidRequestError` naming `field` when the constraint cannot be used
        (an unknown kind, a schema that is no JSON or uses what xgrammar does not support,
        a regex or grammar that does not parse); return self."""
        if self.kind not in KINDS:
            raise InvalidRequestError(self.field, f"must be one of {', '.join(KINDS)}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequestError(self.field, f"longer than {MAX_SPEC_CHARS} characters")
        if self.kind == "choice":
            if not self.choices or len(self.choices) > MAX_CHOICES:
                raise InvalidRequestError(
                    self.field, f"needs between 1 and {MAX_CHOICES} choices, got "
                    f"{len(self.choices)}"
                )  # fmt: skip
            if any(not c for c in self.choices):
                raise InvalidRequestError(self.field, "a choice is empty")
        try:
            self.grammar()
        except Exception as e:  # xgrammar's errors, a JSONDecodeError, a RecursionError
            raise InvalidRequestError(self.field, _reason(e)) from None
        return self

    def grammar(self) -> Any:
        """The constraint as an xgrammar `Grammar` (tokenizer-independent)."""
        import xgrammar as xgr

        if self.kind == "json":
            json.loads(self.spec)  # a JSONDecodeError is a ValueError: say so, not a crash
            return xgr.Grammar.from_json_schema(self.spec, strict_mode=self.strict)
        if self.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}')
        if self.kind == "regex":
            return xgr.Grammar.from_regex(self.spec)
        if self.kind == "choice":
            return xgr.Grammar.from_regex("|".join(_regex_literal(c) for c in self.choices))
        return xgr.Grammar.from_ebnf(self.spec)


def _regex_literal(text: str) -> str:
    return "(" + "".join("\\" + c if c in r"\^$.|?*+()[]{}/" else c for c in text) + ")"


def _reason(e: Exception) -> str:
    """xgrammar's message without its time and source location ("[18:57:32]
    /project/cpp/regex_converter.cc:94: ...")."""
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else type(e).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)


class GrammarCompiler:
    """A worker's compiled constraints for its tokenizer: compiled once per distinct
    constraint and kept in xgrammar's cache, bounded by `cache_bytes` (least recently used
    first out). Thread-safe: the servicers compile in a worker thread before the request
    reaches the engine, which then finds it compiled."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int] = (),
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        """`stop_token_ids`: the tokens that end a completed structure (the engine's EOS
        set; xgrammar's guess from the tokenizer where empty)."""
        import xgrammar as xgr

        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        self._compiler = xgr.GrammarCompiler(
            self.info, max_threads=1, cache_enabled=True, cache_limit_bytes=cache_bytes
        )
        self._lock = threading.Lock()
        self.num_compiled = 0  # compiles that missed the cache (measured in tests)
        self._seen: set[tuple[str, str, tuple[str, ...], bool]] = set()

    def compile(self, constraint: StructuredOutput) -> Any:
        """The compiled grammar (raises `InvalidRequestError` naming the constraint's field
        when it cannot be compiled)."""
        try:
            with self._lock:
                compiled = self._compile(constraint)
                if constraint.key() not in self._seen:
                    self._seen.add(constraint.key())
                    self.num_compiled += 1
                    if len(self._seen) > 4096:  # only counts; xgrammar bounds the memory
                        self._seen.clear()
                return compiled
        except Exception as e:  # as in `StructuredOutput.check`
            raise InvalidRequestError(constraint.field, _reason(e)) from None

    def _compile(self, c: StructuredOutput) -> Any:
        if c.kind == "json":
            json.loads(c.spec)
            return self._compiler.compile_json_schema(c.spec, strict_mode=c.strict)
        if c.kind == "json_object":
            return self._compiler.compile_builtin_json_grammar()
        if c.kind == "regex":
            return self._compiler.compile_regex(c.spec)
        if c.kind == "choice":
            return self._compiler.compile_regex("|".join(_regex_literal(x) for x in c.choices))
        return self._compiler.compile_grammar(c.spec)

    def cache_bytes(self) -> int:
        return int(self._compiler.get_cache_size_bytes())

    def matcher(self, constraint: StructuredOutput) -> Constraint:
        return Constraint(self.compile(constraint))


class Constraint:
    """One request's grammar state: the tokens it may take next, advanced with each it took."""

    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        """Advance past `token_id`; False if the grammar does not allow it."""
        return bool(self.matcher.accept_token(token_id))

    def replay(self, token_ids: Sequence[int], field: str) -> None:
        """Advance past tokens this request took elsewhere (its prefill worker's first token,
        a lost leg's output); a token the grammar refuses is the caller's mistake."""
        for t in token_ids:
            if not self.accept(t):
                raise InvalidRequestError(
                    field, f"token {t} does not fit the request's structured output"
                )

    @property
    def terminated(self) -> bool:
        """The output is complete: the grammar took its end."""
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


def apply_bitmasks(
    logits: Tensor, constraints: Sequence[Constraint | None], inplace: bool = True
) -> Tensor:
    """`logits` [N, V] with every constrained row's disallowed tokens at -inf (in place, or
    in a new tensor with `inplace=False`; CPU or CUDA); unconstrained rows untouched. On CUDA
    xgrammar's kernel applies the masks; on CPU each byte of a mask picks a row of 8
    additions (0 allowed, -inf not) from a table, added in one pass: xgrammar's CPU function
    writes token by token, several times slower at a JSON structure's positions, where
    almost every token is disallowed."""
    rows = [i for i, c in enumerate(constraints) if c is not None and not c.terminated]
    if not rows:
        return logits
    import xgrammar as xgr

    if logits.device.type != "cpu":
        logits = logits if inplace else logits.clone()
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
        for i in rows:
            constraints[i].fill(bitmask, i)  # type: ignore[union-attr]
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
        return logits
    import torch

    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])  # constrained rows only
    for j, i in enumerate(rows):
        constraints[i].fill(bitmask, j)  # type: ignore[union-attr]
    table = _byte_masks(logits.dtype)
    # Little-endian int32 words: byte m of a row holds tokens 8m .. 8m + 7, bit k token 8m + k.
    add = table.index_select(0, bitmask.view(torch.uint8).view(-1).int())
    add = add.view(len(rows), -1)[:, : logits.shape[1]]
    if len(rows) == logits.shape[0]:
        return logits.add_(add) if inplace else logits + add  # (a copy costs a pass)
    logits = logits if inplace else logits.clone()
    return logits.index_add_(0, torch.tensor(rows), add)


_BYTE_MASKS: dict = {}  # dtype -> its [256, 8] table


def _byte_masks(dtype: Any) -> Tensor:
    """[256, 8]: row b is 0 where bit k of byte b is set (the token is allowed), else -inf."""
    table = _BYTE_MASKS.get(dtype)
    if table is None:
        import torch

        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = torch.where(bits.bool(), 0.0, float("-inf")).to(dtype)
        _BYTE_MASKS[dtype] = table
    return table
