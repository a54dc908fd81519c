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

import torch

from kiln.attention.backend import (
    AttentionBackend,
    AttentionShape,
    GraphSupport,
    MetadataBuilder,
)
from kiln.attention.cpu_kernel import DTYPES as KERNEL_DTYPES
from kiln.attention.cpu_kernel import ISA_NAMES, paged_decode_kernel
from kiln.attention.cpu_metadata import (
    IN_PLACE,
    OWN_CAUSAL,
    CpuAttentionTuning,
    CpuPagedMetadata,
    CpuPagedMetadataBuilder,
)
from kiln.attention.kv_int8 import cache_row_width, is_int8, read_as
from kiln.attention.torch_backend import (
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
