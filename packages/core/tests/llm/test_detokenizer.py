"""Incremental detokenization never emits half a character; stop strings never leak."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tandem.core import LLMEngine, SamplingParams
from tandem.core.llm.detokenizer import IncrementalDetokenizer
from tandem.core.llm.tokenizer import Tokenizer

TEXT = "naïve café → 日本の数据模型 😀😀 Ω≤λ, done."


def test_streamed_text_is_whole_characters_and_complete(demo_dir: Path) -> None:
    tok = Tokenizer(demo_dir)
    ids = tok.encode(TEXT)
    # Byte-level BPE splits several of these characters across tokens.
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)
    prompt = tok.encode("hello")
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT


def test_stories_style_spaces_survive_streaming(demo_dir: Path) -> None:
    tok = Tokenizer(demo_dir)
    ids = tok.encode(" the model reads the prompt")
    detok = IncrementalDetokenizer(tok, tok.encode("start"))
    assert "".join(detok.add(i) for i in ids) + detok.flush() == " the model reads the prompt"


def test_stop_strings_are_not_emitted_even_in_part(
    demo_dir: Path, make_engine: Callable[..., LLMEngine]
) -> None:
    engine = make_engine(demo_dir)
    # Find what greedy decoding says, then stop on a piece from its middle.
    [free] = engine.generate(["hello world"], SamplingParams.greedy(max_tokens=16))
    assert len(free.text) > 6
    stop = free.text[3:6]
    params = SamplingParams.greedy(max_tokens=16, stop=[stop, "never-there"])
    engine.add_request("s", "hello world", params)
    streamed = ""
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            streamed += out.delta_text
            assert stop not in streamed
            final = out
    assert final is not None and final.finished
    assert final.finish_reason == "stop" and final.stop_reason == stop
    expected = free.text[: free.text.index(stop)]
    assert final.text == expected == streamed


def test_stop_token_ids(demo_dir: Path, make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(demo_dir)
    [free] = engine.generate(["hello world"], SamplingParams.greedy(max_tokens=8))
    target = free.token_ids[2]
    params = SamplingParams.greedy(max_tokens=8, stop_token_ids=[target])
    [out] = engine.generate(["hello world"], params)
    assert out.finish_reason == "stop" and out.stop_reason == target
    assert out.token_ids == free.token_ids[: free.token_ids.index(target) + 1]


def test_eos_stops_unless_ignored(demo_dir: Path, make_engine: Callable[..., LLMEngine]) -> None:
    engine = make_engine(demo_dir)
    [free] = engine.generate(["hello world"], SamplingParams.greedy(max_tokens=8))
    # Declare the third generated token an end-of-sequence token for this engine.
    eos = free.token_ids[2]
    engine.inputs.eos_token_ids = frozenset({eos})
    [out] = engine.generate(["hello world"], SamplingParams.greedy(max_tokens=8))
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] == eos and len(out.token_ids) <= 3
    [ignored] = engine.generate(
        ["hello world"], SamplingParams.greedy(max_tokens=8, ignore_eos=True)
    )
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_chat_template_from_jinja_file_and_missing_template(demo_dir: Path, tmp_path: Path) -> None:
    import json
    import shutil

    import pytest

    from tandem.core import InvalidRequestError

    folder = tmp_path / "m"
    shutil.copytree(demo_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = config.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(InvalidRequestError, match="no chat template"):
        Tokenizer(folder).apply_chat_template([{"role": "user", "content": "hi"}])
    (folder / "chat_template.jinja").write_text(template)
    text = Tokenizer(folder).apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_fast_decode_equals_transformers_decode(demo_dir: Path) -> None:
    import random

    from transformers import AutoTokenizer

    from tandem.core.demo.pretrained import stories260k_folder

    folders = [demo_dir, stories260k_folder()]
    rng = random.Random(0)
    for folder in folders:
        ours = Tokenizer(folder)
        reference = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        for _ in range(50):
            ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 12))]
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(
                    ids, skip_special_tokens=skip
                )
