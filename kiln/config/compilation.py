"""`--compilation-config`: vLLM's field names, strictly validated. A field left out (None)
means "the default for this device", which the graph plan fills in without a warning; a field
given explicitly that cannot run is changed with a warning (or refused under --strict-graphs)."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, fields
from typing import Any

from kiln.config.compilation_values import (
    CUDAGraphMode,
    is_int,
    parse_backend,
    parse_capture_sizes,
    parse_mode,
    parse_splitting_ops,
)
from kiln.config.inductor_options import parse_inductor_config, shown_options
from kiln.config.vllm_fields import VLLM_ONLY, check_vllm_only, read_vllm_fields
from kiln.errors import ConfigError


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
            "cudagraph_capture_sizes": parse_capture_sizes,
            "splitting_ops": parse_splitting_ops,
            "backend": parse_backend,
            "inductor_compile_config": parse_inductor_config,
            "vllm_only": check_vllm_only,
        }
        for name, parse in parsed.items():
            if getattr(self, name) is not None:
                object.__setattr__(self, name, parse(getattr(self, name)))
        cap = self.max_cudagraph_capture_size
        if cap is not None and (not is_int(cap) or cap < 1):
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
        if is_int(text):
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
    if is_int(data):
        return {"mode": data}
    if not isinstance(data, dict):
        raise ConfigError("--compilation-config must be a JSON object, e.g. '{\"mode\": 3}'")
    return data
