"""The token counts that steps run outside a graph are padded to on the CPU.

oneDNN creates and caches a kernel (a primitive, with its scratch memory) for every input shape
a linear layer meets, and a server meets every token count from 1 to the step budget: its
resident memory grew by about 35 MiB a minute under mixed traffic and never came back. With
the counts rounded up to a bounded set it levels off after warm-up (docs/performance.md, "Resident
memory over a server's life"). Counts up to 8 stay exact, so single-stream and small-batch
decode run no padding rows."""

from __future__ import annotations

EXACT_UP_TO = 8


def padded_token_count(num_tokens: int, limit: int) -> int:
    """`num_tokens` rounded up to its bucket, never above `limit` (the input buffers' size):
    exact to 8, then eight buckets per doubling (multiples of 8 to 128, of 16 to 256, of 32 to
    512, ...), so a step runs at most max(7, num_tokens / 8) padding rows."""
    if num_tokens <= EXACT_UP_TO:
        return num_tokens
    step = max(8, 1 << (num_tokens - 1).bit_length() - 4)
    return min(-(-num_tokens // step) * step, limit)


def pads_eager_steps(setting: str, device_type: str) -> bool:
    """`--eager-step-padding`: auto pads on the CPU only (cuBLAS keeps no per-shape state)."""
    return setting == "on" or (setting == "auto" and device_type == "cpu")
