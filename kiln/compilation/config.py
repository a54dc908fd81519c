"""`--compilation-config`: vLLM's field names, strictly validated. A field left out (None)
means "the default for this device", which the graph plan fills in without a warning; a field
given explicitly that cannot run is changed with a warning (or refused under --strict-graphs)."""

from __future__ import annotations

import difflib
import enum
import json
from dataclasses import dataclass, fields
from typing import Any

from kiln.compilation.inductor_options import parse_inductor_config, shown_options
from kiln.compilation.vllm_fields import VLLM_ONLY, check_vllm_only, read_vllm_fields
from kiln.errors import ConfigError


class CUDAGraphMode(enum.Enum):
    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"

    @classmethod
    def parse(cls, value: str | int | list | CUDAGraphMode) -> CUDAGraphMode:
        """A name, or vLLM's enum value: 0, 1, 2, [2, 0] or [2, 1]."""
        if isinstance(value, cls):
            return value
        by_value = _VLLM_VALUES.get(tuple(value) if isinstance(value, list) else value)
        if by_value is not None and not isinstance(value, bool):
            return cls(by_value)
        try:
            return cls(str(value).upper())
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ConfigError(
                f"cudagraph_mode {value!r} is not one of {choices} (or vLLM's values 0, 1, 2, "
                "[2, 0], [2, 1])"
            ) from None


# vLLM's CUDAGraphMode values (its JSON and its Python API take them as well as the names)
_VLLM_VALUES = {
    0: "NONE",
    1: "PIECEWISE",
    2: "FULL",
    (2, 0): "FULL_DECODE_ONLY",
    (2, 1): "FULL_AND_PIECEWISE",
}


COMPILATION_MODES = (0, 3)
# vLLM's names for its modes (CompilationMode, v0.11+) and for its levels before that
# (CompilationLevel): launchers carry either
MODE_NAMES = {
    "NONE": 0,
    "STOCK_TORCH_COMPILE": 1,
    "DYNAMO_TRACE_ONCE": 2,
    "VLLM_COMPILE": 3,
    "NO_COMPILATION": 0,
    "DYNAMO_AS_IS": 1,
    "DYNAMO_ONCE": 2,
    "PIECEWISE": 3,
}


def qualified_op_name(name: str) -> str:
    """vLLM spells ops "namespace.name"; torch's schema names are "namespace::name"."""
    return name if "::" in name else name.replace(".", "::", 1)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a 1


def parse_mode(value: Any) -> int:
    """0 or 3, given as the number or as vLLM's name for it."""
    mode = MODE_NAMES.get(value.upper()) if isinstance(value, str) else value
    if not _is_int(mode):
        raise ConfigError(
            f"compilation mode must be 0 (eager) or 3 (compiled), as a number or vLLM's names "
            f"NONE / VLLM_COMPILE, got {value!r}"
        )
    if mode not in COMPILATION_MODES:
        vllm_name = next((n for n, m in MODE_NAMES.items() if m == mode), None)
        known_as = f" (vLLM's {vllm_name})" if vllm_name else ""
        raise ConfigError(
            f"compilation mode {value!r}{known_as} is not supported: use 0 (eager) or 3 "
            "(compiled, kiln's split backend)"
        )
    return mode


def _parse_sizes(sizes: Any) -> tuple[int, ...]:
    if not isinstance(sizes, (list, tuple)) or not all(_is_int(s) and s >= 1 for s in sizes):
        raise ConfigError(
            f"cudagraph_capture_sizes must be a list of integers >= 1, e.g. [1, 2, 4, 8], "
            f"got {sizes!r}"
        )
    return tuple(sorted(set(sizes)))


def _parse_ops(ops: Any) -> tuple[str, ...]:
    if not isinstance(ops, (list, tuple)) or not all(isinstance(s, str) for s in ops):
        raise ConfigError(
            f'splitting_ops must be a list of op names, e.g. ["kiln.torch_paged_attention"] '
            f"(or [] for one graph), got {ops!r}"
        )
    return tuple(qualified_op_name(s) for s in ops)


# vLLM's `backend` field: what compiles the pieces. "eager" and "aot_eager" leave Inductor out,
# which tells a Dynamo or AOTAutograd problem from an Inductor one (vLLM's `-cc.backend=eager`).
PIECE_BACKENDS = ("inductor", "aot_eager", "eager")


def parse_backend(value: Any) -> str:
    name = value.lower() if isinstance(value, str) else value
    if name == "":
        return "inductor"  # vLLM's default spelling
    if name not in PIECE_BACKENDS:
        raise ConfigError(
            f'backend {value!r} is not supported: kiln compiles the pieces with "inductor" '
            '(the default), or runs them without Inductor with "aot_eager" (AOTAutograd '
            'only) or "eager" (the traced graph as it is)'
        )
    return name


@dataclass(frozen=True)
class CompilationConfig:
    mode: int | None = None  # 0: eager, 3: torch.compile with kiln's split backend
    cudagraph_mode: CUDAGraphMode | None = None
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_cudagraph_capture_size: int | None = None
    splitting_ops: tuple[str, ...] | None = None
    backend: str | None = None  # what compiles the pieces (PIECE_BACKENDS); None: inductor
    inductor_compile_config: tuple[tuple[str, Any], ...] | None = None  # Inductor's options
    debug_dump_path: str | None = None  # where each compilation writes its graphs and code
    debug_contiguity: bool = False  # check every tensor at a split boundary (tests)
    # mode 3: save Dynamo's trace in the compile cache entry, and load it on later boots
    # instead of tracing again (precompile.py); false traces at every boot, as torch.compile
    aot_compile: bool = True
    # vLLM's fields kiln has no machinery for, as given (vllm_fields.py); the plan reports
    # those that ask for something as unused
    vllm_only: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        parsed = {
            "mode": parse_mode,
            "cudagraph_mode": CUDAGraphMode.parse,
            "cudagraph_capture_sizes": _parse_sizes,
            "splitting_ops": _parse_ops,
            "backend": parse_backend,
            "inductor_compile_config": parse_inductor_config,
            "vllm_only": check_vllm_only,
        }
        for name, parse in parsed.items():
            if getattr(self, name) is not None:
                object.__setattr__(self, name, parse(getattr(self, name)))
        cap = self.max_cudagraph_capture_size
        if cap is not None and (not _is_int(cap) or cap < 1):
            raise ConfigError(f"max_cudagraph_capture_size must be an integer >= 1, got {cap!r}")
        dump = self.debug_dump_path
        if dump is not None and (not isinstance(dump, str) or not dump):
            raise ConfigError(f"debug_dump_path must be a directory path, got {dump!r}")
        for name in ("debug_contiguity", "aot_compile"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @classmethod
    def from_json(cls, text: str | int | dict[str, Any] | None) -> CompilationConfig:
        """Parse `--compilation-config` (a JSON object) or a dict. A bare integer is the mode,
        as in vLLM (`-O3`); vLLM's other fields are read as vllm_fields.py says."""
        if text is None:
            return cls()
        if _is_int(text):
            text = {"mode": text}
        data = read_vllm_fields(text if isinstance(text, dict) else compilation_data(str(text)))
        known = {f.name for f in fields(cls)} - {"vllm_only"}
        unknown = sorted(set(data) - known - {"vllm_only"})
        if unknown:
            close = {n: difflib.get_close_matches(n, known | set(VLLM_ONLY), n=1) for n in unknown}
            hints = "".join(f"; {n!r}: did you mean {c[0]!r}?" for n, c in close.items() if c)
            raise ConfigError(
                f"unknown --compilation-config fields {unknown}{hints} (kiln's fields: "
                f"{', '.join(sorted(known))}; vLLM's that kiln accepts and reports as unused: "
                f"{', '.join(sorted(VLLM_ONLY))})"
            )
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        # not asdict: it deep-copies values, and a graph pass object may refuse to be copied
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["cudagraph_mode"] = self.cudagraph_mode.value if self.cudagraph_mode else None
        options = self.inductor_compile_config
        d["inductor_compile_config"] = shown_options(options) if options is not None else None
        d["vllm_only"] = dict(self.vllm_only)
        return d

    @property
    def inductor_options(self) -> dict[str, Any] | None:
        options = self.inductor_compile_config
        return dict(options) if options is not None else None


def compilation_data(text: str) -> dict[str, Any]:
    """`--compilation-config`'s JSON as a dict of fields (a bare integer is the mode)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--compilation-config is not valid JSON: {exc}") from None
    if _is_int(data):
        return {"mode": data}
    if not isinstance(data, dict):
        raise ConfigError("--compilation-config must be a JSON object, e.g. '{\"mode\": 3}'")
    return data
