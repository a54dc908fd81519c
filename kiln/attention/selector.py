"""Which attention backend an engine uses: `auto` picks the Triton backend on CUDA (it can be
captured in FULL CUDA graphs) and the CPU one (reads the paged cache in place) on the CPU; the
pure-PyTorch backend, `torch`, runs on both and is the reference. A choice that cannot run here
is an error that names the remedy."""

from __future__ import annotations

import importlib.util
import logging

import torch

from kiln.attention.backend import AttentionBackend, AttentionShape
from kiln.attention.cpu_backend import CpuPagedAttentionBackend
from kiln.attention.cpu_metadata import CpuAttentionTuning
from kiln.attention.torch_backend import TorchPagedAttentionBackend
from kiln.errors import ConfigError

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "cpu", "cpu-flash", "torch", "triton")
# every attention backend's splitting op (the Triton one registers only when triton imports)
ATTENTION_OPS = (
    "kiln::cpu_paged_attention",
    "kiln::torch_paged_attention",
    "kiln::triton_paged_attention",
)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def select_backend(
    name: str,
    device: torch.device,
    block_size: int,
    shape: AttentionShape,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """`dtype` is the model's, `kv_dtype` the cache's (None: the model's)."""
    if name not in BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    if name == "auto":
        name = "cpu" if device.type == "cpu" else "torch"
        name = "triton" if device.type == "cuda" and triton_available() else name
        if device.type == "cuda" and name == "torch":
            logger.warning(
                "triton is not installed: using the pure-PyTorch attention backend, which CUDA "
                "graphs cannot capture. Remedy: pip install triton"
            )
    if kv_dtype == torch.int8 and name == "triton":
        raise ConfigError(
            "--kv-cache-dtype int8 is read by the CPU attention backends and the pure-PyTorch "
            "one; the Triton backend has no int8 path. Remedy: --kv-cache-dtype bfloat16 (or "
            "auto), or --attention-backend torch"
        )
    if name == "torch":
        return TorchPagedAttentionBackend(dtype)
    if name in ("cpu", "cpu-flash"):
        if device.type != "cpu":
            raise ConfigError(
                f"attention backend {name!r} runs on the CPU only (its kernels are CPU code), "
                f"not on {device.type}. Remedy: --attention-backend auto"
            )
        kernel = "off" if name == "cpu-flash" else "auto"
        tuning = CpuAttentionTuning(decode_kernel=kernel, prefill_kernel=kernel)
        return CpuPagedAttentionBackend(dtype, shape, tuning, kv_dtype or dtype)
    return _triton_backend(block_size, shape, device)


def _triton_backend(
    block_size: int, shape: AttentionShape, device: torch.device
) -> AttentionBackend:
    if not triton_available():
        raise ConfigError("attention backend 'triton' needs triton: pip install triton")
    if block_size & (block_size - 1):
        raise ConfigError(
            f"attention backend 'triton' needs a power-of-two --block-size, got {block_size}"
        )
    import triton

    from kiln.attention import triton_backend

    check_triton_runs(device, triton_backend.INTERPRETED, triton.__version__)
    return triton_backend.TritonPagedAttentionBackend(shape)


def check_triton_runs(device: torch.device, interpreted: bool, version: str) -> None:
    """The Triton kernel runs compiled on a CUDA device, or in Triton's CPU interpreter (tests);
    anything else would fail at the first step, so it fails here, naming the remedy."""
    if device.type != "cuda" and not interpreted:
        raise ConfigError(
            "attention backend 'triton' needs a CUDA device: on the CPU its kernel runs only in "
            "Triton's interpreter (TRITON_INTERPRET=1 set before kiln starts; slow, for "
            "tests). Remedy: --attention-backend cpu, the CPU default"
        )
    major_minor = tuple(int(part) for part in version.split(".")[:2])
    if interpreted and major_minor < (3, 9):
        raise ConfigError(
            f"Triton's CPU interpreter runs kiln's attention kernel from triton 3.9 on (its "
            f"loops' bounds are loaded from memory); this is triton {version}. Remedy: pip "
            f"install 'triton>=3.9,<3.10', or --attention-backend torch"
        )
