"""Dynamo's trace of the forward, saved in the compile cache entry and loaded by later boots
(torch's AOT compile: `torch.compile(...).aot_compile`, `torch.compiler.load_compiled_function`).

Without it, a warm compiled boot traces the forward again with Dynamo (a large share of the
boot) only to find every piece in the AOTAutograd and Inductor caches. The saved trace holds
Dynamo's graph, its guards and the bytecode that calls the graph; loading it runs kiln's
backend on that graph, which finds the pieces in the entry's caches.

The guards stay: each call checks the loaded guards (the inputs' dtypes, ranks and devices,
the KV caches, global state) as Dynamo would have, and a call that fails them falls back to
Dynamo, which traces it and counts a recompilation. A call identical to one that passed
(the same kind of inputs in the same shapes: kiln/compiler/passed_calls.py) skips the check.
Dimension marks are put on the inputs only for a call that traces: a loaded guard requires a
tensor's marks to be what they were when it was traced, and torch saves the trace without
them."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.compiler.passed_calls import PassedCalls, call_key
from kiln.compiler.split_backend import (
    SplitBackend,
    model_guard_filter,
    own_forward,
    piece_compiler,
)
from kiln.config.graph_plan import GraphPlan
from kiln.paths import write_atomically

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TraceFile:
    """Where an engine's saved trace lives in its compile cache entry. The entry's key covers
    the model and the compilation; the trace also specializes on the runner's static shapes
    (the block size, the persistent input buffers' lengths) and the weights' shapes, so each
    set has a file of its own. Saved into a sealed entry too, under a name nobody else
    writes to differently: readers see the whole file or none (written atomically)."""

    path: Path

    @classmethod
    def in_entry(cls, entry: Path, device: torch.device, static: dict[str, Any]) -> TraceFile:
        digest = hashlib.sha256(json.dumps(static, sort_keys=True).encode()).hexdigest()[:16]
        return cls(entry / "dynamo" / f"forward-{device.type}{device.index or 0}-{digest}.bin")


def compiled_forward(
    model: torch.nn.Module,
    plan: GraphPlan,
    device: torch.device,
    trace_file: TraceFile | None,
    mark_for_trace: Callable[[tuple], Callable[[], None]],
    no_trace_file: str,
) -> PrecompiledForward:
    """Mode 3: the model's forward through kiln's split backend, its trace saved (or loaded)."""
    forward = own_forward(model)
    backend = SplitBackend(
        plan.splitting_ops,
        plan.requested.debug_contiguity,
        piece_compiler(plan, device),
        traced_code=forward.__code__,
    )
    return PrecompiledForward(
        forward, backend, model_guard_filter, trace_file, mark_for_trace, no_trace_file
    )


class PrecompiledForward:
    """The runner's compiled forward: the saved trace when there is one (else traced and
    saved), Dynamo where the loaded guards fail or no trace can be saved."""

    def __init__(
        self,
        forward: Callable,
        backend: SplitBackend,
        guard_filter: Callable[[Sequence[Any]], list[bool]],
        trace_file: TraceFile | None,
        mark_for_trace: Callable[[tuple], Callable[[], None]],
        no_trace_file: str = "",
    ) -> None:
        """`forward`: the model's bound forward; `mark_for_trace(args)` marks the dynamic
        dimensions of a call's inputs and of the KV caches before Dynamo traces it, and
        returns what takes the KV caches' marks off again;
        `no_trace_file`: why `trace_file` is None."""
        self.model = forward.__self__
        self.forward, self.backend, self.guard_filter = forward, backend, guard_filter
        self.trace_file, self.mark_for_trace = trace_file, mark_for_trace
        self.no_trace_file = no_trace_file
        self.dynamo = torch.compile(
            forward, backend=backend, fullgraph=True, options={"guard_filter_fn": guard_filter}
        )
        self.saved: Any = None  # the AOTCompiledFunction, loaded or traced here
        self.passed = PassedCalls()  # calls whose guards passed: identical ones skip them
        self.stats = backend.stats  # its `trace` says how the forward got its trace

    def __call__(self, *args: Any) -> Any:
        if not self.stats.trace:
            self.saved = self._load() or self._trace_and_save(args)
        saved = self.saved
        if saved is None:
            self.mark_for_trace(args)
            return self.dynamo(*args)
        key = call_key(args)
        if key in self.passed:
            return saved.fn(self.model, *args)
        if saved.guard_check(self.model, *args):
            self.passed.add(key)
            return saved.fn(self.model, *args)
        return self._guard_failed(args)

    def _guard_failed(self, args: tuple) -> Any:
        """Dynamo runs the call. After warm-up, a trace it makes is a recompilation, counted
        and warned about by the backend with the saved guard that failed (worked out only
        then); before, the saved trace did not fit the engine, a kiln bug."""
        if not self.stats.warmed_up:
            logger.warning(
                "a guard of the saved Dynamo trace failed during warm-up (%s): Dynamo traces "
                "the forward again. Please report it with this line",
                self._guard_failure(args),
            )
        self.backend.next_recompile_reason = lambda: self._guard_failure(args)
        unmark = self.mark_for_trace(args)
        try:
            return self.dynamo(*args)
        finally:
            self.backend.next_recompile_reason = None  # Dynamo's own guards may have passed
            # the KV caches as the loaded guards expect them: left marked, they would fail
            # every later step (Dynamo's guards take unmarked tensors too)
            unmark()

    def _guard_failure(self, args: tuple) -> str:
        f_locals = self.saved.prepare_f_locals(self.model, *args)
        info = self.saved._artifacts.guard_manager.check_verbose(f_locals)
        return "; ".join(getattr(info, "verbose_code_parts", None) or [str(info)])

    def _load(self) -> Any:
        """The saved trace, bound to kiln's backend (which compiles it at the first call, its
        errors the user's to see); None when there is none or it cannot be read."""
        tf = self.trace_file
        if tf is None or not tf.path.is_file():
            return None
        start = time.perf_counter()
        try:
            saved = self._deserialize(tf.path.read_bytes())
        except Exception as exc:  # whatever makes it unreadable: trace as if none were saved
            logger.warning(
                "the saved Dynamo trace %s could not be loaded (%s: %s): tracing the forward "
                "again (3-4 s for a small model). `kiln cache clear` removes the entry, and "
                '"aot_compile": false stops saving traces',
                tf.path,
                type(exc).__name__,
                exc,
            )
            return None
        self.stats.trace_load_s = time.perf_counter() - start
        saved._artifacts.compiled_fn.bind(self.backend)  # compiles at the first call
        self.stats.trace = "loaded"
        return saved

    def _trace_and_save(self, args: tuple) -> Any:
        """Trace with torch's aot_compile and save the trace. What compiles at the first call
        is what a later boot will load: the graph as saved, not as traced (AOTAutograd's
        cache key covers the graph, and only the saved one is the same in every process)."""
        tf = self.trace_file
        if tf is None:
            self.stats.trace = f"traced (not saved: {self.no_trace_file})"
            return None
        self.mark_for_trace(args)
        try:
            traced = self._aot_compile(args)
            data = type(traced).serialize(traced).serialized_data
            saved_graph = self._deserialize(data)._artifacts.compiled_fn.graph
        except Exception as exc:  # whatever torch refuses: Dynamo as before, said once
            return self._not_saved("traced", exc)
        try:
            write_atomically(tf.path, data)
        except OSError as exc:  # this boot runs the trace; only later boots lose it
            self._not_saved("written", exc)
        else:
            self.stats.trace = "traced and saved"
        # this process keeps the guards as traced (those loaded from the file expect no
        # dimension marks, and the KV caches keep theirs from the trace), with the graph as saved
        traced._artifacts.compiled_fn.graph = saved_graph
        traced._artifacts.compiled_fn.bind(self.backend)
        return traced

    def _not_saved(self, step: str, exc: Exception) -> None:
        text = str(exc).strip()
        reason = f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:300]
        self.stats.trace = f"traced (not saved: {reason})"
        self.stats.trace_error = reason
        logger.warning(
            "Dynamo's trace of the forward could not be %s for the compile cache (%s): later "
            'boots trace the forward again ("aot_compile": false skips the attempt). Please '
            "report it with this line",
            step,
            reason,
        )

    def _aot_compile(self, args: tuple) -> Any:
        """Dynamo's trace of a call; kiln's backend does not run on it here."""
        from kiln.compiler.saved_graph import SavedGraph  # imports Dynamo: mode 3 only

        # automatic dynamic off: it makes whatever differed between earlier compilations of
        # the forward in this process (a block size, an attention scale) symbolic, so a saved
        # trace would depend on the process's history; kiln marks what is dynamic itself
        config = {"enable_aot_compile": True, "automatic_dynamic_shapes": False}
        with torch._dynamo.config.patch(config):  # aot_compile: off by default in torch 2.11
            compiled = torch.compile(
                self.forward,
                backend=lambda gm, example_inputs: SavedGraph(gm),
                fullgraph=True,
                options={"guard_filter_fn": self._serializable_guards},
            )
            return compiled.aot_compile((args, {}))

    def _deserialize(self, data: bytes) -> Any:
        """A saved trace, its bytecode bound to the forward's module globals: the bytecode may
        name one (`torch`, for a symbolic shape Dynamo computes in Python), and torch refuses
        a trace whose globals it is not given."""
        from torch._dynamo.aot_compile import AOTCompiledFunction

        return AOTCompiledFunction.deserialize(data, f_globals=self.forward.__func__.__globals__)

    def _serializable_guards(self, guards: Sequence[Any]) -> list[bool]:
        """The runner's guards, less those torch cannot save: on globals (modules, functions:
        the code that the cache key's source hash covers) and of unsaveable kinds."""
        from torch._dynamo.guards import CheckFunctionManager

        unsaveable = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
        keep = self.guard_filter(guards)
        return [k and not (g.is_global or g.guard_type in unsaveable) for k, g in zip(keep, guards)]
