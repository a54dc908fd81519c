"""The compile cache key: everything that changes compiled artifacts (the model config, the
resolved graph plan's compilation fields, dtype, device and capability, torch's and Triton's
versions, the variables that steer the compilers, kiln's own source), hashed."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from kiln.native import cpu_flags


def kiln_source_hash() -> str:
    """Hash of every kiln source file: a code change invalidates compiled artifacts."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def device_signature(device: torch.device) -> str:
    """The GPU and its capability; on the CPU, its feature flags: Inductor's C++ is vectorised
    for them, and what `auto` settings resolve to follows them (kiln's kernels' int8 paths
    under `--packed-activations auto`), so a cache shared by machines keeps one entry each."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:{torch.cuda.get_device_name(device)}:sm{major}{minor}"
    if device.type == "cpu":
        return f"cpu:{hashlib.sha256(cpu_flags().encode()).hexdigest()[:12]}"
    return device.type


def cache_key_fields(
    model_config: dict[str, Any],
    compilation: dict[str, Any],
    dtype: str,
    device: str,
    source_hash: str,
) -> dict[str, Any]:
    return {
        "model_config": model_config,
        "compilation": compilation,
        "dtype": dtype,
        "device": device,
        "torch": torch.__version__,
        "triton": triton_version() if device.startswith("cuda") else None,  # CPU code: C++
        "env": compile_env(),
        "kiln_source": source_hash,
    }


COMPILE_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCHDYNAMO_", "TRITON_")


def compile_env() -> dict[str, str]:
    """The environment variables that steer Dynamo, Inductor and Triton (max-autotune, the
    interpreter, ...): their caches key on them, and so does kiln's entry, so that "reused"
    means reused. Locations are not among them: where the caches live, and the tool paths
    Inductor itself sets once it compiles (TRITON_PTXAS_PATH), which would give a process's
    second engine another key than its first."""
    return {
        k: v
        for k, v in sorted(os.environ.items())
        if k.startswith(COMPILE_ENV_PREFIXES) and not k.endswith(("_DIR", "_PATH"))
    }


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


# what of a resolved graph plan changes compiled artifacts
PLAN_KEY_FIELDS = (
    "mode",
    "cudagraph_mode",
    "decode_capture_sizes",
    "mixed_capture_sizes",
    "splitting_ops",
    "backend",
    "inductor_compile_config",
)


def plan_key_fields(
    plan: dict[str, Any], model_config: dict[str, Any], dtype: str, device: torch.device
) -> dict[str, Any]:
    """What keys the entry of a compiled engine (`plan` is GraphPlan.to_dict())."""
    compilation = {k: plan[k] for k in PLAN_KEY_FIELDS}
    return cache_key_fields(
        model_config, compilation, dtype, device_signature(device), kiln_source_hash()
    )


def cache_key(fields: dict[str, Any]) -> str:
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:20]
