"""Per-request budgets, refused up front with a 400 that names the limit and its flag: how
many sequences a request asks for, how many chat messages it brings, how many tokens a
/tokenize may produce (its size checked before it is tokenized, its tokens after, or a
prefix's tokens for a large text)."""

from __future__ import annotations

from tandem.core.llm.input_processor import TokenBudget
from tandem.server.errors import ApiError
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from tandem.server.state import DEFAULT_TOKENIZE_TOKENS, ServerLimits, ServerState


def prompt_count(body: CompletionRequest) -> int:
    """How many prompts ``body.prompt`` holds (a string or one list of ids is one)."""
    prompt = body.prompt
    if isinstance(prompt, str) or not prompt or all(isinstance(p, int) for p in prompt):
        return 1
    return len(prompt)


def check_budget(limits: ServerLimits, body: _SamplingFields) -> None:
    """The sequences (prompts x n) and messages of a completion or chat request."""
    if isinstance(body, ChatCompletionRequest):
        check_messages(limits, len(body.messages))
    prompts = prompt_count(body) if isinstance(body, CompletionRequest) else 1
    sequences = prompts * body.n
    limit = limits.max_sequences_per_request
    if sequences > limit:
        asked = f"{prompts} prompts x n={body.n}" if prompts > 1 else f"n={body.n}"
        raise ApiError(
            400,
            f"This request asks for {sequences} sequences ({asked}), more than this server's "
            f"limit of {limit} per request (--max-sequences-per-request); send fewer prompts "
            "or a smaller n.",
            param="prompt" if prompts > 1 else "n",
        )


def check_messages(limits: ServerLimits, count: int) -> None:
    limit = limits.max_chat_messages
    if count > limit:
        raise ApiError(
            400,
            f"This request brings {count} messages, more than this server's limit of {limit} "
            "(--max-chat-messages).",
            param="messages",
        )


def tokenize_limit(state: ServerState) -> int:
    limit = state.limits.max_tokenize_tokens
    if limit is None:
        return max(DEFAULT_TOKENIZE_TOKENS, state.engine.max_model_len)
    return limit


def _too_many_tokens(state: ServerState, what: str, param: str) -> ApiError:
    return ApiError(
        400,
        f"The {param} is {what}, more than this server's limit of {tokenize_limit(state)} "
        "tokens per request (--max-tokenize-tokens).",
        param=param,
    )


def check_tokenize_size(state: ServerState, text: str, param: str) -> None:
    """Before tokenizing: a text whose size alone says it has more tokens than the limit
    (no token is longer than the tokenizer's longest; normalization may shrink a text at
    most ~3x, hence the slack) is refused without the work."""
    bound = 4 * state.engine.tokenizer.max_token_bytes * tokenize_limit(state)
    # Each character is at most 4 bytes: most texts need no encoding to pass.
    if 4 * len(text) <= bound:
        return
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > bound:
        raise _too_many_tokens(state, f"{size} bytes long, so more tokens", param)


def tokenize_budget(state: ServerState, param: str) -> TokenBudget:
    """The token budget a /tokenize text is encoded within: one far over it is refused by a
    prefix's tokens, not tokenized whole."""
    return TokenBudget(tokenize_limit(state), lambda what: _too_many_tokens(state, what, param))


def check_token_count(state: ServerState, count: int, param: str) -> None:
    if count > tokenize_limit(state):
        raise _too_many_tokens(state, f"{count} tokens", param)
