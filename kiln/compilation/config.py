"""`--compilation-config`: vLLM's field names, strictly validated. A field left out (None)
means "the default for this device", which the graph plan fills in without a warning; a field
given explicitly that cannot run is changed with a warning (or refused under --strict-graphs)."""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from kiln.errors import ConfigError


class CUDAGraphMode(enum.Enum):
    NONE = "NONE"
    PIECEWISE = "PIECEWISE"
    FULL = "FULL"
    FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
    FULL_AND_PIECEWISE = "FULL_AND_PIECEWISE"

    @classmethod
    def parse(cls, value: str | CUDAGraphMode) -> CUDAGraphMode:
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).upper())
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ConfigError(f"cudagraph_mode {value!r} is not one of {choices}") from None


COMPILATION_MODES = (0, 3)


def qualified_op_name(name: str) -> str:
    """vLLM spells ops "namespace.name"; torch's schema names are "namespace::name"."""
    return name if "::" in name else name.replace(".", "::", 1)


@dataclass(frozen=True)
class CompilationConfig:
    mode: int | None = None  # 0: eager, 3: torch.compile with kiln's split backend
    cudagraph_mode: CUDAGraphMode | None = None
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_cudagraph_capture_size: int | None = None
    splitting_ops: tuple[str, ...] | None = None
    debug_contiguity: bool = False  # check every tensor at a split boundary (tests)

    def __post_init__(self) -> None:
        if self.mode is not None and self.mode not in COMPILATION_MODES:
            raise ConfigError(
                f"compilation mode {self.mode!r} is not supported: use 0 (eager) or 3 (compiled)"
            )
        if self.cudagraph_mode is not None:
            object.__setattr__(self, "cudagraph_mode", CUDAGraphMode.parse(self.cudagraph_mode))
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            if not all(isinstance(s, int) and s >= 1 for s in sizes):
                raise ConfigError(f"cudagraph_capture_sizes must be integers >= 1, got {sizes!r}")
            object.__setattr__(self, "cudagraph_capture_sizes", tuple(sorted(set(sizes))))
        cap = self.max_cudagraph_capture_size
        if cap is not None and (not isinstance(cap, int) or cap < 1):
            raise ConfigError(f"max_cudagraph_capture_size must be an integer >= 1, got {cap!r}")
        if self.splitting_ops is not None:
            if not all(isinstance(s, str) for s in self.splitting_ops):
                raise ConfigError(f"splitting_ops must be op names, got {self.splitting_ops!r}")
            names = tuple(qualified_op_name(s) for s in self.splitting_ops)
            object.__setattr__(self, "splitting_ops", names)

    @classmethod
    def from_json(cls, text: str | dict[str, Any] | None) -> CompilationConfig:
        """Parse `--compilation-config` (a JSON object) or a dict. A bare integer is the mode,
        as in vLLM (`-O3`)."""
        if text is None:
            return cls()
        if isinstance(text, dict):
            data = text
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"--compilation-config is not valid JSON: {exc}") from None
        if isinstance(data, int):
            data = {"mode": data}
        if not isinstance(data, dict):
            raise ConfigError("--compilation-config must be a JSON object, e.g. '{\"mode\": 3}'")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"unknown --compilation-config fields {unknown}; known: {sorted(known)}"
            )
        for key in ("cudagraph_capture_sizes", "splitting_ops"):
            if isinstance(data.get(key), list):
                data = {**data, key: tuple(data[key])}
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cudagraph_mode"] = self.cudagraph_mode.value if self.cudagraph_mode else None
        return d
