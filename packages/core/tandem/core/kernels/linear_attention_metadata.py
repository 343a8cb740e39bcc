"""What linear-attention (Gated DeltaNet) layers need to know about a step, built once per step
and shared by every such layer, like ``AttentionMetadata`` for paged attention.

The step's tokens are laid out as for paged attention: the first ``num_decodes`` sequences
have one new token each, then come the ``num_verifies`` sequences that verify speculative
drafts (their last known token and its drafts), then the prefill chunks, each sequence's
tokens contiguous.
Every running sequence owns one *state slot*: row ``slot`` of each linear-attention layer's
conv-state and recurrent-state pools (slot 0 is the null slot, like the null KV block: padding
may point there, nothing real lives in it). A sequence's first chunk starts from a zero state
(``has_initial_state`` False), whatever the slot held before; every later chunk and decode
continues from the slot, so chunked prefill and decoding carry the state across steps.

The engine builds it from the step's per-sequence ``query_lens``, ``context_lens`` (cached
tokens after the step) and state slots, on the host (``plan_linear_attention_metadata``),
moves its tensors with the step's others in one copy, and hands it to the model on
``AttentionMetadata.linear``. Beside those, it precomputes the gather indices
the CPU kernels use (conv windows, chunk layout) with batched tensor ops, so no layer
rebuilds them and no kernel loops over tokens in Python.

A verifying sequence runs its tokens one position at a time through the decode kernels
(``LinearVerifyIndices``): the state after each position but the last is copied to a scratch
row of the pools, so that when only some drafts are accepted the engine can copy the state
after the last accepted one back into the slot (before the next step), as if the rejected
tokens had never been computed. The loop is over draft positions (at most
``num_speculative_tokens + 1``), each one batched over every verifying sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from tandem.core.kernels.device_copy import to_device_once

# Chunk length of the chunked gated delta rule (flash-linear-attention and transformers use 64).
DEFAULT_CHUNK_SIZE = 64


@dataclass
class LinearPrefillIndices:
    """Gather indices over the prefill part of a step (its tokens counted from 0)."""

    num_tokens: int
    # Per prefill sequence (B = number of prefill sequences).
    state_slots: torch.Tensor  # [B] int64
    has_initial_state: torch.Tensor  # [B] bool
    # Known on the host: every prefill sequence continues a state, so kernels read the slots
    # as they are instead of selecting zeros for first chunks.
    all_have_initial_state: bool
    # Causal conv: tap j of token t reads row conv_window_index[j, t] of
    # cat(prefill inputs [N, C], initial conv states as rows [B * (K - 1), C]).
    conv_window_index: torch.Tensor  # [K, N] int64
    # The K - 1 rows of the same source that form each sequence's next conv state.
    conv_state_index: torch.Tensor  # [K - 1, B] int64
    # Chunked delta rule: each sequence padded to whole chunks of chunk_size tokens, chunks of
    # all sequences stacked ([num_chunks, chunk_size]) plus one all-zero chunk at the end.
    chunk_size: int
    num_chunks: int
    chunk_token_index: torch.Tensor  # [N] int64: row (chunk * chunk_size + offset) of token t
    # Chunk id of each sequence's i-th chunk; sequences with fewer chunks point at the zero
    # chunk (num_chunks), which leaves their state unchanged.
    chunk_table: torch.Tensor  # [B, max chunks per sequence] int64
    # Where each sequence's tokens start, counted from the prefill part's first ([B + 1]), for
    # kernels that run a sequence's tokens in order in one call (the CPU's).
    run_starts: torch.Tensor  # [B + 1] int64


@dataclass
class LinearVerifyPosition:
    """Position j of the verifying sequences that have a token there (``meta.num_decodes``
    of them, their tokens the next run of ``LinearVerifyIndices.order``)."""

    meta: LinearAttentionMetadata  # decode metadata of those sequences (their own slots)
    num_saved: int  # how many of them have a token after this one
    save_from: torch.Tensor  # [num_saved] int64: their slots, whose state after j is kept
    save_to: torch.Tensor  # [num_saved] int64: the scratch rows it is copied to


@dataclass
class LinearVerifyIndices:
    num_tokens: int
    # The verify part's tokens (counted from its first) position by position: every
    # sequence's token 0, then every token 1, ...; a layer gathers its inputs in this order
    # once and hands each position a contiguous run of them.
    order: torch.Tensor  # [num_tokens] int64
    positions: list[LinearVerifyPosition]
    # The same tokens sequence by sequence (token order), for kernels that run a sequence's
    # positions in order in one call: each sequence's slot, where its tokens start (from the
    # verify part's first, [V + 1]), and per token the scratch row its state after it is
    # kept in (-1 for each sequence's last token).
    run_slots: torch.Tensor | None = None  # [V] int64
    run_starts: torch.Tensor | None = None  # [V + 1] int64
    keep_rows: torch.Tensor | None = None  # [num_tokens] int64


@dataclass
class LinearAttentionMetadata:
    state_slots: torch.Tensor  # [S] int64, per sequence of the step, decodes first
    query_start_loc: torch.Tensor  # [S + 1] int64, first token of each sequence in the step
    has_initial_state: torch.Tensor  # [S] bool: False on a sequence's first chunk
    num_decodes: int  # the first num_decodes sequences (and tokens) are single-token decodes
    prefill: LinearPrefillIndices | None  # None when the step has no prefill
    # Known on the host: every decode continues a state (always so in the engine, where a
    # decode follows its prompt), so kernels skip selecting zeros over the decode states.
    decodes_have_initial_state: bool
    # The sequences after the decodes that verify drafts (None: none do), and how many.
    verify: LinearVerifyIndices | None = None
    num_verifies: int = 0

    @property
    def num_verify_tokens(self) -> int:
        return 0 if self.verify is None else self.verify.num_tokens

    @property
    def prefill_query_start_loc(self) -> torch.Tensor:
        """[P + 1] where each prefill sequence's tokens start in the step (the first entry is
        where the prefill part starts: after the decodes and the verifying sequences)."""
        return self.query_start_loc[self.num_decodes + self.num_verifies :]

    @property
    def decode_slots(self) -> torch.Tensor:
        return self.state_slots[: self.num_decodes]

    @property
    def decode_has_initial_state(self) -> torch.Tensor:
        return self.has_initial_state[: self.num_decodes]


# Finishes the metadata from its moved tensors (taken in the order they were listed).
FinishLinear = Callable[[Iterator[torch.Tensor]], LinearAttentionMetadata]


def plan_linear_attention_metadata(
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    state_slots: torch.Tensor,
    num_decodes: int,
    conv_kernel_size: int,
    tensors: list[torch.Tensor],
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    num_verifies: int = 0,
    verify_scratch: torch.Tensor | None = None,
) -> FinishLinear:
    """The host half: ``query_lens``, ``context_lens``, ``state_slots`` ([S] int64 on the
    host, decodes first) become index tensors appended to ``tensors`` (to be moved to the
    device in one copy with the step's others); the returned function builds the metadata
    from them once moved. Every size and flag it needs is read here, on the host.
    ``num_verifies``: the sequences after the decodes that verify drafts;
    ``verify_scratch``: the scratch rows their states after each position but the last go
    to, sequence by sequence ([sum(query_len - 1)] int64).

    A sequence has an initial state when tokens were cached before this step
    (``context_len > query_len``). Prefix caching must be off for these models: a cached prefix
    has KV but no recurrent state.
    """
    query_lens = query_lens.to(torch.int64)
    context_lens = context_lens.to(torch.int64)
    slots = state_slots.to(torch.int64)
    starts = torch.zeros(query_lens.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(query_lens, 0, out=starts[1:])
    has_initial = context_lens > query_lens
    decodes_have_initial_state = bool(has_initial[:num_decodes].all())
    tensors += [slots, starts, has_initial]
    verify = None
    first_prefill = num_decodes + num_verifies
    if num_verifies:
        if verify_scratch is None:
            raise ValueError("verifying sequences need their scratch rows (verify_scratch)")
        verify = _plan_verify(
            query_lens[num_decodes:first_prefill],
            slots[num_decodes:first_prefill],
            verify_scratch.to(torch.int64),
            tensors,
        )
    prefill = None
    if query_lens.shape[0] > first_prefill:
        prefill = _plan_prefill(
            query_lens[first_prefill:],
            slots[first_prefill:],
            has_initial[first_prefill:],
            conv_kernel_size,
            chunk_size,
            tensors,
        )

    def finish(parts: Iterator[torch.Tensor]) -> LinearAttentionMetadata:
        slots, starts, has_initial = next(parts), next(parts), next(parts)
        return LinearAttentionMetadata(
            state_slots=slots,
            query_start_loc=starts,
            has_initial_state=has_initial,
            num_decodes=num_decodes,
            verify=verify(parts) if verify else None,
            num_verifies=num_verifies,
            prefill=prefill(parts) if prefill else None,
            decodes_have_initial_state=decodes_have_initial_state,
        )

    return finish


def _plan_verify(
    lens: torch.Tensor, slots: torch.Tensor, scratch: torch.Tensor, tensors: list[torch.Tensor]
) -> Callable[[Iterator[torch.Tensor]], LinearVerifyIndices]:
    """Per position j, the verifying sequences with a token there: their slots, and where
    the state after j of those with a later token goes; and the tokens in position order."""
    starts = torch.cumsum(lens, 0) - lens
    kept = lens - 1  # states kept per sequence: after every position but the last
    scratch_start = torch.cumsum(kept, 0) - kept
    if int(scratch.shape[0]) != int(kept.sum()):
        raise ValueError(
            f"verify_scratch has {scratch.shape[0]} rows, the verifying sequences keep "
            f"{int(kept.sum())} states"
        )
    sizes: list[tuple[int, int]] = []
    order = []
    for j in range(int(lens.max())):
        active = (lens > j).nonzero().squeeze(1)
        saved = (lens > j + 1).nonzero().squeeze(1)
        n = int(active.shape[0])
        order.append(starts[active] + j)
        tensors += [
            slots[active],
            torch.arange(n + 1, dtype=torch.int64),
            torch.ones(n, dtype=torch.bool),
            slots[saved],
            scratch[scratch_start[saved] + j],
        ]
        sizes.append((n, int(saved.shape[0])))
    num_tokens = int(lens.sum())
    tensors.append(torch.cat(order))
    run_starts = torch.zeros(lens.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=run_starts[1:])
    keep_rows = torch.full((num_tokens,), -1, dtype=torch.int64)
    is_kept = torch.ones(num_tokens, dtype=torch.bool)
    is_kept[run_starts[1:] - 1] = False  # each sequence's last token
    keep_rows[is_kept] = scratch
    tensors += [slots, run_starts, keep_rows]

    def finish(parts: Iterator[torch.Tensor]) -> LinearVerifyIndices:
        positions = []
        for n, num_saved in sizes:
            position_slots, starts, has_initial, save_from, save_to = (
                next(parts) for _ in range(5)
            )
            meta = LinearAttentionMetadata(
                state_slots=position_slots,
                query_start_loc=starts,
                has_initial_state=has_initial,
                num_decodes=n,
                prefill=None,
                decodes_have_initial_state=True,
            )
            positions.append(LinearVerifyPosition(meta, num_saved, save_from, save_to))
        order = next(parts)
        run_slots, run_starts, keep_rows = next(parts), next(parts), next(parts)
        return LinearVerifyIndices(num_tokens, order, positions, run_slots, run_starts, keep_rows)

    return finish


def build_linear_attention_metadata(
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    state_slots: torch.Tensor,
    num_decodes: int,
    conv_kernel_size: int,
    device: torch.device,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    num_verifies: int = 0,
    verify_scratch: torch.Tensor | None = None,
) -> LinearAttentionMetadata:
    """Both halves, the tensors moved to ``device`` in one copy."""
    tensors: list[torch.Tensor] = []
    finish = plan_linear_attention_metadata(
        query_lens,
        context_lens,
        state_slots,
        num_decodes,
        conv_kernel_size,
        tensors,
        chunk_size,
        num_verifies=num_verifies,
        verify_scratch=verify_scratch,
    )
    return finish(iter(to_device_once(tensors, device)))


def _plan_prefill(
    lens: torch.Tensor,
    slots: torch.Tensor,
    has_initial: torch.Tensor,
    kernel_size: int,
    max_chunk_size: int,
    tensors: list[torch.Tensor],
) -> Callable[[Iterator[torch.Tensor]], LinearPrefillIndices]:
    num_seqs = lens.shape[0]
    num_tokens = int(lens.sum())
    starts = torch.cumsum(lens, 0) - lens
    token = torch.arange(num_tokens)
    seq = torch.repeat_interleave(torch.arange(num_seqs), lens, output_size=num_tokens)
    pos = token - starts[seq]  # position of each token within its sequence's new tokens

    # Conv source rows: the N inputs, then each sequence's K - 1 previous inputs (its state).
    # In a sequence's own coordinates s (state first), row s < K - 1 is a state row.
    history = kernel_size - 1

    def source_row(s: torch.Tensor, seq_of: torch.Tensor) -> torch.Tensor:
        from_input = starts[seq_of] + s - history
        from_state = num_tokens + seq_of * history + s
        return torch.where(s >= history, from_input, from_state)

    taps = torch.arange(kernel_size).unsqueeze(1)  # [K, 1]
    window = source_row(pos.unsqueeze(0) + taps, seq.expand(kernel_size, -1))
    keep = lens.unsqueeze(0) + torch.arange(history).unsqueeze(1)  # [K - 1, B]
    state_rows = source_row(keep, torch.arange(num_seqs).expand(history, -1))

    # Short prefills get short chunks: the arithmetic is the same, the padding is not.
    longest = int(lens.max())
    chunk = min(max_chunk_size, 1 << max(longest - 1, 0).bit_length())
    seq_chunks = (lens + chunk - 1) // chunk
    chunk_start = torch.cumsum(seq_chunks, 0) - seq_chunks
    num_chunks = int(seq_chunks.sum())
    chunk_token_index = (chunk_start[seq] + pos // chunk) * chunk + pos % chunk
    ith = torch.arange(int(seq_chunks.max())).unsqueeze(0)
    chunk_table = torch.where(
        ith < seq_chunks.unsqueeze(1), chunk_start.unsqueeze(1) + ith, num_chunks
    )
    all_have_initial_state = bool(has_initial.all())
    run_starts = torch.zeros(num_seqs + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=run_starts[1:])
    tensors += [slots, has_initial, window, state_rows, chunk_token_index, chunk_table, run_starts]

    def finish(parts: Iterator[torch.Tensor]) -> LinearPrefillIndices:
        slots, has_initial, window, state_rows, token_index, table, run_starts = (
            next(parts) for _ in range(7)
        )
        return LinearPrefillIndices(
            num_tokens=num_tokens,
            state_slots=slots,
            has_initial_state=has_initial,
            all_have_initial_state=all_have_initial_state,
            conv_window_index=window,
            conv_state_index=state_rows,
            chunk_size=chunk,
            num_chunks=num_chunks,
            chunk_token_index=token_index,
            chunk_table=table,
            run_starts=run_starts,
        )

    return finish
