"""Dense copies of packed weights for large batches on the CPU (`--prefill-weights`).

The int4 kernel reads a quarter of the bytes of a bf16 weight, which is what a decode step is
made of; its time grows with the rows, so a prefill chunk of hundreds of rows runs on the weight
dequantized to bf16 instead, and dequantizing every weight for every chunk costs about as much
as the chunk's matmuls (docs/performance.md, "Packed weights under concurrency"). A dense copy
made once at load removes that cost for two bytes per weight more memory (the embedded model:
257 MiB beside its 97 MiB of planes). A bf16 copy is packed for kiln's bf16 kernel where it runs
(`--cpu-linears auto`), which beats the int4 kernel's float path from 2 rows, so decode steps of
two or more streams take it too, and from 4 rows where the rows go in as int8 planes (Q6_K, the
K-quants, int4 planes with --packed-activations int16/int8/auto on a VNNI CPU; Q8_0's two planes
keep 2); a oneDNN copy takes batches of 16 rows and more. Only half-precision
models on the CPU take copies: a float32 model's rows stay on the int4 kernel, each row computed
alone, so its results do not depend on the batch."""

from __future__ import annotations

import logging

import torch
from torch import nn

from kiln.boot.kv_cache import available_memory
from kiln.errors import ConfigError
from kiln.layers.embedding import VocabEmbedding
from kiln.layers.linear import Linear, onednn_runs, pack_for_cpu
from kiln.layers.packed import DENSE_MIN_ROWS, INT8_COPY_MIN_ROWS, PAIRS_MIN_ROWS, PackedWeight

logger = logging.getLogger(__name__)

POLICIES = ("auto", "dense", "packed")
AUTO_MEMORY_FRACTION = 0.25  # auto keeps the copies when they take at most this much of the free


def keep_dense_copies(
    model: nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    policy: str,
    cpu_linears: str = "auto",
) -> None:
    """Give every packed linear of `model` (and a packed embedding that is also its LM head)
    a dense copy in `dtype` (for kiln's bf16 kernel, or oneDNN where it does not run or
    `cpu_linears` is onednn), as `policy` says: auto (when they fit in a quarter of the free
    host memory, else a warning naming the remedy), dense (always, an error where no copy can
    run), packed (never)."""
    layers = _packed_products(model)
    if policy == "packed" or not layers:
        return
    why_not = _unsupported(dtype, device)
    if why_not is not None:
        if policy == "dense":
            raise ConfigError(f"--prefill-weights dense: {why_not}; use auto or packed")
        return
    size = torch.empty((), dtype=dtype).element_size()
    need = sum(m.out_features * m.in_features * size for m in layers)
    free = available_memory(device) if policy == "auto" else 0
    if policy == "auto" and need > AUTO_MEMORY_FRACTION * free:
        logger.warning(
            "packed weights: no dense copies for prefill chunks (%.1f MiB would take more than "
            "a quarter of the %.1f MiB free), so every chunk dequantizes the weights it uses "
            "(prefill about 1.3x slower). Remedy: --prefill-weights dense to keep them anyway",
            need / 2**20,
            free / 2**20,
        )
        return
    on_kernel = False
    for packed in layers:
        layout, copy = pack_for_cpu(packed.dense_weight(dtype), kernel=cpu_linears == "auto")
        packed.keep_dense_copy(copy)
        on_kernel = layout == "pairs"
    logger.info(
        "packed weights: dense %s copies of %d tensors on %s for batches of %s rows (%.1f MiB; "
        "--prefill-weights packed saves them)",
        str(dtype).removeprefix("torch."),
        len(layers),
        "kiln's bf16 kernel" if on_kernel else "oneDNN",
        f"{PAIRS_MIN_ROWS}+ ({INT8_COPY_MIN_ROWS}+ where rows go in as int8 planes)"
        if on_kernel
        else f"{DENSE_MIN_ROWS}+",
        need / 2**20,
    )


def _packed_products(model: nn.Module) -> list[PackedWeight]:
    """The packed weights that multiply activations: linears, and tied heads (a packed
    embedding that is only looked up needs no copy)."""
    out = [p for m in model.modules() if isinstance(m, Linear) and m.packed is not None
           for p in m.packed.products()]  # fmt: skip
    for m in model.modules():
        table = getattr(m, "embed_tokens", None)
        tied = hasattr(m, "lm_head") and m.lm_head is None
        if tied and isinstance(table, VocabEmbedding) and table.packed is not None:
            out.append(table.packed)
    return out


def _unsupported(dtype: torch.dtype, device: torch.device) -> str | None:
    if device.type != "cpu":
        return f"dense copies are a CPU path (device {device.type})"
    if dtype not in (torch.bfloat16, torch.float16):
        return (
            "copies are for bf16 and fp16 models; a float32 model dequantizes each weight to "
            "float32 for batches of 256 rows or more"
        )
    if not onednn_runs(dtype):
        return f"oneDNN has no native {str(dtype).removeprefix('torch.')} kernels on this CPU"
    return None
