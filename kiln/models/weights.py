"""Copy checkpoint tensors (HF names) into a kiln model, filling fused layers by rows."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from kiln.errors import ModelLoadError
from kiln.layers.embedding import VocabEmbedding
from kiln.layers.linear import Linear
from kiln.layers.moe import FusedExperts
from kiln.layers.packed import QuantizedTensor

Tensor = torch.Tensor | QuantizedTensor

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


def _load_fused(model: nn.Module, name: str, tensor: Tensor) -> str | None:
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
        linear.load_bias(name, _dense(tensor), rows)
    return f"{parent}.{fused}.{leaf}#{index}"


_EXPERT_PARTS = ("gate_proj", "up_proj", "down_proj")


def _load_expert(model: nn.Module, name: str, tensor: Tensor) -> list[str] | None:
    """Load one expert's projection (`...mlp.experts.7.up_proj.weight`, as transformers saves
    them) or all experts' stacked tensor (`...mlp.experts.gate_up_proj`, its in-memory form)
    into a FusedExperts; returns the keys loaded, or None for any other tensor."""
    if ".experts." not in name:
        return None
    owner_path, rest = name.split(".experts.", 1)
    try:
        owner = model.get_submodule(owner_path + ".experts")
    except AttributeError:  # no such layer or no experts there: the caller reports it
        return None
    if not isinstance(owner, FusedExperts):
        return None
    if rest in ("gate_up_proj", "down_proj"):
        if rest in owner.packed:
            raise ModelLoadError(f"tensor {name!r}: that stack of experts arrived twice")
        _copy(getattr(owner, rest), name, tensor)
        parts = _EXPERT_PARTS[:2] if rest == "gate_up_proj" else _EXPERT_PARTS[2:]
        return [_expert_key(owner_path, e, p) for e in range(owner.num_experts) for p in parts]
    expert, proj, _ = [*rest.split("."), "", "", ""][:3]
    if not expert.isdigit() or int(expert) >= owner.num_experts or proj not in _EXPERT_PARTS:
        raise ModelLoadError(f"tensor {name!r} names no expert projection of this model")
    _check_shape(owner.part(int(expert), proj), name, tensor)
    if isinstance(tensor, QuantizedTensor):
        owner.load_quantized(int(expert), proj, tensor)
    else:
        owner.load_dense(int(expert), proj, tensor)
    return [_expert_key(owner_path, int(expert), proj)]


def _expert_key(owner_path: str, expert: int, proj: str) -> str:
    return f"{owner_path}.experts.{expert}.{proj}.weight"  # the name transformers saves


def _expected_keys(model: nn.Module) -> set[str]:
    keys = set()
    for path, module in model.named_modules():
        if isinstance(module, FusedExperts):
            owner = path.removesuffix(".experts")
            keys |= {_expert_key(owner, e, p) for e in range(module.num_experts)
                     for p in _EXPERT_PARTS}  # fmt: skip
    for name, _ in model.named_parameters():
        path = name.rsplit(".", 1)[0]
        if path.endswith(".experts"):
            continue
        if path.endswith("qkv_proj"):
            keys |= {f"{name}#{i}" for i in range(3)}
        elif path.endswith("gate_up_proj"):
            keys |= {f"{name}#{i}" for i in range(2)}
        else:
            keys.add(name)
    return keys


def _load_whole(model: nn.Module, name: str, tensor: Tensor) -> bool:
    """Hand a weight to its Linear or embedding, which may keep it packed; False for others."""
    path, leaf = name.rsplit(".", 1) if "." in name else ("", name)
    try:
        owner = model.get_submodule(path)
    except AttributeError:
        return False
    if leaf != "weight" or not isinstance(owner, (Linear, VocabEmbedding)):
        return False
    owner.load_weight(name, tensor)
    return True


def load_weights(model: nn.Module, tensors: Iterable[tuple[str, Tensor]]) -> None:
    """Load HF-named tensors. Missing tensors and shape mismatches are ModelLoadErrors.
    Quantized tensors stay quantized where a Linear or the embedding takes them."""
    params = dict(model.named_parameters())
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    for raw_name, tensor in tensors:
        name = raw_name.removeprefix("model.")
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        if name.startswith("mtp.") and hasattr(model, "mtp_weights"):
            # the MTP head, for speculative decoding: as loaded (its own load packs it)
            model.mtp_weights[name] = tensor
            continue
        with torch.no_grad():
            expert_keys = _load_expert(model, name, tensor) if "layers." in name else None
            if expert_keys is not None:
                loaded.update(expert_keys)
                continue
            key = _load_fused(model, name, tensor) if "layers." in name else None
            if key is None and _load_whole(model, name, tensor):
                key = name
            elif key is None:
                if name not in params:
                    logger.warning(
                        "ignoring checkpoint tensor %r: the model has no such weight", raw_name
                    )
                    continue
                _copy(params[name], name, tensor)
                key = name
        loaded.add(key)
    if getattr(model, "mtp_weights", None):
        logger.info("kept %d multi-token-prediction tensors (mtp.*) for speculative decoding",
                    len(model.mtp_weights))  # fmt: skip
    missing = sorted(_expected_keys(model) - loaded)
    if missing:
        shown = ", ".join(k.split("#")[0] for k in missing[:5])
        raise ModelLoadError(
            f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {shown}"
        )


def _check_shape(param: torch.Tensor, name: str, tensor: Tensor) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ModelLoadError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
        )


def _copy(param: torch.Tensor, name: str, tensor: Tensor) -> None:
    _check_shape(param, name, tensor)
    param.copy_(_dense(tensor))


def _dense(tensor: Tensor) -> torch.Tensor:
    return tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor


def weight_summary(model: nn.Module) -> list[tuple[str, int, int]]:
    """What the loaded weights became, after `finalize`: (format, tensors, resident bytes) per
    format, largest first. Everything that is not a linear layer or the embedding (norms,
    convolutions, routers, tables) is one row."""
    rows: dict[str, list[int]] = {}
    counted: set[int] = set()
    for module in model.modules():
        if isinstance(module, FusedExperts):
            for fmt, tensors in _expert_formats(module):
                row = rows.setdefault(fmt, [0, 0])
                row[0] += module.num_experts
                row[1] += sum(t.numel() * t.element_size() for t in tensors)
                counted |= {id(t) for t in tensors}
            continue
        if not isinstance(module, (Linear, VocabEmbedding)):
            continue
        tensors = [t for t in (*module.parameters(), *module.buffers()) if t is not None]
        tensors += [module.packed_head] if getattr(module, "packed_head", None) is not None else []
        row = rows.setdefault(_format(module), [0, 0])
        row[0] += 1
        row[1] += sum(t.numel() * t.element_size() for t in tensors)
        counted |= {id(t) for t in tensors}
    rest = [t for t in (*model.parameters(), *model.buffers()) if id(t) not in counted]
    if rest:
        rows["other tensors (norms, tables, ...)"] = [
            len(rest), sum(t.numel() * t.element_size() for t in rest)
        ]  # fmt: skip
    return sorted(((k, n, b) for k, (n, b) in rows.items()), key=lambda r: -r[2])


def _expert_formats(experts: FusedExperts) -> list[tuple[str, list[torch.Tensor]]]:
    """(format, tensors) of each of the experts' two stacks."""
    out = []
    for stack in ("gate_up_proj", "down_proj"):
        if stack in experts.packed:
            p = experts.packed[stack]
            out.append((f"experts: {p.kind} -> {p.describe()}", list(p.buffers())))
            continue
        dense = getattr(experts, stack)
        reason = experts.fallback_reasons.get(stack)
        fmt = f"experts: {_dtype_name(dense)}"
        out.append((f"experts: dequantized to {_dtype_name(dense)} ({reason})" if reason else fmt,
                    [dense]))  # fmt: skip
    return out


def _format(module: Linear | VocabEmbedding) -> str:
    what = "embedding" if isinstance(module, VocabEmbedding) else "linear"
    if module.packed is not None:
        p = module.packed
        dense = f" + dense {_dtype_name(p.dense)} copy" if p.dense is not None else ""
        return f"{what}: {p.kind} -> {p.describe()}{dense}"
    dtype = str(module.weight.dtype).removeprefix("torch.")
    if module.fallback_reason:
        return f"{what}: dequantized to {dtype} ({module.fallback_reason})"
    layout = getattr(module, "layout", "dense")
    layout = "paired for kiln's bf16 kernel" if layout == "pairs" else layout
    return f"{what}: {dtype}" + (f" ({layout})" if layout != "dense" else "")


def describe_weights(summary: list[tuple[str, int, int]]) -> str:
    """One line per format and the resident total, for the log and `kiln info`."""
    total = sum(b for _, _, b in summary)
    parts = [f"{fmt}: {n} tensors, {b / 2**20:.1f} MiB" for fmt, n, b in summary]
    return "; ".join(parts) + f"; resident {total / 2**20:.1f} MiB"


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
