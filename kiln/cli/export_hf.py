"""`kiln export-hf [MODEL] [OUTPUT_DIR] [--dtype bf16]`: a GGUF as an HF directory (dequantized
safetensors, config, tokenizer, chat template), for engines that read only those, such as vLLM.
Without OUTPUT_DIR (one path: a .gguf is the model, else the output) it goes to kiln's cache,
where a profile's `model = "default-hf"` finds the embedded model's."""

from __future__ import annotations

import argparse

from kiln.default_model import cached_hf_export, default_model_path, export_hf


def run(args: argparse.Namespace) -> int:
    model, out_dir = args.model, args.output
    if out_dir is None and not (model or "").endswith(".gguf"):
        model, out_dir = None, model  # one path that is no GGUF is where the output goes
    gguf = model or default_model_path()
    if out_dir is None:
        path = cached_hf_export(gguf, args.dtype)
    else:
        path = export_hf(gguf, out_dir, args.dtype)
    print(path)
    return 0
