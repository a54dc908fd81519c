"""The CPU attention backend's step metadata, built on the host: which decode rows go through the
C++ kernel or are gathered into one call, and every other row's pieces (runs of consecutive
cache slots read in place, gathered slots, a prefill chunk's own causal keys), with the tuning
that decides between them. kiln/attention/cpu_backend.py is the op that reads it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kiln.attention.backend import AttentionMetadata, BatchLayout, MetadataBuilder
from kiln.attention.torch_backend import decode_gather_tensors

# pieces' kind column
IN_PLACE, GATHERED, OWN_CAUSAL = 0, 1, 2


@dataclass(frozen=True)
class CpuAttentionTuning:
    """Where the backend gathers instead of reading in place, and how it splits long decode
    runs; the defaults come from benchmarks/cpu_attention.py (docs/performance.md)."""

    # decode rows whose keys take at most this many bytes: one batched call over gathered keys
    # (a copy that stays in cache beats reading in place, measured over 28-30 layers' caches:
    # up to ~4k tokens of SmolLM2's 384-byte bf16 keys, under 4k of Qwen3-0.6B's 2 KiB ones)
    gather_max_bytes: int = 2 << 20
    gather_budget_bytes: int = 48 << 20  # ... while rows x the longest stay under this
    min_run: int = 256  # runs shorter than this many tokens are gathered
    part_tokens: int = 1024  # a decode run is cut into parts of at least this many tokens
    max_parts: int = 32
    # decode rows through the C++ kernel (csrc/paged_decode.cpp): "auto" where it was built
    # with AVX2 or AVX-512 (1.1-4.7x the flash kernel's paths, docs/performance.md), "on" also
    # with its portable loops, "off" never
    decode_kernel: str = "auto"
    # prefill chunks through the C++ prefill kernel (csrc/prefill.h): "auto" where it was built
    # vectorised for the head dim (float32, bf16 and int8 caches; 2.5-3.4x torch's flash
    # kernel on a 512-token chunk, docs/performance.md), "off" never
    prefill_kernel: str = "auto"


@dataclass
class CpuPagedMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    gathered_rows: torch.Tensor  # [n] int64: short decode rows, attended in one gathered call
    decode_slots: torch.Tensor  # [n * max_len] int64, their keys' slots
    decode_bias: torch.Tensor  # [n * max_len] 0 or -inf in the model's dtype
    pieces: torch.Tensor  # [P, 5] int64: (row, kind, start, length, parts), grouped by row
    piece_slots: torch.Tensor  # [S] int64: the slots GATHERED pieces read
    kernel_tables: torch.Tensor  # [n, W] int32: the block tables of the kernel's decode rows
    kernel_lens: torch.Tensor  # [n] int32: their lengths (the first n rows)
    prefill_tables: torch.Tensor  # [p, W] int32: the block tables of the prefill kernel's chunks
    prefill_starts: torch.Tensor  # [p + 1] int32: their first query tokens (and the end)
    prefill_lens: torch.Tensor  # [p] int32: their keys, the chunk's own included

    dynamic_dims: ClassVar[dict[str, tuple[int, ...]]] = {
        "slot_mapping": (0,),
        "query_start_loc": (0,),
        "gathered_rows": (0,),
        "decode_slots": (0,),
        "decode_bias": (0,),
        "pieces": (0,),
        "piece_slots": (0,),
        "kernel_tables": (0, 1),
        "kernel_lens": (0,),
        "prefill_tables": (0, 1),
        "prefill_starts": (0,),
        "prefill_lens": (0,),
    }


def block_runs(table: np.ndarray, num_keys: int, block_size: int) -> list[tuple[int, int]]:
    """The first `num_keys` keys of a request whose blocks are `table`, as (first slot, length)
    ranges of consecutive cache slots: its blocks sorted, cut where ids jump and after its last,
    partly filled, block (whose unwritten slots are never read)."""
    n_blocks = -(-num_keys // block_size)
    blocks = table[:n_blocks].astype(np.int64)
    tail_len = num_keys - (n_blocks - 1) * block_size
    order = np.sort(blocks)
    cuts = np.flatnonzero(np.diff(order) != 1) + 1
    tail = int(blocks[-1])
    if tail_len < block_size:  # cut after the partial block so a run never reads past it
        at = int(np.searchsorted(order, tail)) + 1
        cuts = np.union1d(cuts, [at]) if at < n_blocks else cuts
    runs = []
    for run in np.split(order, cuts):
        length = len(run) * block_size - (block_size - tail_len if run[-1] == tail else 0)
        runs.append((int(run[0]) * block_size, length))
    return runs


class CpuPagedMetadataBuilder(MetadataBuilder):
    """Per step, on the host: which decode rows are gathered, and every other row's pieces."""

    def __init__(
        self, dtype: torch.dtype, key_bytes: int, tuning: CpuAttentionTuning, kernel: bool,
        prefill_kernel: bool = False,
    ) -> None:  # fmt: skip
        """key_bytes: one token's keys in one layer (KV heads x head dim x element size);
        kernel: decode rows go through the C++ kernel; prefill_kernel: prefill chunks too."""
        self.dtype, self.key_bytes, self.tuning, self.kernel = dtype, key_bytes, tuning, kernel
        self.prefill_kernel = prefill_kernel

    def build(self, layout: BatchLayout) -> CpuPagedMetadata:
        lens = layout.seq_lens.numpy()
        starts = layout.query_start_loc[: layout.num_reqs + 1].numpy()
        tables = layout.block_tables.numpy()
        n_kernel = layout.num_decodes if self.kernel else 0
        gathered = set() if self.kernel else self._gathered_rows(lens[: layout.num_decodes])
        pieces, slots = [], []
        for row in range(n_kernel, layout.num_reqs):
            q_len = int(starts[row + 1] - starts[row])
            is_decode = row < layout.num_decodes
            if (is_decode and row in gathered) or (not is_decode and self.prefill_kernel):
                continue
            cached = int(lens[row]) - (0 if is_decode else q_len)
            self._row_pieces(row, tables[row], cached, layout.block_size, is_decode, pieces, slots)
            if not is_decode:
                pieces.append((row, OWN_CAUSAL, 0, q_len, 1))
        rows = torch.tensor(sorted(gathered), dtype=torch.long)
        decode_slots, decode_bias = decode_gather_tensors(
            layout.block_tables[rows], layout.seq_lens[rows], layout.block_size, self.dtype
        )
        return CpuPagedMetadata(
            slot_mapping=layout.slot_mapping,
            query_start_loc=layout.query_start_loc,
            gathered_rows=rows,
            decode_slots=decode_slots,
            decode_bias=decode_bias,
            pieces=torch.tensor(pieces, dtype=torch.long).view(-1, 5),
            piece_slots=torch.tensor(slots, dtype=torch.long),
            # copies: the kernel reads them whole (the table's width is the step's longest)
            kernel_tables=layout.block_tables[:n_kernel].to(torch.int32, copy=True),
            kernel_lens=layout.seq_lens[:n_kernel].to(torch.int32, copy=True),
            **self._prefill_rows(layout),
        )

    def _prefill_rows(self, layout: BatchLayout) -> dict[str, torch.Tensor]:
        """The prefill kernel's requests: every one after the decodes, where it is used."""
        first = layout.num_decodes
        end = layout.num_reqs if self.prefill_kernel else first
        return {
            "prefill_tables": layout.block_tables[first:end].to(torch.int32, copy=True),
            "prefill_starts": layout.query_start_loc[first : end + 1].to(torch.int32, copy=True),
            "prefill_lens": layout.seq_lens[first:end].to(torch.int32, copy=True),
        }

    def _gathered_rows(self, decode_lens: np.ndarray) -> set[int]:
        """The shortest decode rows, up to gather_max_bytes of keys each, while their gathered
        keys (rows x the longest) fit the budget."""
        rows: set[int] = set()
        t = self.tuning
        for row in np.argsort(decode_lens, kind="stable").tolist():
            nbytes = int(decode_lens[row]) * self.key_bytes
            if nbytes > t.gather_max_bytes or (len(rows) + 1) * nbytes > t.gather_budget_bytes:
                break
            rows.add(row)
        return rows

    def _row_pieces(self, row, table, num_keys, block_size, is_decode, pieces, slots) -> None:
        if num_keys == 0:
            return
        short = []
        for start, length in block_runs(table, num_keys, block_size):
            if length < self.tuning.min_run:
                short.append(np.arange(start, start + length))
                continue
            parts = self._parts(length) if is_decode else 1
            whole = length - length % parts
            pieces.append((row, IN_PLACE, start, whole, parts))
            if whole < length:  # the few keys left over, in place too
                pieces.append((row, IN_PLACE, start + whole, length - whole, 1))
        gathered = np.concatenate(short) if short else np.empty(0, dtype=np.int64)
        if len(gathered):
            pieces.append((row, GATHERED, len(slots), len(gathered), 1))
            slots.extend(gathered.tolist())

    def _parts(self, length: int) -> int:
        """Parts of about part_tokens keys: enough work items for every thread even with few KV
        heads, and each part's keys stay in the core's cache while the kernel reads them
        (measured: 16 parts of 1k keys take 0.6x the time of one 16k run, with 8 KV heads too).
        A count down to half that which divides the run leaves no keys over for another call."""
        most = max(1, min(length // self.tuning.part_tokens, self.tuning.max_parts))
        return next((n for n in range(most, most // 2, -1) if length % n == 0), most)
