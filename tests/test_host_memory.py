"""The CPU process memory settings: the KV cache faulted in at boot (`--kv-cache-prefault`)."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from kiln.boot import host_memory

SIZE = 64 * 2**20


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _fresh(maps: list) -> torch.Tensor:
    """A tensor on an anonymous mapping of its own: untouched pages, whatever glibc's
    thresholds are in this process."""
    maps.append(mmap.mmap(-1, SIZE))
    return torch.frombuffer(maps[-1], dtype=torch.uint8)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
@pytest.mark.parametrize("advice", [host_memory.MADV_POPULATE_WRITE, 10_000])
def test_fault_in_makes_the_pages_resident_and_zero(monkeypatch, advice):
    """With MADV_POPULATE_WRITE, or (an advice the kernel refuses) by writing zeros."""
    monkeypatch.setattr(host_memory, "MADV_POPULATE_WRITE", advice)
    maps: list = []
    tensors = [_fresh(maps), _fresh(maps)]
    before = _resident()
    seconds = host_memory.fault_in(tensors)
    assert seconds >= 0
    assert _resident() - before > 0.9 * 2 * SIZE
    assert all(int(t.count_nonzero()) == 0 for t in tensors)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_fault_in_takes_the_whole_storage_of_a_view():
    """A tensor that starts inside its storage: the storage's pages, none past its end."""
    maps: list = []
    view = _fresh(maps)[4096 + 7 :]
    before = _resident()
    host_memory.fault_in([view])
    assert _resident() - before > 0.9 * SIZE
