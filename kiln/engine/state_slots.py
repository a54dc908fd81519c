"""State slots: for a hybrid model, the fixed-size state (Gated DeltaNet's convolution inputs and
delta-rule matrices) of each running sequence lives in one slot of per-layer state tensors.
A sequence takes a slot when it is admitted and gives it back when it finishes, is aborted or
is preempted (a preempted sequence is recomputed from its first token into a fresh slot)."""

from __future__ import annotations


class StateSlots:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self) -> int:
        if not self._free:
            raise RuntimeError("no free state slot: the scheduler admitted past max_num_seqs")
        return self._free.pop()

    def give_back(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeError(f"state slot {slot} given back twice or never taken")
        self._free.append(slot)
