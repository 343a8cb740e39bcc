"""POST /tokenize and /detokenize, as vLLM serves them: what the model reads for a prompt or
for chat messages (through the chat template), and the text of token ids."""

from __future__ import annotations

from typing import Any

from tandem.server.budgets import (
    check_messages,
    check_token_count,
    check_tokenize_size,
    tokenize_budget,
)
from tandem.server.chat import render_chat
from tandem.server.chat_messages import template_messages
from tandem.server.common import check_model
from tandem.server.errors import ApiError
from tandem.server.protocol import DetokenizeRequest, TokenizeRequest
from tandem.server.state import ServerState


def tokenize(state: ServerState, body: TokenizeRequest) -> dict[str, Any]:
    """(Runs on the preparer's threads: templates and long prompts take time.)"""
    if body.model is not None:
        check_model(state.served_model_name, body.model, state.model_aliases)
    tokenizer = state.engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "Send either prompt or messages.", param="prompt")
    if body.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        prompt = render_chat(
            state,
            template_messages(body.messages),
            body.add_generation_prompt,
            body.chat_template_kwargs or {},
            tools,
        )
        check_tokenize_size(state, prompt.text, "messages")
        # The template writes the special tokens; add none unless asked.
        add = bool(body.add_special_tokens)
        tokens = state.engine.inputs.encode_prompt(
            prompt.text,
            "messages",
            add,
            check_length=False,
            budget=tokenize_budget(state, "messages"),
        )
    else:
        assert body.prompt is not None
        add = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = state.engine.inputs.encode_prompt(
            body.prompt, "prompt", add, check_length=False, budget=tokenize_budget(state, "prompt")
        )
    check_token_count(state, len(tokens), "prompt" if body.messages is None else "messages")
    return {
        "count": len(tokens),
        "max_model_len": state.engine.max_model_len,
        "tokens": tokens,
        "token_strs": [tokenizer.token_text(t) for t in tokens] if body.return_token_strs else None,
    }


def check_tokenize_budget(state: ServerState, body: TokenizeRequest | DetokenizeRequest) -> None:
    """What can be refused before any work (on the event loop: cheap): too many messages,
    a prompt too large for the token limit by its size alone, too many token ids."""
    if isinstance(body, DetokenizeRequest):
        check_token_count(state, len(body.tokens), "tokens")
        return
    if body.messages is not None:
        check_messages(state.limits, len(body.messages))
    if body.prompt is not None:
        check_tokenize_size(state, body.prompt, "prompt")


def detokenize(state: ServerState, body: DetokenizeRequest) -> dict[str, Any]:
    if body.model is not None:
        check_model(state.served_model_name, body.model, state.model_aliases)
    vocab = state.engine.model_config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"tokens must be ids in [0, {vocab}); got {bad[:5]}.", param="tokens")
    return {"prompt": state.engine.tokenizer.decode(body.tokens)}
