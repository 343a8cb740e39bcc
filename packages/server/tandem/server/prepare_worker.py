"""A preparation process: where a large request body is parsed, its chat template rendered
and its text tokenized, with a tokenizer of its own, so that none of it holds what serving
needs (the server's GIL, its event loop, the engine tokenizer's lock) or keeps its memory.

Measured on the server's own threads (2-core AMD EPYC, demo tokenizer), each of these held
the server's GIL for the time shown, freezing the engine loop and the event loop with it:
``tokenizers``' single ``encode`` of 6 MB for its whole 8.5 s (``encode_batch`` releases the
GIL, but turning its result into lists held it 0.4-0.5 s more); pydantic validation of
150,000 chat messages for up to 0.25 s at a time (1.2 s in all); pickling or unpickling such
a body for up to 0.4 s; a gen-2 garbage collection over its objects 0.2 s; and a template
rendering them is Python that competes for the GIL with the engine's threads for its whole
time limit; a completion's 20,000 prompts, or a /detokenize of 131,072 ids, are the same
kind of work. Here only bytes cross: the server sends the body's bytes and gets back bytes
(a whole answer, or a small body to go on with) and the token ids of prompts that fit.

The process reads frames from stdin and writes them to stdout (``write_frame``; a job's
body and an answer's body go as raw bytes after their frame); the first frame is its
``WorkerSpec``. It ends when stdin closes (the server went away), and after a
job that left it holding much more memory than it started with (it says so in its reply;
the server starts another)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import logging
import pickle
import struct
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from tandem.server.state import ChatConfig, ServerLimits

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<Q")

# Jobs: what the server asks of a body.
TOKENIZE = "tokenize"
DETOKENIZE = "detokenize"
CHAT = "chat"
COMPLETION = "completion"


@dataclass(frozen=True)
class WorkerSpec:
    """What a preparation process needs to prepare requests as the server does."""

    tokenizer_folder: str
    max_model_len: int
    vocab_size: int
    served_model_name: str
    model_aliases: tuple[str, ...]
    chat: ChatConfig
    limits: ServerLimits
    # Run at this niceness more than the server: on a small machine the engine comes first.
    nice: int = 10
    # A process whose RSS, its heap trimmed, grew by more than this fraction over a job
    # (and by at least 32 MiB) retires after it.
    retire_growth: float = 0.15


@dataclass(frozen=True)
class Answer:
    """The whole answer to the request (status, JSON body). Between the processes the
    body travels as raw bytes after the frame (``body_size`` of them; ``write_reply``)."""

    status: int
    body: bytes
    retire: bool = False
    body_size: int = 0


@dataclass(frozen=True)
class Prepared:
    """The request goes on in the server: with ``body`` (the request's own, made small) in
    place of the one sent, and ``value``, what was prepared from the whole one."""

    body: bytes
    value: Any
    retire: bool = False


Reply = Answer | Prepared


def write_frame(stream: IO[bytes], obj: object) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def read_frame(stream: IO[bytes]) -> Any:
    """The next object, or EOFError once the other side has closed."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    (size,) = _HEADER.unpack(header)
    return pickle.loads(read_exactly(stream, size))


def read_exactly(stream: IO[bytes], size: int) -> bytes:
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return data


def write_job(stream: IO[bytes], job: str, body: bytes | memoryview) -> None:
    """A job and its request body: the body as raw bytes after the frame, never a pickled
    copy (the server hands over a view of a body it kept out of its heap)."""
    write_frame(stream, (job, len(body)))
    stream.write(body)
    stream.flush()


def read_job(stream: IO[bytes]) -> tuple[str, bytes]:
    job, size = read_frame(stream)
    return job, read_exactly(stream, size)


def write_reply(stream: IO[bytes], reply: Reply) -> None:
    """``reply``; an answer's body as raw bytes after the frame (the server reads it into a
    mapping of its own when it is large, body_buffer.py)."""
    if isinstance(reply, Answer):
        body = reply.body
        write_frame(stream, replace(reply, body=b"", body_size=len(body)))
        stream.write(body)
        stream.flush()
    else:
        write_frame(stream, reply)


class _Engine:
    """The part of LLMEngine that requests are prepared with."""

    def __init__(self, spec: WorkerSpec) -> None:
        from tandem.core.llm.input_processor import PromptEncoder
        from tandem.core.llm.tokenizer import Tokenizer

        self.tokenizer = Tokenizer(spec.tokenizer_folder)
        self.max_model_len = spec.max_model_len
        self.model_config = _ModelConfig(spec.vocab_size)
        # Encodes and refuses prompts as the engine's InputProcessor does.
        self.inputs = PromptEncoder(self.tokenizer, spec.max_model_len)


@dataclass(frozen=True)
class _ModelConfig:
    vocab_size: int


class _State:
    """What ServerState gives the preparation code (chat.py, tokenize.py)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.engine = _Engine(spec)
        self.served_model_name = spec.served_model_name
        self.model_aliases = spec.model_aliases
        self.chat = spec.chat
        self.limits = spec.limits


def _json(status: int, content: Any) -> Answer:
    from tandem.server.errors import SafeJSONResponse

    return Answer(status, bytes(SafeJSONResponse(content).body))


def _error(exc: BaseException) -> Answer:
    """The answer the server's error handlers give for ``exc``."""
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    from tandem.core import InvalidRequestError
    from tandem.server.error_body import error_body
    from tandem.server.errors import ApiError, _validation_message

    if isinstance(exc, ValidationError):
        # As FastAPI reports a body's errors: located under "body".
        first = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()[:1]]
        message, param = _validation_message(RequestValidationError(first))
        return _json(400, error_body(400, message, param))
    if isinstance(exc, ApiError):
        return _json(exc.status, error_body(exc.status, exc.message, exc.param, exc.code))
    if isinstance(exc, InvalidRequestError):
        return _json(400, error_body(400, str(exc), exc.param))
    logger.exception("preparing a request failed", exc_info=exc)
    return _json(500, error_body(500, f"Internal server error: {type(exc).__name__}"))


def _tokenize(state: Any, raw: bytes) -> Reply:
    from tandem.server.protocol import TokenizeRequest
    from tandem.server.tokenize import check_tokenize_budget, tokenize

    body = TokenizeRequest.model_validate_json(raw)
    check_tokenize_budget(state, body)
    return _json(200, tokenize(state, body))


def _detokenize(state: Any, raw: bytes) -> Reply:
    from tandem.server.protocol import DetokenizeRequest
    from tandem.server.tokenize import check_tokenize_budget, detokenize

    body = DetokenizeRequest.model_validate_json(raw)
    check_tokenize_budget(state, body)
    return _json(200, detokenize(state, body))


def _completion(state: Any, raw: bytes) -> Reply:
    """The completion request's prompts, tokenized (and their echoes); the body goes on with
    a one-token stand-in for its prompts (completions.py takes them from the request's
    scope)."""
    from tandem.server.completions import check_completion, tokenize_prompts
    from tandem.server.protocol import CompletionRequest

    body = CompletionRequest.model_validate_json(raw)
    prompts = check_completion(state, body)
    prepared = tokenize_prompts(state.engine.inputs, prompts, body.echo)
    slim = json.loads(raw)
    slim["prompt"] = [0]
    return Prepared(json.dumps(slim).encode("ascii"), prepared)


def _chat(state: Any, raw: bytes) -> Reply:
    """The chat request's prompt, rendered and tokenized; the body goes on without its
    messages (chat.py takes the prompt from the request's scope)."""
    from tandem.server.chat import prepare_chat_prompt
    from tandem.server.common import check_request
    from tandem.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate_json(raw)
    check_request(state, body)
    prepared = prepare_chat_prompt(state, body)
    # The body as sent but for its messages (json escapes what it cannot encode).
    slim = json.loads(raw)
    slim["messages"] = [{"role": "user", "content": ""}]
    return Prepared(json.dumps(slim).encode("ascii"), prepared)


_JOBS = {TOKENIZE: _tokenize, DETOKENIZE: _detokenize, CHAT: _chat, COMPLETION: _completion}


def rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def malloc_trim() -> None:
    """glibc's malloc_trim(0): every arena's free pages go back to the system (elsewhere,
    nothing). The server keeps freed memory in its heap otherwise (tandem.device.cpu)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    spec = cast(WorkerSpec, read_frame(stdin))
    state = _State(spec)
    # Every job once, small: what they import and build lazily is in the baseline.
    _JOBS[TOKENIZE](state, b'{"prompt": "warm up"}')
    _JOBS[DETOKENIZE](state, b'{"tokens": [1, 2]}')
    hello = {"model": spec.served_model_name, "messages": [{"role": "user", "content": "hi"}]}
    _JOBS[CHAT](state, json.dumps(hello).encode())
    _JOBS[COMPLETION](state, json.dumps({"model": spec.served_model_name, "prompt": "hi"}).encode())
    gc.collect()
    malloc_trim()
    baseline = rss_mib()
    # Ready: the first job waits no longer for imports and the tokenizer.
    write_frame(stdout, "ready")
    while True:
        try:
            job, raw = read_job(stdin)
        except EOFError:
            return
        started = time.monotonic()
        try:
            reply = _JOBS[job](state, raw)
        except Exception as exc:  # noqa: BLE001 - every failure is an answer
            reply = _error(exc)
        del raw
        gc.collect()
        malloc_trim()
        grown = rss_mib() - baseline
        retire = grown > max(spec.retire_growth * baseline, 32.0)
        if retire:
            logger.info(
                "a preparation process retires: %.0f MiB more than at start after a %.1f s job",
                grown,
                time.monotonic() - started,
            )
        write_reply(stdout, replace(reply, retire=retire))
        if retire:
            return


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # Frames only on stdout: anything printed goes to stderr (the server's log).
    out = sys.stdout.buffer
    sys.stdout = sys.stderr
    serve(sys.stdin.buffer, out)
