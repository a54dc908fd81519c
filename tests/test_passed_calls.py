"""The identity of a compiled forward's call (kiln/compiler/passed_calls.py): what lets a call
identical to one that passed the saved trace's guards skip them. Every property a guard reads
and a step may change must change the key; a step's new tensors of the same shape must not."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.compiler.passed_calls import PassedCalls, call_key


@dataclass
class _Meta:
    slots: torch.Tensor
    lens: torch.Tensor | None
    width: int


_DEFAULT = object()


def _args(ids=None, positions=None, lens=_DEFAULT, width=4):
    ids = torch.zeros(3, dtype=torch.long) if ids is None else ids
    positions = torch.arange(3) if positions is None else positions
    lens = torch.ones(2, dtype=torch.int32) if lens is _DEFAULT else lens
    return ids, positions, _Meta(torch.arange(3), lens, width)


def test_a_steps_new_tensors_of_the_same_kind_are_the_same_call():
    with torch.inference_mode():
        assert call_key(_args()) == call_key(_args())
        assert call_key(_args()) is not None


def test_what_a_guard_reads_changes_the_key():
    with torch.inference_mode():
        base = call_key(_args())
        changed = [
            _args(positions=torch.arange(3, dtype=torch.int32)),  # dtype
            _args(ids=torch.zeros(4, dtype=torch.long)),  # shape
            _args(lens=torch.ones(2, 2, dtype=torch.int32).t()[0]),  # stride
            _args(lens=None),  # a field's None-ness
            _args(width=8),  # a plain value
        ]
        assert [call_key(args) != base for args in changed] == [True] * len(changed)
    with torch.no_grad():  # outside inference mode: ordinary tensors, other global state
        outside = call_key(_args())
        assert outside != base
        x = torch.zeros(3)
        assert call_key((x,)) != call_key((torch.zeros(3, requires_grad=True),))


def test_the_same_tensor_twice_is_another_call():
    """Dynamo guards against one tensor passed as two inputs (aliasing)."""
    with torch.inference_mode():
        ids = torch.zeros(3, dtype=torch.long)
        assert call_key((ids, ids)) != call_key((ids, torch.zeros(3, dtype=torch.long)))


def test_grad_mode_changes_the_key():
    x = torch.zeros(3)
    with torch.no_grad():
        off = call_key((x,))
    with torch.enable_grad():
        assert call_key((x,)) != off


def test_an_unknown_argument_is_never_skipped():
    passed = PassedCalls()
    key = call_key((torch.zeros(2), object()))
    assert key is None
    passed.add(key)
    assert key not in passed and len(passed) == 0


def test_the_remembered_calls_are_bounded():
    passed = PassedCalls(limit=3)
    keys = [call_key((torch.zeros(n),)) for n in range(1, 5)]
    for key in keys[:3]:
        passed.add(key)
    assert all(key in passed for key in keys[:3])
    passed.add(keys[3])  # full: forgotten all at once, then this one kept
    assert len(passed) == 1 and keys[3] in passed and keys[0] not in passed
