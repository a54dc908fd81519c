"""vLLM's `--compilation-config` fields that kiln has no field of its own for, so that a vLLM
launcher boots here. Two kinds:

- **Old spellings** of kiln's fields, read as what they meant, with a warning that names the
  current spelling: `level` (mode), `use_inductor` (backend), `use_cudagraph` and
  `full_cuda_graph` (cudagraph_mode). Given together with the field they stand for, they must
  agree.
- **Settings for machinery kiln does not have** (vLLM's fusion passes, static-shape
  compilations, LoRA graphs, ...). They are kept in `CompilationConfig.vllm_only`, and the
  graph plan reports each one that asks for something as unused, with the reason: a WARNING,
  an error under --strict-graphs. A value that asks for nothing (vLLM's default, or what kiln
  does anyway) is no change and passes quietly."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.config.compilation_values import CUDAGraphMode, parse_backend, parse_mode
from kiln.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmOnlyField:
    reason: str  # why it cannot take effect in kiln
    asks_nothing: Callable[[Any], bool]  # the values that need no change
    remedy: str = "drop it"


def _empty(value: Any) -> bool:
    return value in (None, "", [], {})


def _dynamic_shapes_as_kiln(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and value.get("type") == "unbacked"
        and not value.get("evaluate_guards", False)
    )


NO_STATIC_SIZES = (
    "kiln compiles each piece once, for every token count: it makes no static-shape copies"
)
VLLM_ONLY: dict[str, VllmOnlyField] = {
    "cache_dir": VllmOnlyField(
        "kiln keeps its compile cache under $KILN_CACHE_DIR/compile, one entry per configuration",
        _empty,
        "set KILN_CACHE_DIR to choose where it lives, and drop cache_dir",
    ),
    "compile_cache_save_format": VllmOnlyField(
        "kiln keeps each compile cache entry as a directory of checksummed files",
        lambda v: v is None,
    ),
    "compile_sizes": VllmOnlyField(NO_STATIC_SIZES, _empty),
    "compile_ranges_split_points": VllmOnlyField(NO_STATIC_SIZES, _empty),
    "custom_ops": VllmOnlyField("kiln has no vLLM custom ops to switch on or off", _empty),
    "pass_config": VllmOnlyField(
        "kiln runs none of vLLM's fusion passes (Inductor's own fusions still run)", _empty
    ),
    "inductor_passes": VllmOnlyField(
        "kiln loads no Inductor passes by name; Inductor's options go in inductor_compile_config",
        _empty,
    ),
    "use_inductor_graph_partition": VllmOnlyField(
        "kiln splits the traced graph at splitting_ops before Inductor, as vLLM does without it",
        lambda v: v in (None, False),
    ),
    "dynamic_shapes_config": VllmOnlyField(
        "kiln marks the token and batch dimensions unbacked: one compilation for every size, "
        "and no guards on them",
        lambda v: v is None or _dynamic_shapes_as_kiln(v),
    ),
    "cudagraph_num_of_warmups": VllmOnlyField(
        "kiln runs one uncaptured forward before it captures, and then captures every size",
        lambda v: v in (None, 0),
    ),
    "cudagraph_copy_inputs": VllmOnlyField(
        "kiln's runner copies each step's inputs into its persistent buffers either way",
        lambda v: True,
    ),
    "cudagraph_specialize_lora": VllmOnlyField("kiln has no LoRA adapters", lambda v: True),
    "compile_mm_encoder": VllmOnlyField(
        "kiln's models have no multimodal encoder", lambda v: v in (None, False)
    ),
}


def read_vllm_fields(data: dict[str, Any]) -> dict[str, Any]:
    """`data` with vLLM's old spellings read as kiln's fields, and the settings kiln has no
    machinery for moved to `vllm_only`."""
    data = _old_spelling(data, "level", "mode", _level_meaning)
    data = _old_spelling(data, "use_inductor", "backend", _use_inductor_meaning)
    if data.get("use_cudagraph") is False and data.get("full_cuda_graph") is True:
        raise ConfigError(
            "--compilation-config gives use_cudagraph false (no CUDA graphs) and "
            "full_cuda_graph true (FULL graphs): keep only cudagraph_mode"
        )
    data = _old_spelling(data, "use_cudagraph", "cudagraph_mode", _use_cudagraph_meaning)
    data = _old_spelling(data, "full_cuda_graph", "cudagraph_mode", _full_cuda_graph_meaning)
    given = {name: data[name] for name in VLLM_ONLY if name in data}
    if not given:
        return data
    data = {k: v for k, v in data.items() if k not in given}
    data["vllm_only"] = tuple(sorted(given.items()))
    return data


def unused_vllm_fields(
    vllm_only: tuple[tuple[str, Any], ...],
) -> list[tuple[str, Any, VllmOnlyField]]:
    """The settings of `vllm_only` that ask for something kiln cannot do."""
    return [
        (name, value, VLLM_ONLY[name])
        for name, value in vllm_only
        if not VLLM_ONLY[name].asks_nothing(value)
    ]


def check_vllm_only(vllm_only: Any) -> tuple[tuple[str, Any], ...]:
    """The Python API's `vllm_only`, as `read_vllm_fields` makes it."""
    items = dict(vllm_only).items() if isinstance(vllm_only, (dict, tuple, list)) else None
    if items is None or any(name not in VLLM_ONLY for name, _ in items):
        raise ConfigError(
            f"vllm_only must map vLLM's compilation fields ({', '.join(sorted(VLLM_ONLY))}) to "
            f"their values, got {vllm_only!r}"
        )
    return tuple(sorted(items))


# ---- old spellings: each returns the value of the current field it stands for, or None when
# the value asks for nothing (vLLM's default), and the warning's wording --------------------


def _old_spelling(
    data: dict[str, Any], old: str, new: str, meaning: Callable[[Any], tuple[Any, str] | None]
) -> dict[str, Any]:
    if old not in data:
        return data
    data = dict(data)
    value = data.pop(old)
    meant = meaning(value)
    if meant is None:
        return data
    implied, current = meant
    if new in data and _canonical(new, data[new]) != _canonical(new, implied):
        raise ConfigError(
            f"--compilation-config gives {old} {_show(value)} and {new} {_show(data[new])}; "
            f"{old} is vLLM's old spelling of {new}: keep only {new}"
        )
    logger.warning(
        "--compilation-config: '%s' is vLLM's old spelling; kiln reads %s %s as %s (write "
        '"%s" to silence this warning)',
        old,
        old,
        _show(value),
        current,
        new,
    )
    data.setdefault(new, implied)
    return data


def _canonical(field: str, value: Any) -> Any:
    parse = {"mode": parse_mode, "backend": parse_backend, "cudagraph_mode": CUDAGraphMode.parse}
    return parse[field](value)


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


def _level_meaning(level: Any) -> tuple[Any, str]:
    return level, f'"mode": {parse_mode(level)}'


def _use_inductor_meaning(use: Any) -> tuple[str, str]:
    backend = "inductor" if _flag("use_inductor", use) else "eager"
    return backend, f'"backend": "{backend}"'


def _use_cudagraph_meaning(use: Any) -> tuple[str, str] | None:
    if _flag("use_cudagraph", use):
        return None  # vLLM's default: the cudagraph_mode (or its default) decides
    return "NONE", '"cudagraph_mode": "NONE"'


def _full_cuda_graph_meaning(full: Any) -> tuple[str, str] | None:
    if not _flag("full_cuda_graph", full):
        return None
    return "FULL", '"cudagraph_mode": "FULL"'
