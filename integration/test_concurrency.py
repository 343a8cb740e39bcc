"""48 concurrent streams all succeed, and afterwards every KV block is free again."""

from __future__ import annotations

import asyncio

from harness import MODEL_NAME, Server, async_openai_client


def test_48_concurrent_streams(server: Server) -> None:
    client = async_openai_client(server.base_url)

    async def one(i: int) -> tuple[str, int, str | None]:
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=f"request {i}: the model reads",
            max_tokens=24,
            temperature=0.8,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, tokens, reason = "", 0, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return text, tokens, reason

    async def main() -> list[tuple[str, int, str | None]]:
        try:
            return await asyncio.gather(*(one(i) for i in range(48)))
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == 48
    assert all(tokens == 24 and reason == "length" for _, tokens, reason in results)
    server.wait_idle()
    assert server.metric("tandem:kv_cache_usage_perc") == 0
