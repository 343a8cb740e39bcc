"""What a new user gets from `tox -e serve`: the bundled stories260k, served by a command line
written for vLLM, writes real English (the model's reference tokens, through the HTTP API)."""

from __future__ import annotations

import httpx
import pytest
from harness import Server, ServerFactory, openai_client

# From the model's README: greedy from BOS is "Once upon a time, there was a little girl
# named Lily. ..."; "Once upon a time" is its first 5 tokens, so these follow.
# fmt: off
AFTER_ONCE_UPON_A_TIME = [432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396,
                          267, 337, 410, 408, 419, 292, 411, 322, 265, 282, 295]
# fmt: on


@pytest.fixture(scope="module")
def stories(start_server: ServerFactory) -> Server:
    # vLLM's own flag names throughout, and no model: the bundled one.
    return start_server(
        "--served-model-name",
        "stories260k",
        "tinystories",
        "--max-num-seqs",
        "8",
        "--max-num-batched-tokens",
        "256",
        "--max-model-len",
        "256",
        "--gpu-memory-utilization",
        "0.5",
        "--enable-prefix-caching",
        "--seed",
        "0",
        "--trust-remote-code",
        "--disable-log-requests",
        demo_model=False,
    )


def test_once_upon_a_time(stories: Server) -> None:
    client = openai_client(stories.base_url)
    assert [m.id for m in client.models.list().data] == ["stories260k", "tinystories"]
    response = client.completions.create(
        model="tinystories",
        prompt="Once upon a time",
        max_tokens=len(AFTER_ONCE_UPON_A_TIME),
        temperature=0,
        logprobs=0,
        extra_body={"return_tokens_as_token_ids": True},
    )
    assert response.model == "stories260k"
    choice = response.choices[0]
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    assert [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens] == (
        AFTER_ONCE_UPON_A_TIME
    )
    assert choice.text.startswith(", there was a little girl named Lily. She loved to play")


def test_chat_needs_a_template(stories: Server) -> None:
    response = httpx.post(
        f"{stories.base_url}/v1/chat/completions",
        json={"model": "stories260k", "messages": [{"role": "user", "content": "Hi"}]},
        timeout=30,
    )
    assert response.status_code == 400
    assert "--chat-template" in response.json()["error"]["message"]
