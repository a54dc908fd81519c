"""Inductor's C++ backend learns which vector instruction sets (AVX2, AVX512, ...) this CPU and
compiler can run by building a test library for each and loading it in a child process. It does
so once per process, on the first compilation or compile-cache load, and on the embedded model's
warm boot that took 1.2 s of the backend's 3.9 s. Nothing in it depends on the model, so kiln
starts it in a thread when a compiled CPU engine is built, and it runs while Dynamo traces the
forward. Inductor then reads the cached answer: the result is the one it would have computed."""

from __future__ import annotations

import threading
from typing import Any


class VecIsaProbe:
    def __init__(self) -> None:
        # Imported here, not in the thread: a module imported by two threads at once can
        # deadlock on Python's import locks, and the main thread imports these to compile.
        import torch._inductor.codecache  # noqa: F401
        from torch._inductor import cpu_vec_isa

        self._thread = threading.Thread(
            target=cpu_vec_isa.valid_vec_isa_list, name="kiln-vec-isa-probe", daemon=True
        )
        self._thread.start()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Return once the probe has finished (it caches its answer in Inductor)."""
        self._thread.join()


def wants_probe(device_type: str, backend: str | None, options: dict[str, Any]) -> bool:
    """Only Inductor's CPU code uses the answer. An explicit `cpp.vec_isa_ok` must take effect
    when Inductor runs the check itself, under that option."""
    return device_type == "cpu" and backend == "inductor" and "cpp.vec_isa_ok" not in options
