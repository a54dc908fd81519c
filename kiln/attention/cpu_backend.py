"""Paged attention for the CPU that reads keys and values where they lie in the paged cache.

Where kiln's C++ kernels are built, decode rows (csrc/paged_decode.cpp) and prefill chunks
(csrc/prefill.h) go through them: they read the cache through the block tables. The rest
(builds without vectors, head dims the kernels do not take, `--attention-backend cpu-flash`)
takes torch's flash kernel as follows. Attention over a request's cached keys does not depend
on their order, so the step's metadata sorts each request's blocks and cuts them into runs of
consecutive block ids: every run is one contiguous range of cache slots, which the flash kernel
reads through a strided view, no copy. Each run returns its output and log-sum-exp, and the
runs of a request are merged by their log-sum-exp (online softmax). A long decode run is also
cut into equal parts that ride as the kernel's batch (its threads split batch x heads, and a
decode row has only its KV heads, so few work items; parts of 1k keys also stay in cache): the
split flash-decoding uses. A prefill chunk adds one causal call over its own keys, which it
holds contiguously as inputs.

Two cases still gather, where copying costs less than a call per piece: runs shorter than
`min_run` tokens (a fragmented cache) are gathered into one piece per request, and decode rows
whose keys take at most `gather_max_bytes` are batched into one SDPA call over gathered keys, as
the pure-PyTorch backend does (many short rows: one call instead of one per row; a small copy
that stays in cache is read faster than the cache in place).

It reads the batch on the host, so, like the pure-PyTorch backend, it declares
GraphSupport.NEVER and runs as a splitting op between compiled pieces."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kiln.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    AttentionShape,
    BatchLayout,
    GraphSupport,
    MetadataBuilder,
)
from kiln.attention.cpu_kernel import DTYPES as KERNEL_DTYPES
from kiln.attention.cpu_kernel import ISA_NAMES, paged_decode_kernel
from kiln.attention.kv_int8 import cache_row_width, is_int8, read_as
from kiln.attention.torch_backend import (
    decode_gather_tensors,
    gathered_decode,
    write_kv,
)

_LIB = torch.library.Library("kiln", "FRAGMENT")
_LIB.define(
    "cpu_paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor(c!) out, Tensor slot_mapping, Tensor query_start_loc, Tensor gathered_rows, "
    "Tensor decode_slots, Tensor decode_bias, Tensor pieces, Tensor piece_slots, "
    "Tensor kernel_tables, Tensor kernel_lens, Tensor prefill_tables, Tensor prefill_starts, "
    "Tensor prefill_lens, float scale) -> ()"
)
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default

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


def _stacked(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """[T, H, D] -> [1, Hkv, G * T, D]: the G query heads sharing a KV head become rows of one
    head, so no key is expanded (a view for a decode row)."""
    t, h, d = q.shape
    return q.view(t, hkv, h // hkv, d).permute(1, 2, 0, 3).reshape(1, hkv, -1, d)


def _unstacked(o: torch.Tensor, t: int) -> torch.Tensor:
    """[Hkv, G * T, D] -> [T, H * D]."""
    hkv, _, d = o.shape
    return o.view(hkv, -1, t, d).permute(2, 0, 1, 3).reshape(t, -1)


def _over_cache(qs, k_flat, v_flat, kind, start, length, parts, piece_slots, scale):
    """One piece of cached keys: its output [S, Hkv, G * T, D] and log-sum-exp [S, Hkv, G * T]."""
    if kind == IN_PLACE:
        keys, values = k_flat[start : start + length], v_flat[start : start + length]
    else:
        slots = piece_slots[start : start + length]
        keys, values = k_flat.index_select(0, slots), v_flat.index_select(0, slots)
    # a bf16 cache under a float32 model, or an int8 one (dequantized: a copy)
    keys, values = read_as(keys, qs.dtype), read_as(values, qs.dtype)
    hkv, d = keys.shape[1:]
    keys = keys.view(parts, length // parts, hkv, d).transpose(1, 2)
    values = values.view(parts, length // parts, hkv, d).transpose(1, 2)
    queries = qs if parts == 1 else qs.expand(parts, *qs.shape[1:])
    return _flash(queries, keys, values, scale=scale)


def _own_causal(q, k, v, hkv, scale):
    """A prefill chunk over its own keys, causal: in the stacked layout of `_stacked`."""
    o, lse = _flash(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                    is_causal=True, scale=scale)  # fmt: skip
    return o.reshape(1, hkv, -1, o.shape[-1]), lse.reshape(1, hkv, -1)


def _merge(partials: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Outputs over disjoint key sets -> the output over their union, weighted by each one's
    share of the softmax mass (in float32)."""
    if len(partials) == 1 and partials[0][0].shape[0] == 1:
        return partials[0][0][0]
    outs = torch.cat([o for o, _ in partials])
    weights = torch.softmax(torch.cat([lse for _, lse in partials]), 0).unsqueeze(-1)
    return (outs * weights).sum(0).to(outs.dtype)


def _attend_row(q, k, v, k_flat, v_flat, pieces, piece_slots, scale) -> torch.Tensor:
    hkv = k_flat.shape[1]
    qs = _stacked(q, hkv)
    partials = [
        _own_causal(q, k, v, hkv, scale)
        if kind == OWN_CAUSAL
        else _over_cache(qs, k_flat, v_flat, kind, start, length, parts, piece_slots, scale)
        for _, kind, start, length, parts in pieces
    ]
    return _unstacked(_merge(partials), q.shape[0])


def _write(k_flat, v_flat, slot_mapping, k, v, keep: bool):
    """write_kv through the C++ kernel: a memcpy (or conversion, or int8 quantization) per row,
    one call a step where index_copy_ took ~100 us a layer for a 512-token chunk and an int8
    cache's PyTorch quantization about ten ops per K/V; the stored values come back only where
    `keep` asks (a step with prefill rows: a chunk attends its own keys as stored)."""
    kernel = paged_decode_kernel()
    if (
        kernel is None
        or not hasattr(kernel.library, "kiln_write_kv")
        or k.dtype not in (torch.float32, torch.bfloat16)
        or k_flat.dtype not in KERNEL_DTYPES
    ):
        return write_kv(k_flat, v_flat, slot_mapping, k, v)
    slots, pairs = slot_mapping.contiguous(), ((k, k_flat), (v, v_flat))
    kernel.write_kv(k.contiguous(), v.contiguous(), slots, k_flat, v_flat)
    if not keep or k_flat.dtype == k.dtype:
        return k, v
    if not is_int8(k_flat):  # the model's rows as the narrower cache holds them
        return k.to(k_flat.dtype).to(k.dtype), v.to(v_flat.dtype).to(v.dtype)
    # the rows just written, read back: the kernel has quantized them once already
    k_stored, v_stored = (read_as(flat.index_select(0, slots), x.dtype) for x, flat in pairs)
    return k_stored, v_stored


def _decode_step(q, k, v, k_cache, v_cache, out, slot_mapping, tables, lens, scale) -> None:
    """Every row a decode row of the C++ kernel, then padding: the cache writes and the
    attention in one call (the Python between them cost ~28 us a layer at one row, against
    ~40 us of kernel over 1k keys), padding rows zeroed."""
    kernel = paged_decode_kernel()
    if kernel is None:  # the builder asks for it only once it is built
        raise RuntimeError("the CPU decode-attention kernel is not available")
    rows = lens.shape[0]
    if rows < q.shape[0]:  # padded to one of the eager step sizes
        out[rows:] = 0
        q, k, v, out = q[:rows], k[:rows], v[:rows], out[:rows]
    kernel.step(q, k, v, slot_mapping, k_cache, v_cache, tables, lens, out, scale)


def cpu_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    gathered_rows: torch.Tensor,
    decode_slots: torch.Tensor,
    decode_bias: torch.Tensor,
    pieces: torch.Tensor,
    piece_slots: torch.Tensor,
    kernel_tables: torch.Tensor,
    kernel_lens: torch.Tensor,
    prefill_tables: torch.Tensor,
    prefill_starts: torch.Tensor,
    prefill_lens: torch.Tensor,
    scale: float,
) -> None:
    """Writes this step's keys and values into the caches and the attention output into `out`
    [T, H * D] (rows past the batch's tokens, padding, become zeros). The first
    `len(kernel_lens)` rows, decode rows, go through the C++ decode kernel; the requests
    `prefill_lens` counts, prefill chunks, through its prefill kernel."""
    others = prefill_lens.shape[0] or pieces.shape[0] or gathered_rows.shape[0]
    if kernel_lens.shape[0] and not others:  # decode rows only: a server's common step
        _decode_step(q, k, v, k_cache, v_cache, out, slot_mapping, kernel_tables, kernel_lens,
                     scale)  # fmt: skip
        return
    hkv, d = k_cache.shape[2:]
    k_flat, v_flat = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    starts = query_start_loc.tolist()
    n_tokens = starts[-1]
    k, v, slot_mapping = k[:n_tokens], v[:n_tokens], slot_mapping[:n_tokens]
    n_kernel, n_gathered = kernel_lens.shape[0], gathered_rows.shape[0]
    piece_list = pieces.tolist()
    own_keys = any(kind == OWN_CAUSAL for _, kind, *_ in piece_list)  # a chunk on the flash path
    k, v = _write(k_flat, v_flat, slot_mapping, k, v, keep=own_keys)
    if n_kernel:
        kernel = paged_decode_kernel()
        if kernel is None:  # the builder asks for it only once it is built
            raise RuntimeError("the CPU decode-attention kernel is not available")
        rows = out[:n_kernel].view(q[:n_kernel].shape)
        kernel.run(q[:n_kernel], k_cache, v_cache, kernel_tables, kernel_lens, rows, scale)
        if n_kernel == q.shape[0]:
            return
    if prefill_lens.shape[0]:
        kernel = paged_decode_kernel()
        if kernel is None:
            raise RuntimeError("the CPU prefill-attention kernel is not available")
        kernel.prefill(q, k_cache, v_cache, prefill_tables, prefill_starts, prefill_lens,
                       out.view(q.shape), scale)  # fmt: skip
    if n_gathered == q.shape[0]:  # only short decodes, no padding: the common small step
        out.copy_(gathered_decode(q, k_flat, v_flat, decode_slots, decode_bias, scale))
        return
    out[n_tokens:] = 0
    if n_gathered:
        rows = gathered_decode(q.index_select(0, gathered_rows), k_flat, v_flat, decode_slots,
                               decode_bias, scale)  # fmt: skip
        out.index_copy_(0, gathered_rows, rows)
    for row, row_pieces in itertools.groupby(piece_list, key=lambda p: p[0]):
        a, b = starts[row], starts[row + 1]
        out[a:b] = _attend_row(q[a:b], k[a:b], v[a:b], k_flat, v_flat, list(row_pieces),
                               piece_slots, scale)  # fmt: skip


def _fake(q, k, v, k_cache, v_cache, out, slot_mapping, query_start_loc, gathered_rows,
          decode_slots, decode_bias, pieces, piece_slots, kernel_tables, kernel_lens,
          prefill_tables, prefill_starts, prefill_lens, scale) -> None:  # fmt: skip
    return None


_LIB.impl("cpu_paged_attention", cpu_paged_attention, "CompositeExplicitAutograd")
torch.library.register_fake("kiln::cpu_paged_attention", _fake, lib=_LIB)


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


class CpuPagedAttentionBackend(AttentionBackend):
    name = "cpu"
    graph_support = GraphSupport.NEVER
    drafts_as_decode_rows = True
    splitting_ops = ("kiln::cpu_paged_attention",)

    def __init__(
        self,
        dtype: torch.dtype,
        shape: AttentionShape,
        tuning: CpuAttentionTuning | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        """dtype: the model's (queries, outputs); kv_dtype: the cache's (default the same)."""
        self.dtype, self.kv_dtype = dtype, kv_dtype or dtype
        row = cache_row_width(shape.head_dim, self.kv_dtype)
        self.key_bytes = shape.num_kv_heads * row * self.kv_dtype.itemsize
        self.tuning = tuning or CpuAttentionTuning()
        self.decode_kernel = self._uses_kernel(shape)
        self.prefill_kernel = self._uses_prefill_kernel(shape)
        self.head_dim = shape.head_dim
        flash_only = not (self.decode_kernel or self.prefill_kernel)
        self.name = "cpu-flash" if flash_only and self.tuning.decode_kernel == "off" else "cpu"

    def _uses_kernel(self, shape: AttentionShape) -> bool:
        choice = self.tuning.decode_kernel
        if choice not in ("auto", "on", "off"):
            raise ValueError(f'decode_kernel is "auto", "on" or "off", not {choice!r}')
        if choice == "off":
            return False
        kernel = paged_decode_kernel()
        dims = (shape.num_heads, shape.head_dim)
        types = (self.dtype, self.kv_dtype)
        if kernel is None or not all(kernel.supports(t, *dims) for t in types):
            return False
        return choice == "on" or kernel.vectorized

    def _uses_prefill_kernel(self, shape: AttentionShape) -> bool:
        choice = self.tuning.prefill_kernel
        if choice not in ("auto", "off"):
            raise ValueError(f'prefill_kernel is "auto" or "off", not {choice!r}')
        kernel = None if choice == "off" else paged_decode_kernel()
        return (
            kernel is not None
            and kernel.vectorized
            and kernel.prefill_supported(shape.head_dim)
            and self.dtype in (torch.float32, torch.bfloat16)
            and self.kv_dtype in (torch.float32, torch.bfloat16, torch.int8)
            and kernel.supports(self.dtype, shape.num_heads, shape.head_dim)
        )

    def describe(self) -> str:
        prefill = "C++ kernel" if self.prefill_kernel else "flash kernel"
        if self.prefill_kernel and self._prefill_tiles():
            prefill += " on AMX tiles"
        if self.decode_kernel:
            kernel = paged_decode_kernel()
            assert kernel is not None  # decode_kernel is set only where it was built
            isa = ISA_NAMES[kernel.isa]
            if self.kv_dtype == torch.int8 and kernel.int8_queries(self.head_dim):
                isa += ", int8 keys by VNNI dot products with int8 queries"
                if kernel.int8_values(self.head_dim):
                    isa += ", values by VNNI with 8-bit weights"
            return f"{self.name} (decode rows: C++ kernel built with {isa}; prefill: {prefill})"
        kernel = None if self.tuning.decode_kernel == "off" else paged_decode_kernel()
        why = ("off" if self.tuning.decode_kernel == "off" else
               "not built: see the warning" if kernel is None else
               f"built with {ISA_NAMES[kernel.isa]}, not used" if not kernel.vectorized else
               "not for this dtype or head shape")  # fmt: skip
        if self.prefill_kernel:
            return f"{self.name} (decode rows: flash kernel, the C++ one {why}; prefill: {prefill})"
        return f"{self.name} (flash kernel throughout; the C++ decode kernel: {why})"

    def _prefill_tiles(self) -> bool:
        kernel = paged_decode_kernel()
        return (
            kernel is not None
            and self.dtype == torch.bfloat16
            and self.kv_dtype == torch.bfloat16
            and kernel.prefill_amx(self.head_dim)
        )

    def metadata_builder(self, max_num_tokens: int, device: torch.device) -> MetadataBuilder:
        return CpuPagedMetadataBuilder(self.dtype, self.key_bytes, self.tuning, self.decode_kernel,
                                       self.prefill_kernel)  # fmt: skip

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        meta: CpuPagedMetadata,
        scale: float,
    ) -> None:
        torch.ops.kiln.cpu_paged_attention(
            q,
            k,
            v,
            k_cache,
            v_cache,
            out,
            meta.slot_mapping,
            meta.query_start_loc,
            meta.gathered_rows,
            meta.decode_slots,
            meta.decode_bias,
            meta.pieces,
            meta.piece_slots,
            meta.kernel_tables,
            meta.kernel_lens,
            meta.prefill_tables,
            meta.prefill_starts,
            meta.prefill_lens,
            scale,
        )
