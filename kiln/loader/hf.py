"""A local HF directory: config.json, *.safetensors, tokenizer files. A W4A16 checkpoint
(GPTQ, AutoRound) has its quantized linears read by gptq.py."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from kiln.errors import ModelLoadError
from kiln.layers.packed import QuantizedTensor
from kiln.loader.gptq import QUANTIZED_PARTS, GPTQFormat, gptq_format, gptq_tensor
from kiln.loader.source import ModelSource
from kiln.loader.tokenizer import Tokenizer
from kiln.models.config import model_config_from_hf


class HFDirectorySource(ModelSource):
    def __init__(self, path: str) -> None:
        self.path = path
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise ModelLoadError(f"{path!r} has no config.json; expected an HF model directory")
        with open(config_path) as f:
            self.hf_config = json.load(f)
        self.config = model_config_from_hf(self.hf_config)
        self.files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not self.files:
            raise ModelLoadError(f"{path!r} has no *.safetensors weights (kiln does not read .bin)")
        quantization = self.hf_config.get("quantization_config")
        self.quantization: GPTQFormat | None = gptq_format(quantization) if quantization else None

    def tensors(
        self, dtype: torch.dtype, keep_packed: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}  # a quantized layer's parts so far
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    prefix, _, leaf = name.rpartition(".")
                    if self.quantization is None or leaf not in QUANTIZED_PARTS:
                        yield name, f.get_tensor(name).to(dtype)
                        continue
                    pending.setdefault(prefix, {})[leaf] = f.get_tensor(name)
        for prefix, parts in pending.items():
            packed = gptq_tensor(prefix, parts, self.quantization)
            yield f"{prefix}.weight", packed if keep_packed else packed.dequantize().to(dtype)

    def load_tokenizer(self) -> Tokenizer:
        return Tokenizer.from_directory(self.path, self.config.eos_token_ids)
