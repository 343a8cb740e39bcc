"""The direct tokenizer load gives exactly what AutoTokenizer gives, for every pair it takes."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest

from tandem.core.demo.pretrained import stories260k_folder
from tandem.core.llm.tokenizer import (
    GENERIC_TOKENIZER_CLASSES,
    GENERIC_TOKENIZER_MODEL_TYPES,
    Tokenizer,
    loads_directly,
)

TEXTS = [
    "Once upon a time, there was a little girl named Lily.",
    "naïve café → 日本の数据模型 😀 Ω≤λ",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "<|im_start|>user\nhi<|im_end|>",
    "",
]


def _with(folder: Path, target: Path, model_type: str, tokenizer_class: str) -> Path:
    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    config["model_type"] = model_type
    (target / "config.json").write_text(json.dumps(config))
    declared = json.loads((target / "tokenizer_config.json").read_text())
    declared["tokenizer_class"] = tokenizer_class
    (target / "tokenizer_config.json").write_text(json.dumps(declared))
    return target


def _same_as_auto(folder: Path) -> None:
    from transformers import AutoTokenizer

    ours = Tokenizer(folder).backend
    reference = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert type(ours) is type(reference)
    assert ours.all_special_ids == reference.all_special_ids
    assert ours.bos_token_id == reference.bos_token_id
    assert ours.eos_token_id == reference.eos_token_id
    assert ours.chat_template == reference.chat_template
    assert ours.get_vocab() == reference.get_vocab()
    for text in TEXTS:
        ids = ours(text).input_ids
        assert ids == reference(text).input_ids
        assert ours.decode(ids) == reference.decode(ids)


@pytest.mark.parametrize(
    ("model_type", "tokenizer_class"),
    sorted(itertools.product(GENERIC_TOKENIZER_MODEL_TYPES, GENERIC_TOKENIZER_CLASSES)),
)
def test_direct_load_equals_auto_tokenizer(
    demo_dir: Path, tmp_path: Path, model_type: str, tokenizer_class: str
) -> None:
    folder = _with(demo_dir, tmp_path / "m", model_type, tokenizer_class)
    assert loads_directly(folder)
    _same_as_auto(folder)


def test_the_pretrained_llama_loads_directly_and_equals_auto_tokenizer() -> None:
    folder = stories260k_folder()
    assert loads_directly(folder)
    _same_as_auto(folder)


@pytest.mark.parametrize(
    ("model_type", "tokenizer_class", "auto_map"),
    [
        ("qwen3", "Qwen2Tokenizer", False),  # a model-specific class: AutoTokenizer's business
        ("qwen3_5", "PreTrainedTokenizerFast", False),  # transformers overrides this type's class
        ("qwen3", "PreTrainedTokenizerFast", True),  # remote code
    ],
)
def test_other_tokenizers_go_through_auto_tokenizer(
    demo_dir: Path, tmp_path: Path, model_type: str, tokenizer_class: str, auto_map: bool
) -> None:
    folder = _with(demo_dir, tmp_path / "m", model_type, tokenizer_class)
    if auto_map:
        declared = json.loads((folder / "tokenizer_config.json").read_text())
        declared["auto_map"] = {"AutoTokenizer": [None, "tokenization_x.XTokenizer"]}
        (folder / "tokenizer_config.json").write_text(json.dumps(declared))
    assert not loads_directly(folder)
    if not auto_map:  # the remote-code folder has no code to run
        _same_as_auto(folder)
