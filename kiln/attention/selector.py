"""Which attention backend an engine uses: `auto` picks the Triton backend on CUDA (it can be
captured in FULL CUDA graphs) and the pure-PyTorch one elsewhere; a choice that cannot run
here is an error that names the remedy."""

from __future__ import annotations

import importlib.util
import logging

import torch

from kiln.attention.backend import AttentionBackend
from kiln.attention.torch_backend import TorchPagedAttentionBackend
from kiln.errors import ConfigError

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "triton")
# every attention backend's splitting op (the Triton one registers only when triton imports)
ATTENTION_OPS = ("kiln::torch_paged_attention", "kiln::triton_paged_attention")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def select_backend(
    name: str, device: torch.device, block_size: int, dtype: torch.dtype = torch.float32
) -> AttentionBackend:
    if name not in BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_available() else "torch"
        if device.type == "cuda" and name == "torch":
            logger.warning(
                "triton is not installed: using the pure-PyTorch attention backend, which CUDA "
                "graphs cannot capture. Remedy: pip install triton"
            )
    if name == "torch":
        return TorchPagedAttentionBackend(dtype)
    return _triton_backend(block_size)


def _triton_backend(block_size: int) -> AttentionBackend:
    if not triton_available():
        raise ConfigError("attention backend 'triton' needs triton: pip install triton")
    if block_size & (block_size - 1):
        raise ConfigError(
            f"attention backend 'triton' needs a power-of-two --block-size, got {block_size}"
        )
    from kiln.attention.triton_backend import TritonPagedAttentionBackend

    return TritonPagedAttentionBackend()
