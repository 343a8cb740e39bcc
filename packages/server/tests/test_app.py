"""The app in-process (real FastAPI over a real engine), for cases a subprocess can't set up."""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from tandem.core import CacheConfig, EngineConfig, EngineLoop, LLMEngine, ModelLoadConfig
from tandem.core.demo.demo_model import tiny_spec, write_demo_model
from tandem.core.demo.pretrained import stories260k_folder
from tandem.server.app import create_app
from tandem.server.metrics import ServerMetrics
from tandem.server.state import ChatConfig, ServerState

SPEC = replace(tiny_spec(), num_layers=1, vocab_size=300, max_position_embeddings=128)


@pytest.fixture(scope="module")
def no_template_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_demo_model(tmp_path_factory.mktemp("m"), SPEC)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _call(
    folder: Path, method: str, path: str, body: object, chat: ChatConfig | None = None
) -> httpx.Response:
    engine = LLMEngine(
        EngineConfig(model=ModelLoadConfig(model=str(folder)), cache=CacheConfig(num_blocks=32))
    )
    metrics = ServerMetrics(engine, "m")
    loop = EngineLoop(engine, on_finished=metrics.observe_finished)
    state = ServerState(loop=loop, served_model_name="m", metrics=metrics)
    if chat is not None:
        state.chat = chat
    app = create_app(state)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            return await client.request(method, path, json=body)

    try:
        return asyncio.run(go())
    finally:
        loop.stop()


def test_chat_without_a_template_is_a_clear_400(no_template_model: Path) -> None:
    response = _call(
        no_template_model,
        "POST",
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert "no chat template" in error["message"] and error["param"] == "messages"


def test_completions_still_work_without_a_template(no_template_model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "copy"
    shutil.copytree(no_template_model, folder)
    response = _call(
        folder, "POST", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 3}
    )
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 3


def test_chat_template_flag_gives_a_model_without_one_chat() -> None:
    template = Path(__file__).resolve().parents[3] / "docs" / "chat_templates" / "story.jinja"
    response = _call(
        stories260k_folder(),
        "POST",
        "/v1/chat/completions",
        {
            "model": "m",
            "messages": [{"role": "user", "content": "Once upon a time"}],
            "max_tokens": 12,
            "temperature": 0,
        },
        chat=ChatConfig(chat_template=template.read_text()),
    )
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["message"]["content"]
    assert text.startswith(", there was a little girl named Lily.")
