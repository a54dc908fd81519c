"""The values `--compilation-config` fields take: compilation modes (by number or vLLM's names),
CUDA-graph modes (by name or vLLM's enum values), piece backends, capture sizes and op names.
Shared by compilation.py and vllm_fields.py, which reads vLLM's old spellings as these."""

from __future__ import annotations

import enum
from typing import Any

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


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a 1


def parse_mode(value: Any) -> int:
    """0 or 3, given as the number or as vLLM's name for it."""
    mode = MODE_NAMES.get(value.upper()) if isinstance(value, str) else value
    if not is_int(mode):
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


def parse_capture_sizes(sizes: Any) -> tuple[int, ...]:
    if not isinstance(sizes, (list, tuple)) or not all(is_int(s) and s >= 1 for s in sizes):
        raise ConfigError(
            f"cudagraph_capture_sizes must be a list of integers >= 1, e.g. [1, 2, 4, 8], "
            f"got {sizes!r}"
        )
    return tuple(sorted(set(sizes)))


def parse_splitting_ops(ops: Any) -> tuple[str, ...]:
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
