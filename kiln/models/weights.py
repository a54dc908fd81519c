"""Copy checkpoint tensors (HF names) into a kiln model, filling fused layers by rows."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from kiln.errors import ModelLoadError
from kiln.layers.linear import Linear

logger = logging.getLogger(__name__)

# checkpoint projection -> (kiln fused projection, index of its part)
_FUSED_PARTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _part_rows(module: nn.Module, fused: str, index: int) -> slice:
    sizes = module.sizes if fused == "qkv_proj" else [module.intermediate] * 2
    start = sum(sizes[:index])
    return slice(start, start + sizes[index])


def _load_fused(model: nn.Module, name: str, tensor: torch.Tensor) -> str | None:
    """Load a q/k/v/gate/up tensor into its fused layer; returns the part's key, or None."""
    path, leaf = name.rsplit(".", 1)
    parent, proj = path.rsplit(".", 1) if "." in path else ("", path)
    if proj not in _FUSED_PARTS:
        return None
    fused, index = _FUSED_PARTS[proj]
    owner = model.get_submodule(parent)
    linear: Linear = getattr(owner, fused)
    rows = _part_rows(owner, fused, index)
    if leaf == "weight":
        linear.load_weight(name, tensor, rows)
    else:
        linear.load_bias(name, tensor, rows)
    return f"{parent}.{fused}.{leaf}#{index}"


def _expected_keys(model: nn.Module) -> set[str]:
    keys = set()
    for name, _ in model.named_parameters():
        path = name.rsplit(".", 1)[0]
        if path.endswith("qkv_proj"):
            keys |= {f"{name}#{i}" for i in range(3)}
        elif path.endswith("gate_up_proj"):
            keys |= {f"{name}#{i}" for i in range(2)}
        else:
            keys.add(name)
    return keys


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load HF-named tensors. Missing tensors and shape mismatches are ModelLoadErrors."""
    params = dict(model.named_parameters())
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    for raw_name, tensor in tensors:
        name = raw_name.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        with torch.no_grad():
            key = _load_fused(model, name, tensor) if "layers." in name else None
            if key is None:
                if name not in params:
                    logger.warning(
                        "ignoring checkpoint tensor %r: the model has no such weight", raw_name
                    )
                    continue
                _copy(params[name], name, tensor)
                key = name
        loaded.add(key)
    missing = sorted(_expected_keys(model) - loaded)
    if missing:
        shown = ", ".join(k.split("#")[0] for k in missing[:5])
        raise ModelLoadError(
            f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {shown}"
        )


def _copy(param: torch.Tensor, name: str, tensor: torch.Tensor) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ModelLoadError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
        )
    param.copy_(tensor)
