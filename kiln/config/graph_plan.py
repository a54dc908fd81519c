"""The graph plan: one pure function from the requested compilation config and what the device
and the attention backend can do, to a frozen plan. Every change it makes is a PlanChange with
the reason and the remedy; the engine logs each as a WARNING, and strict mode refuses them."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field, replace
from typing import Any

from kiln.config.compilation import CompilationConfig
from kiln.config.compilation_values import CUDAGraphMode
from kiln.config.inductor_options import shown_options
from kiln.config.vllm_fields import unused_vllm_fields
from kiln.errors import ConfigError


class GraphSupport(enum.Enum):
    """How much of a step a backend can run inside one captured CUDA graph."""

    ALWAYS = "always"  # any batch, mixed prefill and decode included
    UNIFORM_BATCH = "uniform_batch"  # batches where every request has the same query length
    UNIFORM_SINGLE_TOKEN_DECODE = "uniform_single_token_decode"  # pure 1-token decode only
    NEVER = "never"  # must run eagerly (a splitting op)


class RuntimeMode(enum.Enum):
    """What one step actually ran."""

    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"


# cudagraph mode -> (decode mode, mixed mode)
_PARTS = {
    CUDAGraphMode.NONE: (RuntimeMode.NONE, RuntimeMode.NONE),
    CUDAGraphMode.PIECEWISE: (RuntimeMode.PIECEWISE, RuntimeMode.PIECEWISE),
    CUDAGraphMode.FULL: (RuntimeMode.FULL, RuntimeMode.FULL),
    CUDAGraphMode.FULL_DECODE_ONLY: (RuntimeMode.FULL, RuntimeMode.NONE),
    CUDAGraphMode.FULL_AND_PIECEWISE: (RuntimeMode.FULL, RuntimeMode.PIECEWISE),
}


@dataclass(frozen=True)
class DeviceCaps:
    type: str  # "cpu" or "cuda"
    cuda_graphs: bool  # whether kiln can capture and replay CUDA graphs here
    why_not: str = ""  # when cuda_graphs is False

    @classmethod
    def cpu(cls) -> DeviceCaps:
        return cls("cpu", False, "the CPU has no CUDA graphs")


@dataclass(frozen=True)
class AttentionCaps:
    name: str
    graph_support: GraphSupport
    splitting_ops: tuple[str, ...]


@dataclass(frozen=True)
class PlanChange:
    field: str
    requested: str
    resolved: str
    reason: str
    remedy: str

    def message(self) -> str:
        return (
            f"{self.field} {self.requested} -> {self.resolved}: {self.reason}. "
            f"Remedy: {self.remedy}"
        )


@dataclass(frozen=True)
class GraphPlan:
    requested: CompilationConfig
    mode: int
    cudagraph_mode: CUDAGraphMode
    decode_mode: RuntimeMode  # uniform decode batches
    mixed_mode: RuntimeMode  # every other batch
    decode_capture_sizes: tuple[int, ...]
    mixed_capture_sizes: tuple[int, ...]
    splitting_ops: tuple[str, ...]
    uniform_decode_query_len: int
    changes: tuple[PlanChange, ...] = field(default_factory=tuple)
    # a backend that runs any batch in a FULL graph replays the decode graphs for single-token
    # decodes too (steps that verify no drafts); others for uniform_decode_query_len only
    single_token_decodes: bool = False
    backend: str | None = None  # what compiles the pieces (mode 3), None in mode 0
    inductor_options: tuple[tuple[str, Any], ...] = ()  # applied when backend is inductor

    def to_dict(self) -> dict:
        return {
            "requested": self.requested.to_dict(),
            "mode": self.mode,
            "cudagraph_mode": self.cudagraph_mode.value,
            "decode_mode": self.decode_mode.value,
            "mixed_mode": self.mixed_mode.value,
            "decode_capture_sizes": list(self.decode_capture_sizes),
            "mixed_capture_sizes": list(self.mixed_capture_sizes),
            "splitting_ops": list(self.splitting_ops),
            "uniform_decode_query_len": self.uniform_decode_query_len,
            "single_token_decodes": self.single_token_decodes,
            "backend": self.backend,
            "inductor_compile_config": shown_options(self.inductor_options),
            "changes": [vars(c) for c in self.changes],
        }


def show(value: Any) -> str:
    """A requested value as the plan reports it: None is the device's default."""
    if value is None:
        return "(default)"
    return value.value if isinstance(value, enum.Enum) else str(value)


def default_capture_sizes(max_size: int) -> tuple[int, ...]:
    """vLLM's ladder: 1, 2, 4, then every multiple of 8."""
    return tuple(s for s in (1, 2, 4, *range(8, max_size + 1, 8)) if s <= max_size)


@dataclass
class _Resolution:
    """Mutable scratch state of one resolution; the result is frozen into a GraphPlan."""

    mode: int
    graph: CUDAGraphMode
    changes: list[PlanChange]

    def change(self, field_name: str, to, reason: str, remedy: str) -> None:
        old = self.graph if field_name == "cudagraph_mode" else self.mode
        if old == to:
            return
        self.changes.append(PlanChange(field_name, show(old), show(to), reason, remedy))
        if field_name == "cudagraph_mode":
            self.graph = to
        else:
            self.mode = to


def resolve_graph_plan(
    requested: CompilationConfig,
    device: DeviceCaps,
    attention: AttentionCaps,
    *,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    uniform_decode_query_len: int = 1,
    enforce_eager: bool = False,
    strict: bool = False,
) -> GraphPlan:
    """Resolve what will run. Pure: same inputs, same plan; logging is the caller's job."""
    r = _start(requested, device, enforce_eager)
    _resolve_device(r, device)
    _resolve_compilation(r)
    _resolve_backend(r, attention, uniform_decode_query_len)
    requested_splits = requested.splitting_ops
    splitting = attention.splitting_ops if requested_splits is None else requested_splits
    _resolve_splitting(r, attention, splitting)
    decode_mode, mixed_mode = _PARTS[r.graph]
    decode_sizes, mixed_sizes = _resolve_sizes(
        r,
        requested,
        decode_mode,
        mixed_mode,
        max_num_batched_tokens,
        max_num_seqs,
        uniform_decode_query_len,
    )
    backend, inductor_options = _resolve_compiler(r, requested, enforce_eager)
    _report_vllm_only(r, requested)
    if requested_splits is None and RuntimeMode.PIECEWISE not in (decode_mode, mixed_mode):
        splitting = _unsplit_by_default(backend, splitting)
    if strict and r.changes:
        raise ConfigError(
            "--strict-graphs: the requested compilation config cannot run as asked:\n"
            + "\n".join(f"  - {c.message()}" for c in r.changes)
        )
    return GraphPlan(
        requested=requested,
        mode=r.mode,
        cudagraph_mode=r.graph,
        decode_mode=decode_mode,
        mixed_mode=mixed_mode,
        decode_capture_sizes=decode_sizes,
        mixed_capture_sizes=mixed_sizes,
        splitting_ops=tuple(splitting) if r.mode == 3 else (),
        uniform_decode_query_len=uniform_decode_query_len,
        changes=tuple(r.changes),
        single_token_decodes=uniform_decode_query_len == 1
        or attention.graph_support is GraphSupport.ALWAYS,
        backend=backend,
        inductor_options=inductor_options,
    )


def _unsplit_by_default(backend: str | None, splitting: tuple[str, ...]) -> tuple[str, ...]:
    """Where nothing replays pieces, the forward compiles as one Inductor graph by default,
    the attention op inside as an extern call: no per-piece call overhead (a few percent of a
    CPU decode step, for a slower first compilation: docs/performance.md). Not under
    aot_eager: without Inductor to reinplace it, AOTAutograd's functional KV cache write
    copies every layer's whole cache each step, over ten times the split graph's step."""
    return () if backend != "aot_eager" else splitting


def _start(requested: CompilationConfig, device: DeviceCaps, enforce_eager: bool) -> _Resolution:
    """The request with the device's defaults filled in (no warning), then --enforce-eager."""
    default_graph = CUDAGraphMode.FULL_AND_PIECEWISE if device.cuda_graphs else CUDAGraphMode.NONE
    r = _Resolution(
        mode=requested.mode if requested.mode is not None else (3 if device.cuda_graphs else 0),
        graph=requested.cudagraph_mode or default_graph,
        changes=[],
    )
    if enforce_eager:
        r.change("mode", 0, "--enforce-eager was given", "drop --enforce-eager to compile")
        r.change(
            "cudagraph_mode",
            CUDAGraphMode.NONE,
            "--enforce-eager was given",
            "drop --enforce-eager to use CUDA graphs",
        )
    return r


def _resolve_device(r: _Resolution, device: DeviceCaps) -> None:
    if not device.cuda_graphs and r.graph is not CUDAGraphMode.NONE:
        still = " (mode 3 still compiles the model)" if r.mode == 3 else ""
        r.change(
            "cudagraph_mode",
            CUDAGraphMode.NONE,
            f"{device.why_not}{still}",
            'run on a CUDA GPU, or set "cudagraph_mode": "NONE"',
        )


def _resolve_compilation(r: _Resolution) -> None:
    """Piecewise graphs replay the compiled pieces, so they need mode 3."""
    if r.mode == 3:
        return
    why = "piecewise CUDA graphs need the compiled pieces of mode 3"
    if r.graph is CUDAGraphMode.PIECEWISE:
        r.change("cudagraph_mode", CUDAGraphMode.NONE, why, 'set "mode": 3')
    elif r.graph is CUDAGraphMode.FULL_AND_PIECEWISE:
        r.change(
            "cudagraph_mode",
            CUDAGraphMode.FULL_DECODE_ONLY,
            why + "; the FULL decode graphs are kept",
            'set "mode": 3',
        )


def _resolve_compiler(
    r: _Resolution, req: CompilationConfig, enforce_eager: bool
) -> tuple[str | None, tuple[tuple[str, Any], ...]]:
    """What compiles the pieces, and with which Inductor options. Each compiler setting that
    cannot take effect is a change: a user who asked for a dump or an option and got nothing
    would look for it."""
    backend = (req.backend or "inductor") if r.mode == 3 else None
    options = req.inductor_compile_config or ()
    unused = {
        "backend": req.backend not in (None, "inductor") and r.mode != 3,
        "debug_dump_path": req.debug_dump_path is not None and r.mode != 3,
        "inductor_compile_config": bool(options) and backend != "inductor",
    }
    for name, is_unused in unused.items():
        if is_unused:
            r.changes.append(_unused_compiler_setting(name, req, r.mode, enforce_eager))
    return backend, options if backend == "inductor" else ()


def _unused_compiler_setting(
    name: str, req: CompilationConfig, mode: int, enforce_eager: bool
) -> PlanChange:
    if name == "inductor_compile_config":
        value: Any = shown_options(req.inductor_compile_config or ())
    else:
        value = getattr(req, name)
    if mode != 3:
        reason = "mode 0 compiles nothing" + (" (--enforce-eager)" if enforce_eager else "")
        remedy = "drop --enforce-eager" if enforce_eager else 'set "mode": 3'
    else:
        reason = f"backend {req.backend} does not run Inductor"
        remedy = 'drop "backend" (Inductor is the default) or the Inductor options'
    return PlanChange(name, json.dumps(value, default=str), "(unused)", reason, remedy)


def _report_vllm_only(r: _Resolution, req: CompilationConfig) -> None:
    """vLLM's settings for machinery kiln does not have: each that asks for something."""
    for name, value, why in unused_vllm_fields(req.vllm_only):
        shown = json.dumps(value, default=str)
        r.changes.append(PlanChange(name, shown, "(unused)", why.reason, why.remedy))


def _decode_supported(support: GraphSupport, query_len: int) -> bool:
    if support is GraphSupport.ALWAYS or support is GraphSupport.UNIFORM_BATCH:
        return True
    return support is GraphSupport.UNIFORM_SINGLE_TOKEN_DECODE and query_len == 1


def _resolve_backend(r: _Resolution, att: AttentionCaps, query_len: int) -> None:
    level = f"attention backend {att.name} supports CUDA graphs: {att.graph_support.value}"
    decode_ok = _decode_supported(att.graph_support, query_len)
    if r.graph is CUDAGraphMode.FULL and att.graph_support is not GraphSupport.ALWAYS:
        if decode_ok:
            to = CUDAGraphMode.FULL_AND_PIECEWISE if r.mode == 3 else CUDAGraphMode.FULL_DECODE_ONLY
        else:
            to = CUDAGraphMode.PIECEWISE if r.mode == 3 else CUDAGraphMode.NONE
        r.change(
            "cudagraph_mode",
            to,
            f"{level}, so mixed batches cannot run in a FULL graph",
            "use a backend with 'always' support, or request this mode explicitly",
        )
        return
    if (
        r.graph in (CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE)
        and not decode_ok
    ):
        to = (
            CUDAGraphMode.PIECEWISE
            if r.graph is CUDAGraphMode.FULL_AND_PIECEWISE
            else CUDAGraphMode.NONE
        )
        r.change(
            "cudagraph_mode",
            to,
            f"{level}; decode batches of {query_len} token(s) per request cannot be captured",
            "use a backend that supports uniform batches",
        )


def _resolve_splitting(r: _Resolution, att: AttentionCaps, splitting: tuple[str, ...]) -> None:
    """With the attention op left inside the compiled graph, piecewise graphs would capture it."""
    if r.mode != 3 or att.graph_support is GraphSupport.ALWAYS:
        return
    if any(op in splitting for op in att.splitting_ops):
        return
    to = {
        CUDAGraphMode.PIECEWISE: CUDAGraphMode.NONE,
        CUDAGraphMode.FULL_AND_PIECEWISE: CUDAGraphMode.FULL_DECODE_ONLY,
    }.get(r.graph, r.graph)
    r.change(
        "cudagraph_mode",
        to,
        f"splitting_ops leaves out {att.name}'s attention op, which cannot be captured",
        f"keep {', '.join(att.splitting_ops)} in splitting_ops",
    )


def _resolve_sizes(
    r: _Resolution,
    req: CompilationConfig,
    decode_mode: RuntimeMode,
    mixed_mode: RuntimeMode,
    budget: int,
    max_num_seqs: int,
    query_len: int,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if decode_mode is RuntimeMode.NONE and mixed_mode is RuntimeMode.NONE:
        return (), ()
    limit = min(req.max_cudagraph_capture_size or 512, budget)
    sizes = req.cudagraph_capture_sizes or default_capture_sizes(limit)
    too_big = [s for s in sizes if s > limit]
    if too_big and req.cudagraph_capture_sizes:
        _note(
            r,
            "cudagraph_capture_sizes",
            too_big,
            f"above the token budget/max capture size {limit}",
            "raise --max-num-batched-tokens or max_cudagraph_capture_size",
        )
    sizes = tuple(s for s in sizes if s <= limit)
    mixed = sizes if mixed_mode is not RuntimeMode.NONE else ()
    decode: tuple[int, ...] = ()
    if decode_mode is not RuntimeMode.NONE:
        rounded = sorted({-(-s // query_len) * query_len for s in sizes})
        odd = [s for s in sizes if s % query_len]
        if odd and req.cudagraph_capture_sizes:
            _note(
                r,
                "cudagraph_capture_sizes",
                odd,
                f"not multiples of the {query_len} tokens per request of a uniform decode batch",
                f"give multiples of {query_len}",
            )
        decode = tuple(s for s in rounded if s <= min(limit, max_num_seqs * query_len))
    return decode, mixed


def _note(r: _Resolution, name: str, values: list[int], reason: str, remedy: str) -> None:
    r.changes.append(PlanChange(name, str(values), "dropped or rounded", reason, remedy))


def with_capture_sizes(
    plan: GraphPlan, decode: tuple[int, ...], mixed: tuple[int, ...], change: PlanChange
) -> GraphPlan:
    """The plan after the capture ladder was cut to fit memory."""
    return replace(
        plan,
        decode_capture_sizes=decode,
        mixed_capture_sizes=mixed,
        changes=(*plan.changes, change),
    )
