"""Calls of the compiled forward that already passed its guards, so that an identical call
skips them.

Checking the saved trace's guards costs 0.2-1 ms a call on the CPU (measured in a decode step
of the embedded model: ~0.9 ms of a 14 ms step, the guard tree's accessors walked with cold
caches), while a decode step calls the forward with the same persistent buffers, in the
same shapes, step after step. A call is identified by everything the guards could read that
can change from one call to the next: each input tensor's dtype, device, shape, strides,
inference-ness and requires_grad, which inputs are the same tensor, every other input value,
and the grad and inference modes. An identical call passes the same guards; any other
call is checked in full, as before, and a failure still falls back to Dynamo, counted and
warned about. What the guards read that this leaves out is fixed for the engine's life: the
model (whose guards `model_guard_filter` already drops) and the global state the runner sets."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

MAX_REMEMBERED = 4096  # distinct calls kept (a step's shapes: a few hundred in practice)


class PassedCalls:
    """The identities of calls whose guards passed; forgotten all at once when full."""

    def __init__(self, limit: int = MAX_REMEMBERED) -> None:
        self.limit = limit
        self._passed: set[tuple] = set()

    def __contains__(self, key: tuple | None) -> bool:
        return key is not None and key in self._passed

    def add(self, key: tuple | None) -> None:
        if key is None:
            return
        if len(self._passed) >= self.limit:
            self._passed.clear()
        self._passed.add(key)

    def __len__(self) -> int:
        return len(self._passed)


def call_key(args: tuple) -> tuple | None:
    """The identity of a call with `args`; None where one part cannot be keyed (an object of
    an unknown kind): such a call always takes the full guard check."""
    try:
        parts = _Keys().of(args)
    except _Unkeyable:
        return None
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), parts)


class _Unkeyable(Exception):
    pass


class _Keys:
    """Keys of one call's values. A tensor is keyed by what Dynamo's tensor guards compare,
    and by which earlier tensor of the call it is (the same object twice is an aliasing the
    guards check), not by its address: a step's small metadata tensors are new each step."""

    def __init__(self) -> None:
        self.seen: dict[int, int] = {}

    def of(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            same = self.seen.setdefault(id(value), len(self.seen))
            return (
                same, value.dtype, value.device, value.shape, value.stride(),
                value.is_inference(), value.requires_grad,
            )  # fmt: skip
        if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
            return value
        if isinstance(value, (tuple, list)):
            return (type(value), tuple(self.of(v) for v in value))
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = dataclasses.fields(value)
            return (type(value), tuple(self.of(getattr(value, f.name)) for f in fields))
        raise _Unkeyable
