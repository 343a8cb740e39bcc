"""Drive the benchmark: warm-ups, Poisson or burst arrivals under a concurrency cap; in a
multi-turn run, of conversations whose turns go one after another."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from tqdm import tqdm

from tandem.server.bench.client import RequestResult, send_completion
from tandem.server.bench.dataset import BenchRequest, next_turn, random_requests, split_warmups
from tandem.server.bench.report import summarize
from tandem.server.bench.server_metrics import cache_figures, fetch_cache_counters

T = TypeVar("T")


def run_on_fast_loop(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` on uvloop where it is installed (the server depends on it; not on
    Windows), else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    model: str | None
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float
    max_concurrency: int | None
    request_rate: float
    ignore_eos: bool
    num_warmups: int
    seed: int
    api_key: str | None
    vocab_size: int | None
    # Each prompt one random segment repeated this many times (1: all random).
    prompt_repeats: int = 1
    # Tokens of one fixed random prefix every measured prompt opens with (0: none).
    shared_prefix_len: int = 0
    # Turns of each conversation: num_prompts conversations of this many requests (1: each
    # request alone). Conversations, not requests, arrive and count against the cap.
    turns: int = 1


async def _model_card(session: aiohttp.ClientSession, config: BenchConfig) -> dict[str, Any]:
    url = f"{config.base_url}/v1/models"
    async with session.get(url, headers=_headers(config), raise_for_status=True) as response:
        cards: list[dict[str, Any]] = (await response.json())["data"]
    if config.model is None:
        return cards[0]
    for card in cards:
        if card["id"] == config.model:
            return card
    raise ValueError(f"the server does not serve {config.model!r}")


def _headers(config: BenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


async def run_benchmark(config: BenchConfig) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=(config.max_concurrency or config.num_prompts) + 8)
    # No total limit: a long generation may stream for minutes; a silent socket may not.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, sock_read=600.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        card = await _model_card(session, config)
        vocab = config.vocab_size or int(card.get("vocab_size") or 0)
        if vocab <= 16:
            raise ValueError("the server does not report vocab_size; pass --vocab-size")
        requests = random_requests(
            config.num_prompts + config.num_warmups,
            config.input_len,
            config.output_len,
            config.range_ratio,
            vocab,
            config.seed,
            repeats=config.prompt_repeats,
        )
        warmups, measured = split_warmups(
            requests,
            config.num_warmups,
            shared_prefix_len=config.shared_prefix_len,
            vocab_size=vocab,
            seed=config.seed,
        )
        url = f"{config.base_url}/v1/completions"
        headers = _headers(config)
        limit = asyncio.Semaphore(config.max_concurrency or len(requests) or 1)

        async def one(request: BenchRequest, bar: tqdm[Any] | None) -> RequestResult:
            async with limit:
                result = await send_completion(
                    session, url, card["id"], request, config.ignore_eos, headers
                )
            if bar is not None:
                bar.update(1)
            return result

        async def conversation(
            index: int, first: BenchRequest, bar: tqdm[Any]
        ) -> list[RequestResult]:
            # A stream per conversation: its turns are the same whatever order they run in.
            turn_rng = random.Random(f"turns-{config.seed}-{index}")
            results: list[RequestResult] = []
            request = first
            async with limit:
                for turn in range(1, config.turns + 1):
                    result = await send_completion(
                        session,
                        url,
                        card["id"],
                        request,
                        config.ignore_eos,
                        headers,
                        token_ids=True,
                    )
                    result.turn = turn
                    results.append(result)
                    bar.update(1)
                    if turn == config.turns:
                        break
                    if result.output_token_ids is None:
                        results += _unsent_turns(result, turn, config.turns)
                        bar.update(config.turns - turn)
                        break
                    request = next_turn(
                        request,
                        result.output_token_ids,
                        turn_rng,
                        config.input_len,
                        config.output_len,
                        config.range_ratio,
                        vocab,
                        repeats=config.prompt_repeats,
                    )
            return results

        # Warm-ups are single requests even in a multi-turn run: they are there to take
        # the server's first-call costs, which a first turn's shape already meets.
        if warmups:
            await asyncio.gather(*(one(r, None) for r in warmups))
        # After the warm-ups: the run's counts are the measured requests' alone.
        counters_before = await fetch_cache_counters(session, config.base_url, headers)
        rng = random.Random(config.seed)
        bar = tqdm(total=len(measured) * config.turns, desc="requests", unit="req")
        start = time.perf_counter()
        tasks: list[asyncio.Task[list[RequestResult]]] = []
        for index, request in enumerate(measured):
            if config.turns == 1:
                tasks.append(asyncio.create_task(_alone(one(request, bar))))
            else:
                tasks.append(asyncio.create_task(conversation(index, request, bar)))
            if config.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(config.request_rate))
        results = [result for turns in await asyncio.gather(*tasks) for result in turns]
        duration = time.perf_counter() - start
        bar.close()
        counters_after = await fetch_cache_counters(session, config.base_url, headers)
    figures = summarize(results, duration)
    figures |= cache_figures(counters_before, counters_after)
    figures |= {
        "model": card["id"],
        "base_url": config.base_url,
        "max_concurrency": config.max_concurrency,
        "request_rate": config.request_rate,
        "input_len": config.input_len,
        "output_len": config.output_len,
        "shared_prefix_len": config.shared_prefix_len,
        "turns": config.turns,
    }
    return figures


async def _alone(request: Coroutine[Any, Any, RequestResult]) -> list[RequestResult]:
    return [await request]


def _unsent_turns(answered: RequestResult, turn: int, turns: int) -> list[RequestResult]:
    """Failed results for the turns after ``turn``, which could not be built: without the
    tokens the server generated, a later prompt would not be the conversation's."""
    if answered.success:
        why = (
            f"turn {turn} came back without its generated token ids (sent "
            f"return_tokens_as_token_ids with logprobs; the server did not name every "
            f"token token_id:N)"
        )
    else:
        why = f"turn {turn} failed"
    error = f"{why}; the conversation's remaining turns were not sent"
    return [RequestResult(error=error, turn=later) for later in range(turn + 1, turns + 1)]
