"""Structured outputs on llguidance: grammars compiled off the caller's thread and cached,
one matcher per request, and the allowed-token bitmasks of a step's grammar rows filled in
one parallel call.

A grammar is refused (InvalidRequestError, a 400) before its request starts unless it fits
the budgets of StructuredOutputConfig: its size, its compile time, a JSON schema's nesting,
and llguidance's lexer limits. llguidance builds its lexer lazily, a little more each token,
and a lexer that outgrows its limits fails mid-generation; so compiling walks the grammar for
up to ``probe_tokens`` tokens first, always taking the longest token allowed (deterministic,
and the deepest a lexer gets in so many tokens), and refuses what fails there. A failure is
cached like a success, so a grammar is answered the same whether cached or not; its matcher
is dropped and the memory its lexer took handed back to the system.

The engine thread owns the matchers: it fills the bitmask when it builds a step and advances
a matcher with the token the step sampled. The worker only applies the bitmask (one tensor
op in the sampler), so it needs no grammar engine and nothing crosses a process boundary but
a small int32 tensor.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from tandem.core.config import StructuredOutputConfig
from tandem.core.errors import InvalidRequestError
from tandem.core.llm.structured_output_spec import StructuredOutputSpec, json_depth
from tandem.core.llm.tokenizer import Tokenizer
from tandem.device.cpu import release_freed_memory

if TYPE_CHECKING:
    import llguidance

logger = logging.getLogger(__name__)


# How llguidance (1.9) words a token outside the grammar, as opposed to its limits.
_TOKEN_REFUSED = "doesn't satisfy the grammar"


def run_nicer(increment: int) -> None:
    """Raise the calling thread's niceness by ``increment`` (Linux only: elsewhere niceness
    is the whole process's, which must not change)."""
    if increment == 0 or sys.platform != "linux":
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + increment)
    except OSError as exc:  # a container may forbid it; compiles then share the cores evenly
        logger.warning("grammar threads keep the server's priority: %s", exc)


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher, owner: StructuredOutputs, param: str) -> None:
        """``param``: the request field the grammar came from."""
        self.matcher = matcher
        self.owner = owner
        self.param = param

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False when the grammar does not allow it."""
        return bool(self.matcher.consume_token(token_id))

    @property
    def is_finished(self) -> bool:
        """Nothing but EOS may follow: the output is complete."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self.matcher.get_error())

    @property
    def broken(self) -> bool:
        """The grammar engine gave up on this grammar (a run-time limit, such as the items of
        a parser row, broken while it advanced): the client's grammar is at fault. Not so
        for a token the grammar refuses, which llguidance reports as not satisfying the
        grammar: the bitmask should have kept it out, and that is the server's fault."""
        return bool(self.matcher.is_error()) and _TOKEN_REFUSED not in self.error


class StructuredOutputs:
    """Compiles and caches grammars for one tokenizer and vocabulary; thread-safe."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        config: StructuredOutputConfig,
    ) -> None:
        self._tokenizer = tokenizer
        # Bitmasks cover the logits' width; llguidance needs at least the tokenizer's.
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self._eos = sorted(eos_token_ids)
        self._config = config
        self._pool = ThreadPoolExecutor(
            config.compile_threads,
            "tandem-grammar",
            initializer=run_nicer,
            initargs=(config.compile_niceness,),
        )
        self._lock = threading.Lock()
        self._compiled: OrderedDict[StructuredOutputSpec, Future[llguidance.LLMatcher]] = (
            OrderedDict()
        )
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        # Bytes of each token for the probe; -1 for EOS and special tokens.
        self._token_bytes: torch.Tensor | None = None
        self._executor: llguidance.LLExecutor | None = None

    # -- compiling (any thread) -----------------------------------------------------------

    def submit(self, spec: StructuredOutputSpec) -> Future[llguidance.LLMatcher]:
        """The compiled grammar of ``spec``, compiling it on the pool unless cached (equal
        specs submitted together compile once). The future fails with InvalidRequestError
        when the spec cannot be compiled."""
        with self._lock:
            future = self._compiled.get(spec)
            if future is not None:
                self._compiled.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._compiled[spec] = future
            while len(self._compiled) > self._config.cache_size:
                self._compiled.popitem(last=False)
            return future

    def new_grammar(self, spec: StructuredOutputSpec) -> GrammarState:
        """A fresh matcher for one request (blocks while ``spec`` compiles, if it must)."""
        try:
            prototype = self.submit(spec).result()
        except InvalidRequestError as exc:
            raise fresh_error(exc) from None
        return GrammarState(prototype.deep_copy(), self, spec.param)

    @property
    def compile_timeout_s(self) -> float:
        return self._config.compile_timeout_s

    def refuse_slow(self, spec: StructuredOutputSpec) -> InvalidRequestError:
        """The error for a caller that gave up waiting on ``spec``'s compilation after
        compile_timeout_s, recorded as the spec's outcome (the compile still running, in
        llguidance where it cannot be stopped, is then ignored), so that asking again is
        refused the same way rather than served once the compile ends."""
        error = self._too_slow(spec)
        failed: Future[llguidance.LLMatcher] = Future()
        failed.set_exception(error)
        with self._lock:
            if spec in self._compiled:
                self._compiled[spec] = failed
        return fresh_error(error)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutputSpec) -> llguidance.LLMatcher:
        result = self._build(spec, time.monotonic())
        if isinstance(result, InvalidRequestError):
            # Nothing holds the failed matcher now (the error keeps no frame that named it):
            # give what its lexer took back to the system rather than keep it in the heap.
            release_freed_memory()
            raise result
        for warning in result.get_grammar_warnings():
            logger.info("grammar warning for %s: %s", spec.param, warning)
        return result

    def _build(
        self, spec: StructuredOutputSpec, started: float
    ) -> llguidance.LLMatcher | InvalidRequestError:
        """The compiled and probed grammar, or the error that refuses it."""
        import llguidance

        config = self._config
        size = len(spec.value.encode())
        if size > config.max_grammar_bytes:
            return InvalidRequestError(
                f"the {_describe(spec)} takes {size} bytes, more than the "
                f"{config.max_grammar_bytes} this server compiles (--max-grammar-bytes)",
                param=spec.param,
            )
        if spec.kind == "json" and (depth := json_depth(spec.value)) > config.max_schema_depth:
            return InvalidRequestError(
                f"the JSON schema nests objects and arrays {depth} deep, deeper than the "
                f"{config.max_schema_depth} this server compiles (--max-schema-depth)",
                param=spec.param,
            )
        limits = llguidance.LLParserLimits(verbose_errors=False)
        if spec.kind == "choice" and (count := len(json.loads(spec.value))) >= (
            row := limits.max_items_in_row
        ):
            # Every option is an item of the parser's first row, beside the start rule.
            return InvalidRequestError(
                f"the choice list has {count} options; the grammar engine holds at most "
                f"{row} items in a parser row, so at most {row - 1} options",
                param=spec.param,
            )
        grammar = self._serialize(spec)
        matcher = llguidance.LLMatcher(
            self._tokenizer_for_grammars(), grammar, log_level=0, limits=limits
        )
        if matcher.is_error():
            return InvalidRequestError(
                f"the {_describe(spec)} cannot be compiled: {_concise(matcher.get_error())}",
                param=spec.param,
            )
        return self._probe(spec, matcher, started)

    def _probe(
        self, spec: StructuredOutputSpec, matcher: llguidance.LLMatcher, started: float
    ) -> llguidance.LLMatcher | InvalidRequestError:
        """``matcher`` once a copy of it (sharing its lexer, which the walk warms up for the
        requests to come) has walked probe_tokens tokens, each the longest the grammar
        allows, through llguidance's limits and within compile_timeout_s; else the error."""
        if self._config.probe_tokens == 0:
            return matcher
        walker = matcher.deep_copy()
        token_bytes = self._token_bytes_for_probe()
        shifts = torch.arange(32, dtype=torch.int32)
        for _ in range(self._config.probe_tokens + 1):
            if time.monotonic() - started > self._config.compile_timeout_s:
                return self._too_slow(spec)
            words = torch.frombuffer(bytearray(walker.compute_bitmask()), dtype=torch.int32)
            if walker.is_error():
                break
            allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten()[: len(token_bytes)]
            lengths = torch.where(allowed.bool(), token_bytes, -1)
            token = int(lengths.argmax())
            if lengths[token] < 0 or walker.is_stopped():
                break
            if not walker.consume_token(token):
                break
        if walker.is_error():
            return InvalidRequestError(
                f"the {_describe(spec)} is too complex for this server's grammar engine: "
                f"{_concise(walker.get_error())}",
                param=spec.param,
            )
        if time.monotonic() - started > self._config.compile_timeout_s:
            return self._too_slow(spec)
        return matcher

    def _too_slow(self, spec: StructuredOutputSpec) -> InvalidRequestError:
        return InvalidRequestError(
            f"the {_describe(spec)} takes longer to compile than the "
            f"{self._config.compile_timeout_s:g} s this server allows "
            "(--grammar-compile-timeout-s)",
            param=spec.param,
        )

    def _token_bytes_for_probe(self) -> torch.Tensor:
        # Built once, outside the lock (submit takes it on the event loop); two compiles
        # racing to build it build the same tensor.
        if self._token_bytes is None:
            tokenizer = self._tokenizer_for_grammars()
            eos = set(self._eos)
            self._token_bytes = torch.tensor(
                [
                    -1
                    if t in eos or tokenizer.is_special_token(t)
                    else len(tokenizer.decode_bytes([t]))
                    for t in range(self.vocab_size)
                ],
                dtype=torch.int32,
            )
        return self._token_bytes

    def _serialize(self, spec: StructuredOutputSpec) -> str:
        import llguidance

        # oneOf as anyOf: what pydantic writes for unions is then accepted.
        json_options: Any = {
            "whitespace_flexible": self._config.whitespace_flexible,
            "coerce_one_of": True,
        }
        try:
            if spec.kind == "json":
                schema = close_objects(json.loads(spec.value))
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=json_options)
            if spec.kind == "json_object":
                return llguidance.LLMatcher.grammar_from_json_schema(
                    '{"type": "object"}', defaults=json_options
                )
            if spec.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(spec.value)
            if spec.kind == "choice":
                choices = json.loads(spec.value)
                lark = "start: " + " | ".join(json.dumps(c) for c in choices)
                return llguidance.LLMatcher.grammar_from_lark(lark)
            return llguidance.grammar_from("grammar", spec.value)
        except ValueError as exc:
            raise InvalidRequestError(
                f"the {_describe(spec)} is not valid: {exc}", param=spec.param
            ) from None

    def _tokenizer_for_grammars(self) -> llguidance.LLTokenizer:
        # Built on first use, on a compile thread: about a second for a large vocabulary.
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._tokenizer.backend, n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._ll_tokenizer

    # -- masks (the engine thread) --------------------------------------------------------

    def fill_bitmasks(self, grammars: Sequence[GrammarState]) -> torch.Tensor:
        """[len(grammars), ceil(vocab / 32)] int32: bit t of row i set when grammar i allows
        token t next. Filled in parallel by llguidance's own threads, straight into the
        tensor (llguidance.torch would do the same, but importing it compiles a kernel)."""
        import llguidance

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(grammars), words), -1, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(g.matcher, row) for row, g in enumerate(grammars)],
            bitmask.data_ptr(),
            words * 4,
            len(grammars),
        )
        return bitmask


# Keywords whose value maps names to subschemas, and those whose value is a subschema or a
# list of them.
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas", "patternProperties")
_SUBSCHEMAS = ("items", "prefixItems", "anyOf", "oneOf", "allOf", "not", "if", "then", "else",
               "contains", "additionalItems", "additionalProperties")  # fmt: skip


def close_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` wherever an object lists its properties
    and says nothing of others, as OpenAI's strict mode and vLLM's default engine (xgrammar)
    read it: the output holds exactly the described keys, and a model cannot wander off into
    keys of its own making. A copy; the caller's schema is untouched."""
    if isinstance(schema, list):
        return [close_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict | list):
            out[key] = close_objects(out[key])
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def fresh_error(cached: InvalidRequestError) -> InvalidRequestError:
    """A copy of a cached compile failure to raise. Raising the cached one itself would add
    each raiser's frames to its traceback, and the cache would keep them all (requests'
    locals included) for as long as it keeps the failure."""
    cached.__traceback__ = None
    return InvalidRequestError(str(cached), param=cached.param)


def _concise(error: str) -> str:
    """llguidance's error without the ``<non-verbose/>`` placeholder it leaves for the parser
    state (left out: it would show the probe's walk, not the request's)."""
    return error.replace("<non-verbose/>", "").strip()


def _describe(spec: StructuredOutputSpec) -> str:
    return {
        "json": "JSON schema",
        "json_object": "JSON object grammar",
        "regex": "regex",
        "choice": "choice list",
        "grammar": "grammar",
    }[spec.kind]
