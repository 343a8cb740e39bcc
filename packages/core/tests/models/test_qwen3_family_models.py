"""Qwen3.5, Qwen3.5-MoE (both also as the text part of ``*ForConditionalGeneration``) and
Qwen3-MoE against transformers on random tiny checkpoints written by ``save_pretrained``, in
float32: logits of a whole prompt, and greedy decoding of several prompts of different lengths
batched together with their prompts prefilled in small chunks, then tensor parallelism over two
in-process ranks against one.

The models are driven directly, as the engine will drive them: a small driver below hands out
KV blocks and state slots and builds each step's metadata (decodes first, then prefill chunks).

Greedy tokens must equal transformers' ``generate``. The one divergence allowed is at a near-tie
of transformers' top two logits (within ``NEAR_TIE``), where float rounding legitimately decides;
the test stops comparing that prompt there, and only there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tandem.collectives import ProcessGroup, SingleRankGroup, create_inprocess_groups
from tandem.core import LLMEngine, SamplingParams
from tandem.core.layers.attention import AttentionGroup, AttentionMetadata
from tandem.core.layers.linear_attention_state import allocate_linear_attention_state
from tandem.core.models.loader import load_causal_lm
from tandem.core.models.model_config import ModelConfig
from tandem.core.models.qwen3_5 import Qwen3_5ForCausalLM
from tandem.core.models.qwen3_family_config import Qwen3FamilyConfig
from tandem.core.models.registry import CausalLM

NEW_TOKENS = 48
NEAR_TIE = 1e-3
LOGITS_TOLERANCE = 1e-4
PROMPTS = [
    [5, 17, 200, 42, 9, 100, 7],
    [3, 9, 27, 81, 243, 11, 33, 99, 41, 2, 6, 18, 54, 162, 230, 178, 22, 66, 198, 82, 246, 226],
    list(range(10, 250, 6)),  # 40 tokens
]
CHUNKS = [3, 5, 16]  # prefill chunk length of each prompt

_TEXT = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "initializer_range": 0.2,
    "tie_word_embeddings": False,
}
_LINEAR = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
_VISION = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 4,
    "temporal_patch_size": 1,
    "num_position_embeddings": 16,
}

L, F = "linear_attention", "full_attention"
# name: (architecture, text config, composite, save fused experts)
CASES: dict[str, tuple[str, dict[str, Any], bool, bool]] = {
    # Default mix (every 4th layer full), GQA 4/2, tied embeddings.
    "qwen3_5-default-mix-tied": (
        "Qwen3_5ForCausalLM",
        {**_TEXT, **_LINEAR, "num_hidden_layers": 4, "intermediate_size": 96,
         "tie_word_embeddings": True},
        False,
        False,
    ),
    # Full attention first, attention biases, one KV head, three value heads per key head.
    "qwen3_5-full-first-bias-mqa": (
        "Qwen3_5ForCausalLM",
        {**_TEXT, **_LINEAR, "layer_types": [F, L, L], "num_hidden_layers": 3,
         "intermediate_size": 96, "attention_bias": True, "num_key_value_heads": 1,
         "linear_num_value_heads": 6, "partial_rotary_factor": 0.5},
        False,
        False,
    ),
    # The text model of the composite checkpoint; vision weights skipped.
    "qwen3_5-conditional-generation": (
        "Qwen3_5ForConditionalGeneration",
        {**_TEXT, **_LINEAR, "layer_types": [L, F], "num_hidden_layers": 2,
         "intermediate_size": 96},
        True,
        False,
    ),
    # Top-2 of 8 experts and a shared expert, per-expert checkpoint names.
    "qwen3_5_moe": (
        "Qwen3_5MoeForCausalLM",
        {**_TEXT, **_LINEAR, **_MOE, "layer_types": [L, F, L], "num_hidden_layers": 3,
         "shared_expert_intermediate_size": 48},
        False,
        False,
    ),
    # The composite MoE checkpoint with fused expert tensors (as Qwen3.5-MoE releases).
    "qwen3_5_moe-conditional-generation-fused": (
        "Qwen3_5MoeForConditionalGeneration",
        {**_TEXT, **_LINEAR, **_MOE, "layer_types": [F, L], "num_hidden_layers": 2,
         "shared_expert_intermediate_size": 48},
        True,
        True,
    ),
    # No shared expert; a dense layer among sparse ones, unnormalised top-k.
    "qwen3_moe-mlp-only-layer": (
        "Qwen3MoeForCausalLM",
        {**_TEXT, **_MOE, "num_hidden_layers": 3, "intermediate_size": 96, "head_dim": 16,
         "mlp_only_layers": [1]},
        False,
        False,
    ),
    # Every second layer sparse, normalised top-k, one KV head.
    "qwen3_moe-sparse-step-2": (
        "Qwen3MoeForCausalLM",
        {**_TEXT, **_MOE, "num_hidden_layers": 4, "intermediate_size": 96, "head_dim": 16,
         "decoder_sparse_step": 2, "norm_topk_prob": True, "num_key_value_heads": 1},
        False,
        False,
    ),
}  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread() -> Iterator[None]:
    """These tensors are tiny: on a busy machine waking a second OpenMP thread costs more than
    the work (a depthwise conv1d of 4 steps: 25 ms with two threads, 0.2 ms with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _write_reference(folder: Path, case: str) -> Any:
    """Save a random transformers model of ``case`` (safetensors) into ``folder``."""
    architecture, text, composite, fused = CASES[case]
    torch.manual_seed(0)
    if composite:
        config_cls = getattr(
            transformers, architecture.replace("ForConditionalGeneration", "Config")
        )
        config = config_cls(text_config=text, vision_config=_VISION)
    elif architecture == "Qwen3MoeForCausalLM":
        config = transformers.Qwen3MoeConfig(**text)
    else:
        config = getattr(transformers, architecture.replace("ForCausalLM", "TextConfig"))(**text)
    model = getattr(transformers, architecture)(config).eval()
    with torch.no_grad():
        # transformers starts norms at one (or zero for zero-centred ones) and dt_bias at one:
        # move them, so that a wrong offset or a missed weight shows.
        for name, param in model.named_parameters():
            if param.ndim == 1 and "visual" not in name:
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(folder, save_original_format=not fused)
    return model


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    built: dict[str, tuple[Path, Any]] = {}

    def get(case: str) -> tuple[Path, Any]:
        if case not in built:
            folder = tmp_path_factory.mktemp(case)
            built[case] = (folder, _write_reference(folder, case))
        return built[case]

    return get


def _load(folder: Path, group: ProcessGroup) -> CausalLM:
    config = ModelConfig.from_folder(folder)
    assert isinstance(config, Qwen3FamilyConfig)
    return load_causal_lm(folder, config, group, torch.float32, torch.device("cpu"))


@dataclass
class _Sequence:
    slot: int
    blocks: list[int] = field(default_factory=list)
    length: int = 0


class StepDriver:
    """Runs steps on a model the way the engine will: KV blocks handed out in order, one state
    slot per sequence, metadata for decodes first then prefill chunks. Deliberately simple."""

    def __init__(self, model: CausalLM, block_size: int = 4, num_blocks: int = 256) -> None:
        self.model = model
        self.block_size = block_size
        for layer in model.attention_layers():
            shape = (num_blocks + 1, block_size, layer.num_kv_heads, layer.head_dim)
            layer.bind_cache(torch.zeros(shape), torch.zeros(shape))
        allocate_linear_attention_state(
            model.linear_attention_layers(), 8, torch.float32, torch.device("cpu")
        )
        self.sequences: dict[int, _Sequence] = {}
        self.next_block = 1  # block 0 is the null block

    def step(self, work: list[tuple[int, list[int]]], all_logits: bool = False) -> torch.Tensor:
        """``work``: (sequence id, new tokens), decodes first. Logits of each item's last token
        [B, V], or of every token with ``all_logits``."""
        seqs = [
            self.sequences.setdefault(key, _Sequence(len(self.sequences) + 1)) for key, _ in work
        ]
        num_decodes = 0
        while (
            num_decodes < len(work) and len(work[num_decodes][1]) == 1 and seqs[num_decodes].length
        ):
            num_decodes += 1
        ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        for seq, (_, tokens) in zip(seqs, work, strict=True):
            end = seq.length + len(tokens)
            while len(seq.blocks) * self.block_size < end:
                seq.blocks.append(self.next_block)
                self.next_block += 1
            for p in range(seq.length, end):
                slot_mapping.append(
                    seq.blocks[p // self.block_size] * self.block_size + p % self.block_size
                )
            ids += tokens
            positions += range(seq.length, end)
            seq.length = end
        query_lens = torch.tensor([len(tokens) for _, tokens in work])
        context_lens = torch.tensor([seq.length for seq in seqs])
        width = max(len(seq.blocks) for seq in seqs)
        tables = torch.tensor([seq.blocks + [0] * (width - len(seq.blocks)) for seq in seqs])
        nd = num_decodes
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping),
            num_decode_tokens=nd,
            decode=self._decode(tables[:nd], context_lens[:nd]) if nd else None,
            prefill=(
                self._prefill(tables[nd:], query_lens[nd:], context_lens[nd:])
                if nd < len(work)
                else None
            ),
        )
        if isinstance(self.model, Qwen3_5ForCausalLM):
            meta.linear = self.model.build_linear_attention_metadata(
                query_lens,
                context_lens,
                torch.tensor([s.slot for s in seqs]),
                nd,
                torch.device("cpu"),
            )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), meta)
            if not all_logits:
                hidden = hidden[torch.cumsum(query_lens, 0) - 1]
            return self.model.compute_logits(hidden)

    def _blocks(self, tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        return tables[:, : -(-int(context_lens.max()) // self.block_size)]

    def _decode(self, tables: torch.Tensor, context_lens: torch.Tensor) -> AttentionGroup:
        blocks = self._blocks(tables, context_lens)
        length = blocks.shape[1] * self.block_size
        visible = torch.arange(length).unsqueeze(0) < context_lens.unsqueeze(1)
        return AttentionGroup(
            gather_blocks=blocks,
            mask=visible.view(len(context_lens), 1, 1, length),
            query_index=None,
            valid_queries=None,
            num_tokens=len(context_lens),
        )

    def _prefill(
        self, tables: torch.Tensor, query_lens: torch.Tensor, context_lens: torch.Tensor
    ) -> AttentionGroup:
        blocks = self._blocks(tables, context_lens)
        j = torch.arange(int(query_lens.max())).unsqueeze(0)
        j_real = torch.minimum(j, (query_lens - 1).unsqueeze(1))  # padding repeats the last query
        query_pos = (context_lens - query_lens).unsqueeze(1) + j_real
        key_pos = torch.arange(blocks.shape[1] * self.block_size)
        return AttentionGroup(
            gather_blocks=blocks,
            mask=(key_pos.view(1, 1, -1) <= query_pos.unsqueeze(2)).unsqueeze(1),
            query_index=(torch.cumsum(query_lens, 0) - query_lens).unsqueeze(1) + j_real,
            valid_queries=(j < query_lens.unsqueeze(1)).reshape(-1).nonzero().squeeze(1),
            num_tokens=int(query_lens.sum()),
        )


def _generate(
    model: CausalLM, prompts: list[list[int]], chunks: list[int], new_tokens: int
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Greedy decoding of all prompts in one batch: each step decodes the sequences past their
    prompt, then prefills the next chunk of the others. Returns tokens and their logits."""
    driver = StepDriver(model)
    done = [0] * len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(len(t) < new_tokens for t in tokens):
        decodes = [i for i, t in enumerate(tokens) if t and len(t) < new_tokens]
        prefills = [i for i in range(len(prompts)) if done[i] < len(prompts[i])]
        work = [(i, [tokens[i][-1]]) for i in decodes]
        for i in prefills:
            work.append((i, prompts[i][done[i] : done[i] + chunks[i]]))
            done[i] += len(work[-1][1])
        out = driver.step(work)
        for (i, _), row in zip(work, out, strict=True):
            if done[i] == len(prompts[i]):  # a prompt's last chunk yields its first token
                tokens[i].append(int(row.argmax()))
                logits[i].append(row)
    return tokens, logits


def _reference_greedy(model: Any, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), [step[0] for step in out.logits]


def _assert_greedy_equal(
    got: list[int], expected: list[int], expected_logits: list[torch.Tensor]
) -> None:
    assert len(got) == len(expected) == NEW_TOKENS
    for t, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        if ours != theirs:
            top = expected_logits[t].topk(2)
            gap = float(top.values[0] - top.values[1])
            assert ours == int(top.indices[1]) and gap <= NEAR_TIE, (
                f"diverged at token {t} without a near-tie (gap {gap}): {got} != {expected}"
            )
            return  # past a legitimate near-tie the two continuations differ


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_batched_chunked_greedy_match_transformers(
    case: str, reference: Callable[[str], tuple[Path, Any]]
) -> None:
    folder, hf = reference(case)
    model = _load(folder, SingleRankGroup())
    prompt = PROMPTS[2]
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    got = StepDriver(model).step([(0, prompt)], all_logits=True)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= LOGITS_TOLERANCE
    # The same prompt in chunks of 7: each chunk continues the state and KV of the last.
    driver = StepDriver(model)
    for end in range(7, len(prompt) + 7, 7):
        [last] = driver.step([(0, prompt[end - 7 : end])])
        assert (last - expected[min(end, len(prompt)) - 1]).abs().max().item() <= LOGITS_TOLERANCE

    tokens, _ = _generate(model, PROMPTS, CHUNKS, NEW_TOKENS)
    for prompt, ours in zip(PROMPTS, tokens, strict=True):
        _assert_greedy_equal(ours, *_reference_greedy(hf, prompt))


def test_composite_checkpoints_skip_the_vision_tower_with_one_log_line(
    reference: Callable[[str], tuple[Path, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    folder, hf = reference("qwen3_5-conditional-generation")
    caplog.set_level("INFO", logger="tandem.core.models.qwen3_5")
    _load(folder, SingleRankGroup())
    vision = sum(1 for name, _ in hf.named_parameters() if name.startswith("model.visual."))
    lines = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert len(lines) == 1 and f"skipped {vision} " in lines[0]


def _in_threads(groups: list[Any], body: Callable[[ProcessGroup], Any]) -> list[Any]:
    results: dict[int, Any] = {}
    errors: list[BaseException] = []

    def run(group: ProcessGroup) -> None:
        try:
            results[group.rank] = body(group)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return [results[r] for r in range(len(groups))]


@pytest.mark.parametrize(
    "case", ["qwen3_5-full-first-bias-mqa", "qwen3_5_moe", "qwen3_moe-sparse-step-2"]
)
def test_two_tensor_parallel_ranks_generate_what_one_does(
    case: str, reference: Callable[[str], tuple[Path, Any]]
) -> None:
    """One KV head over two ranks (replicated), linear-attention heads and conv channels,
    experts' intermediate split; rank threads in one process, as the single-process executor
    runs them."""
    folder, _ = reference(case)
    one, one_logits = _generate(_load(folder, SingleRankGroup()), PROMPTS, CHUNKS, NEW_TOKENS)
    ranks = _in_threads(
        create_inprocess_groups(2, timeout_s=120),
        lambda group: _generate(_load(folder, group), PROMPTS, CHUNKS, NEW_TOKENS)[0],
    )
    assert ranks[0] == ranks[1]
    for ours, theirs, logits in zip(ranks[0], one, one_logits, strict=True):
        _assert_greedy_equal(ours, theirs, logits)


def test_the_engine_serves_qwen3_moe_like_transformers(
    hf_model: Callable[..., tuple[Path, Any]], make_engine: Callable[..., LLMEngine]
) -> None:
    """Qwen3-MoE is a dense decoder with MoE blocks: the engine serves it as is, chunked
    prefill forced small and three prompts in one batch."""
    folder, hf = hf_model(
        "Qwen3MoeForCausalLM", **_MOE, head_dim=16, mlp_only_layers=[0], norm_topk_prob=True
    )
    engine = make_engine(folder, max_tokens_per_batch=8, enable_prefix_cache=False)
    outs = engine.generate(PROMPTS, SamplingParams.greedy(max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        _assert_greedy_equal(out.token_ids, *_reference_greedy(hf, prompt))
