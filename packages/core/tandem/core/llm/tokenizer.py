"""The model's own tokenizer (Hugging Face fast tokenizer) and its chat template."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any, cast

from tandem.core.errors import InvalidRequestError, ModelLoadError
from tandem.core.failure_text import client_text
from tandem.core.llm.time_limit import WALL_FACTOR, TimeLimitExceeded, time_limit

logger = logging.getLogger(__name__)


# (model_type, tokenizer_class) pairs that AutoTokenizer resolves to the generic TokenizersBackend
# (test_tokenizer_loading checks it against the installed transformers). Going there directly
# skips importing AutoTokenizer, which scans every model folder of transformers and imports
# torch.distributed's tensor code: 3-4 s of every start-up on a small CPU. Other pairs
# (Qwen2Tokenizer checkpoints, the model types transformers overrides, remote code) go through
# AutoTokenizer.
GENERIC_TOKENIZER_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
GENERIC_TOKENIZER_MODEL_TYPES = frozenset({"llama", "qwen3", "qwen3_moe"})


def loads_directly(folder: Path) -> bool:
    """Whether ``folder``'s tokenizer is one AutoTokenizer would load as TokenizersBackend."""
    try:
        declared = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        model = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(declared, dict) or not isinstance(model, dict) or "auto_map" in declared:
        return False
    return (
        declared.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES
        and model.get("model_type") in GENERIC_TOKENIZER_MODEL_TYPES
    )


def _load(folder: Path) -> Any:
    # Imported here: transformers is slow to import and only the engine needs it.
    if loads_directly(folder):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(folder), local_files_only=True)
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception:  # noqa: BLE001 - fall back to the bare tokenizer.json
        logger.info("AutoTokenizer could not read %s; using tokenizer.json directly", folder)
        return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))  # type: ignore[no-untyped-call]


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise ModelLoadError(
                f"{folder} has no tokenizer.json; Tandem needs a fast (tokenizer.json) tokenizer"
            )
        tok = _load(folder)
        template = folder / "chat_template.jinja"
        if getattr(tok, "chat_template", None) is None and template.is_file():
            tok.chat_template = template.read_text(encoding="utf-8")
        # Context limits are the engine's business; silence the tokenizer's own warning.
        tok.model_max_length = 1 << 62
        self._tok = tok
        # The Rust tokenizer refuses concurrent use ("Already borrowed") when one call changes
        # its padding/truncation state; requests encode on server threads while the engine
        # loop decodes.
        self._lock = threading.Lock()
        self._special_ids = frozenset(int(i) for i in tok.all_special_ids)
        # Detokenization runs per token per request on the engine loop: go straight to the
        # Rust tokenizer when transformers would only pass the call through.
        backend = getattr(tok, "backend_tokenizer", None)
        cleanup = bool(getattr(tok, "clean_up_tokenization_spaces", False))
        self._fast_decode = None if cleanup or backend is None else backend.decode
        # The longest vocabulary entry in UTF-8 bytes bounds how much text one token covers:
        # a text of more than max_token_bytes * N bytes has more than N tokens.
        self.max_token_bytes = max((len(t.encode("utf-8")) for t in tok.get_vocab()), default=1)
        self._byte_level = backend is not None and _is_byte_level(backend.to_str())

    @property
    def backend(self) -> Any:
        """The Hugging Face tokenizer itself, for libraries that read its vocabulary."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eos_token_id(self) -> int | None:
        value = self._tok.eos_token_id
        return int(value) if value is not None else None

    @property
    def bos_token_id(self) -> int | None:
        value = self._tok.bos_token_id
        return int(value) if value is not None else None

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._lock:
            ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        with self._lock:
            if self._fast_decode is not None:
                return cast(str, self._fast_decode(ids, skip_special_tokens=skip_special_tokens))
            return cast(str, self._tok.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens included), as logprobs report it. A token
        holding part of a multi-byte character has no text of its own; its vocabulary entry
        stands in, so distinct tokens never share a name."""
        text = self.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            with self._lock:
                return str(self._tok.convert_ids_to_tokens(token_id))
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (part of a character, for some), as logprobs'
        ``bytes`` report them."""
        with self._lock:
            piece = str(self._tok.convert_ids_to_tokens(token_id))
        byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        decoder = _byte_decoder()
        if self._byte_level and all(c in decoder for c in piece):
            return bytes(decoder[c] for c in piece)
        # SentencePiece marks a leading space with U+2581.
        return piece.replace("\u2581", " ").encode("utf-8")

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        time_limit_s: float | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text of ``messages``, rendered by ``chat_template`` (the server's
        --chat-template, or a trusted request's) or else the model's own; InvalidRequestError
        if the template fails or runs longer than ``time_limit_s`` of CPU time, or a wall-clock
        backstop several times that (time_limit.py; it is stopped then)."""
        if chat_template is None and not self.has_chat_template:
            raise InvalidRequestError(
                "this model has no chat template: start the server with --chat-template FILE, "
                "or send a plain prompt to /v1/completions",
                param="messages",
            )
        try:
            # Rendering touches Jinja only, not the Rust tokenizer the lock guards.
            with time_limit(time_limit_s) if time_limit_s is not None else _no_limit():
                text = self._tok.apply_chat_template(
                    messages,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    chat_template=chat_template,
                    **template_kwargs,
                )
        except TimeLimitExceeded as exc:
            assert time_limit_s is not None
            raise InvalidRequestError(
                f"the chat template {exc} and was stopped (its limit: {time_limit_s:g} s of "
                f"CPU time, {WALL_FACTOR * time_limit_s:g} s on the clock)",
                param="messages",
            ) from None
        except Exception as exc:  # noqa: BLE001 - a template error is the caller's input
            raise InvalidRequestError(
                f"the chat template failed: {client_text(str(exc))}", param="messages"
            ) from None
        return str(text)


@contextlib.contextmanager
def _no_limit() -> Iterator[None]:
    yield


def _is_byte_level(tokenizer_json: str) -> bool:
    """Whether the tokenizer's decoder maps bytes to characters the GPT-2 way."""
    decoder = json.loads(tokenizer_json).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(isinstance(p, dict) and p.get("type") == "ByteLevel" for p in parts)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-character table, inverted: printable bytes stand for themselves, the
    others for the characters from U+0100 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}
