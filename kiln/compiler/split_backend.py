"""kiln's torch.compile backend: split the traced FX graph at the splitting ops, compile every
piece in between with Inductor (or, to bisect a problem, AOTAutograd alone or nothing), run the
splitting ops eagerly between them.

Dynamic shapes: the token and batch dimensions of the model's inputs are marked unbacked before
a call that Dynamo traces (precompile.py), so one compilation serves every batch size, 0 and 1
included (a backed dimension would be specialized at 0/1 and recompiled)."""

from __future__ import annotations

import copy
import logging
import time
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.passes.split_module import split_module

from kiln.compiler.direct_calls import register_direct_calls
from kiln.compiler.dump import GraphDump, dump_root
from kiln.compiler.lowerings import register_inductor_lowerings
from kiln.compiler.vec_isa_probe import VecIsaProbe, wants_probe
from kiln.config.compilation_values import qualified_op_name
from kiln.config.graph_plan import GraphPlan
from kiln.cudagraphs.piecewise import PiecewiseGraphs
from kiln.errors import ConfigError, KilnError

logger = logging.getLogger(__name__)


class ContiguityError(KilnError):
    """A tensor crossed a split boundary non-contiguous (debug mode)."""


def op_name(target: Any) -> str | None:
    """'kiln::torch_paged_attention' for an OpOverload or OpOverloadPacket, else None."""
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return schema.name
    return getattr(target, "_qualified_op_name", None)


def check_splitting_ops(names: Sequence[str], known: Sequence[str]) -> None:
    """Every splitting op must name a registered op: a misspelt one would split nothing."""
    for name in names:
        if qualified_op_name(name) in known:
            continue
        namespace, _, op = qualified_op_name(name).partition("::")
        try:
            getattr(getattr(torch.ops, namespace), op)
        except (AttributeError, RuntimeError):
            raise ConfigError(
                f"splitting_ops names {name!r}, which is not a registered op; kiln's attention "
                f"ops are {', '.join(known)} (or pass [] to compile the forward as one graph)"
            ) from None


@dataclass
class CompileStats:
    compilations: int = 0
    pieces: int = 0
    splitting_op_calls: int = 0  # splitting-op nodes in the last graph
    warmed_up: bool = False
    recompilations: int = 0
    last_recompile_reason: str | None = None  # the guard that failed, as Dynamo reported it
    # wall time of the forward calls that compiled (Dynamo's trace, this backend, one run),
    # and of this backend alone (the split, the pieces compiled or loaded from the cache)
    compile_s: float = 0.0
    backend_s: float = 0.0
    # how the forward got Dynamo's trace (precompile.py): "loaded" from the compile cache,
    # "traced and saved", or "traced (why not saved)"; "" before the first call
    trace: str = ""
    trace_load_s: float = 0.0  # reading the saved trace, before this backend ran on it
    trace_error: str | None = None  # why a trace could not be saved though aot_compile is on

    def summary(self, backend: str) -> str:
        """`1 graph, 1 piece (inductor) in 2.7 s: Dynamo's trace loaded and the first run
        1.3 s, kiln's backend 1.4 s` (the README's example)"""
        graphs = f"{self.compilations} graph{'s' if self.compilations != 1 else ''}"
        trace = {"loaded": "loaded", "traced and saved": "(saved)"}.get(self.trace, "")
        if self.trace.startswith("traced ("):
            trace = self.trace.removeprefix("traced ")
        return (
            f"{graphs}, {self.pieces} piece{'s' if self.pieces != 1 else ''} ({backend}) in "
            f"{self.compile_s:.1f} s: Dynamo's trace {trace + ' ' if trace else ''}and the "
            f"first run {self.compile_s - self.backend_s:.1f} s, kiln's backend "
            f"{self.backend_s:.1f} s"
        )


class _Piece(torch.nn.Module):
    """A compiled piece, run through the owner's PIECEWISE graphs when it has them, optionally
    checking that its outputs leave contiguous."""

    def __init__(self, name: str, fn: Callable, check: bool, owner: SplitBackend) -> None:
        super().__init__()
        self.name, self.fn, self.check, self.owner = name, fn, check, owner

    def forward(self, *args: Any) -> Any:
        graphs = self.owner.piecewise
        out = self.fn(*args) if graphs is None else graphs.call(self.name, self.fn, args)
        if self.check:
            _check_contiguous(self.name, "output", out)
        return out


class _SplitCall(torch.nn.Module):
    """A splitting-op partition, optionally checking that its inputs arrive contiguous."""

    def __init__(self, name: str, module: torch.nn.Module) -> None:
        super().__init__()
        self.name, self.inner = name, module

    def forward(self, *args: Any) -> Any:
        _check_contiguous(self.name, "input", args)
        return self.inner(*args)


def _check_contiguous(piece: str, what: str, value: Any) -> None:
    items = value if isinstance(value, (tuple, list)) else [value]
    for i, t in enumerate(items):
        if isinstance(t, torch.Tensor) and t.dim() > 0 and not t.is_contiguous():
            raise ContiguityError(
                f"{what} {i} of {piece} is not contiguous (shape {tuple(t.shape)}, "
                f"stride {t.stride()}): a strided view crossed a split boundary"
            )


def compile_piece(
    backend: str, options: dict[str, Any], gm: torch.fx.GraphModule, inputs: list
) -> Callable:
    """One piece compiled by `backend` (config.PIECE_BACKENDS), Inductor with `options`."""
    if backend == "eager":
        return gm
    from torch._inductor.compile_fx import compile_fx, graph_returns_tuple, make_graph_return_tuple

    if backend == "aot_eager":
        from torch._dynamo.backends.registry import lookup_backend

        aot_eager = lookup_backend("aot_eager")
        if graph_returns_tuple(gm):
            return aot_eager(gm, inputs)
        return make_graph_return_tuple(gm, inputs, aot_eager)  # a piece may return one tensor

    register_inductor_lowerings()
    register_direct_calls()
    with torch._inductor.config.patch(options):
        return compile_fx(gm, inputs)


@dataclass(frozen=True)
class PieceCompiler:
    """What compiles the pieces: the plan's backend and Inductor options, where to dump, and
    the CPU probe Inductor's C++ code waits on."""

    backend: str = "inductor"
    inductor_options: tuple[tuple[str, Any], ...] = ()
    dump: GraphDump | None = None
    vec_isa_probe: VecIsaProbe | None = None

    def __call__(self, gm: torch.fx.GraphModule, inputs: list) -> Callable:
        if self.vec_isa_probe is not None:
            self.vec_isa_probe.wait()
        return compile_piece(self.backend, dict(self.inductor_options), gm, inputs)


def piece_compiler(plan: GraphPlan, device: torch.device) -> PieceCompiler:
    """The plan's piece backend and Inductor options, with the dump and the CPU probe set up."""
    path = plan.requested.debug_dump_path
    dump = GraphDump(dump_root(path), plan.backend) if path else None
    options = dict(plan.inductor_options)
    probe = VecIsaProbe() if wants_probe(device.type, plan.backend, options) else None
    return PieceCompiler(plan.backend or "inductor", plan.inductor_options, dump, probe)


class SplitBackend:
    def __init__(
        self,
        splitting_ops: Sequence[str],
        debug_contiguity: bool = False,
        compiler: PieceCompiler | None = None,
        traced_code: types.CodeType | None = None,
    ) -> None:
        """`traced_code`: the code object torch.compile traces (the model's forward), whose
        failed guards explain a recompilation. Held weakly: torch keeps every backend for the
        life of the process, and the code object holds Dynamo's compiled entries."""
        self.splitting_ops = {qualified_op_name(s) for s in splitting_ops}
        self._traced_code = weakref.ref(traced_code) if traced_code is not None else None
        self.debug_contiguity = debug_contiguity
        self.compiler = compiler or PieceCompiler()
        self.stats = CompileStats()
        self.last_graph: torch.fx.GraphModule | None = None
        self.piecewise: PiecewiseGraphs | None = None  # set by the runner when the plan has them
        # why the compilation during this call would happen, where Dynamo does not know: the
        # guard of a saved trace that failed (precompile.py), worked out when asked
        self.next_recompile_reason: Callable[[], str] | None = None

    def _is_split(self, node: torch.fx.Node) -> bool:
        return node.op == "call_function" and op_name(node.target) in self.splitting_ops

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        start = time.perf_counter()
        self.stats.compilations += 1
        if self.stats.warmed_up:
            self._count_recompilation()
        split, names = self._split(gm)
        compiled, inputs = self._compile_pieces(split, names, _graph_inputs(gm, example_inputs))
        if self.compiler.dump is not None:
            self.compiler.dump.write(gm, split, names, inputs, compiled)
        for name, module in compiled.items():
            setattr(split, name, module)
        self.last_graph = split
        self.stats.backend_s += time.perf_counter() - start
        return split

    @property
    def traced_code(self) -> types.CodeType | None:
        return self._traced_code() if self._traced_code is not None else None

    def _count_recompilation(self) -> None:
        self.stats.recompilations += 1
        explain = self.next_recompile_reason
        reason = explain() if explain is not None else recompile_reason(self.traced_code)
        self.stats.last_recompile_reason = reason
        logger.warning(
            "torch.compile recompiled the model after warm-up (%d so far) because a guard "
            "failed: %s. Each recompilation costs seconds on the request path, and kiln marks "
            "a step's inputs dynamic so that none happens: please report it with this line "
            "(TORCH_LOGS=recompiles_verbose lists every guard that failed)",
            self.stats.recompilations,
            reason,
        )

    def _split(self, gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, dict[str, bool]]:
        partition, ids = 0, {}
        for node in gm.graph.nodes:
            if self._is_split(node):
                ids[node] = partition + 1
                partition += 2
            else:
                ids[node] = partition
        self.stats.splitting_op_calls = sum(1 for n in gm.graph.nodes if self._is_split(n))
        split = split_module(gm, None, lambda n: ids[n], keep_original_order=True)
        names = {
            name: any(self._is_split(n) for n in sub.graph.nodes)
            for name, sub in split.named_children()
        }
        return split, names

    def _compile_pieces(
        self, split: torch.fx.GraphModule, is_split: dict[str, bool], graph_inputs: dict[str, Any]
    ) -> tuple[dict[str, torch.nn.Module], dict[str, list]]:
        """Compile the pieces. Returns the modules that replace the split graph's children, and
        each child's inputs."""
        compiled: dict[str, torch.nn.Module] = {}
        inputs = {name: piece_inputs(sub, graph_inputs) for name, sub in split.named_children()}
        for name, sub in split.named_children():
            if not is_split[name]:
                fn = self.compiler(sub, inputs[name])
                compiled[name] = _Piece(name, fn, self.debug_contiguity, self)
            elif self.debug_contiguity:
                compiled[name] = _SplitCall(name, sub)
        self.stats.pieces = sum(1 for v in is_split.values() if not v)
        return compiled, inputs


def _graph_inputs(gm: torch.fx.GraphModule, example_inputs: list) -> dict[str, Any]:
    """The graph's inputs by placeholder name, tensors as fakes of Dynamo's fake mode. A number
    stays the value Dynamo passed: where automatic dynamic made a float attribute (an attention
    scale that differed between two engines of a process) a graph input, its traced value is an
    unbacked SymFloat, which an op taking a float cannot be compiled with."""
    from torch._subclasses.fake_tensor import FakeTensor

    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    names = [n.name for n in gm.graph.find_nodes(op="placeholder")]
    fakes = [
        fake_mode.from_tensor(x)
        if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor)
        else x
        for x in example_inputs
    ]
    return dict(zip(names, fakes, strict=True))


def piece_inputs(sub: torch.fx.GraphModule, graph_inputs: dict[str, Any]) -> list:
    """A child's inputs: the graph's own inputs, and for the values computed by an earlier
    child, the fake value Dynamo traced for them (`split_module` copies it onto the child's
    placeholder). Running the split graph on fake tensors to learn them took 0.7 s of a warm
    boot's 3.9 s backend time for the embedded model."""
    values = []
    for node in sub.graph.find_nodes(op="placeholder"):
        if node.name in graph_inputs:
            values.append(graph_inputs[node.name])
        elif "example_value" in node.meta:
            values.append(node.meta["example_value"])
        else:
            raise KilnError(
                f"input {node.name} of {sub} carries no traced value: kiln's backend compiles "
                "graphs traced by torch.compile (Dynamo) only"
            )
    return values


def recompile_reason(code: types.CodeType | None) -> str:
    """The guard failure Dynamo recorded last for `code` (it records one before each
    recompilation, whatever the logging settings), without the user stack it may append."""
    failures = torch._dynamo.utils.guard_failures.get(code) if code is not None else None
    if not failures:
        return "unknown (TORCH_LOGS=recompiles names it)"
    reason = str(failures[-1]).split("\nUser stack trace")[0].strip()
    return reason if len(reason) <= 400 else reason[:400] + "..."


def own_forward(model: torch.nn.Module) -> Callable:
    """`model.forward` with a code object of its own, for torch.compile. Dynamo keeps its
    compiled entries per code object and refuses a ninth (recompile_limit, 8 by default):
    every engine compiling the one `CausalLM.forward` added an entry there, so the ninth
    compiled engine of a process failed with FailOnRecompileLimitHit. With a code object per
    engine, the limit counts that engine's recompilations only."""
    func = type(model).forward
    code = func.__code__.replace()  # equal, but another object
    fn = types.FunctionType(code, func.__globals__, func.__name__, func.__defaults__)
    fn.__kwdefaults__, fn.__qualname__ = func.__kwdefaults__, func.__qualname__
    return types.MethodType(fn, model)


def mark_dynamic_dims(tensors: Sequence[tuple[torch.Tensor, Sequence[int]]]) -> None:
    for tensor, dims in tensors:
        for d in dims:
            torch._dynamo.decorators.mark_unbacked(tensor, d)


def restorer_of_marks(tensors: Sequence[torch.Tensor]) -> Callable[[], None]:
    """A callable that puts `tensors`' Python attributes back as they are now: Dynamo's
    dimension marks are such attributes (mark_dynamic and mark_unbacked add several, which
    differ between torch versions), and a loaded trace's guards require the marks its
    tensors had when it was traced."""
    before = [(t, {k: copy.copy(v) for k, v in vars(t).items()}) for t in tensors]

    def restore() -> None:
        for tensor, attrs in before:
            for name in set(vars(tensor)) - set(attrs):
                delattr(tensor, name)
            for name, value in attrs.items():
                setattr(tensor, name, value)

    return restore


def model_guard_filter(guards: Sequence[Any]) -> list[bool]:
    """Dynamo's guard filter for the model's forward: keep the guards on the step's inputs, on
    global state and on the model's state tensors (the KV caches, the rotary table); drop the
    rest of the guards on the model itself (`self`): its weights, module types, attribute
    values such as a layer's layout or head count, hook dictionaries.

    The model is fixed once loaded (kiln never swaps weights, adds hooks or changes attributes
    under a compiled forward, and each engine's forward is only ever called with its own model),
    and checking its ~1,500 guards before every call is a measurable share of a CPU decode step,
    and a larger one of a GPU step that PIECEWISE graphs leave bound by host time. vLLM skips
    Dynamo's guards on its compiled models altogether. A change to the inputs or a KV cache
    still recompiles, and is counted and warned about."""
    return [not _model_constant(g) for g in guards]


def _model_constant(guard: Any) -> bool:
    # torch 2.13 names a local `self`, earlier releases `L['self']`
    name = guard.name.removeprefix("L['self']").removeprefix("self")
    on_model = name != guard.name and (name == "" or name[0] in ".[")
    if not on_model or guard.guard_type in ("NO_TENSOR_ALIASING", "DUPLICATE_INPUT"):
        return False
    state_tensor = isinstance(guard.value, torch.Tensor) and not isinstance(
        guard.value, torch.nn.Parameter
    )
    return not (guard.guard_type == "TENSOR_MATCH" and state_tensor)
