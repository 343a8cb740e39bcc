"""The model's own tokenizer (Hugging Face fast tokenizer) and its chat template."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any, cast

from tandem.core.errors import InvalidRequestError, ModelLoadError

logger = logging.getLogger(__name__)


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise ModelLoadError(
                f"{folder} has no tokenizer.json; Tandem needs a fast (tokenizer.json) tokenizer"
            )
        # Imported here: transformers is slow to import and only the engine needs it.
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        try:
            tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception:  # noqa: BLE001 - fall back to the bare tokenizer.json
            logger.info("AutoTokenizer could not read %s; using tokenizer.json directly", folder)
            tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))  # type: ignore[no-untyped-call]
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

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text of ``messages``, rendered by ``chat_template`` (the server's
        --chat-template) or else the model's own."""
        if chat_template is None and not self.has_chat_template:
            raise InvalidRequestError(
                "this model has no chat template: start the server with --chat-template FILE, "
                "or send a plain prompt to /v1/completions",
                param="messages",
            )
        try:
            with self._lock:
                text = self._tok.apply_chat_template(
                    messages,
                    tokenize=False,
                    add_generation_prompt=add_generation_prompt,
                    chat_template=chat_template,
                    **template_kwargs,
                )
        except Exception as exc:  # noqa: BLE001 - a template error is the caller's input
            raise InvalidRequestError(
                f"the chat template failed: {exc}", param="messages"
            ) from None
        return str(text)
