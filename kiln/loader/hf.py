"""A local HF directory: config.json, *.safetensors, tokenizer files. A W4A16 checkpoint
(GPTQ, AutoRound) has its quantized linears read by gptq.py. Of an image-text checkpoint
(Qwen3.5's) kiln loads the language model, whose tensors it saves as `model.language_model.*`,
and leaves the vision tower (`model.visual.*`) unread, saying so."""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from kiln.errors import ModelLoadError
from kiln.layers.packed import QuantizedTensor
from kiln.loader.gptq import QUANTIZED_PARTS, GPTQFormat, gptq_format, gptq_tensor
from kiln.loader.source import ModelSource
from kiln.loader.tokenizer import Tokenizer
from kiln.models.config import VISION_LANGUAGE_ARCHITECTURES, hf_architecture, model_config_from_hf

logger = logging.getLogger(__name__)


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
        self.vision_language = hf_architecture(self.hf_config) in VISION_LANGUAGE_ARCHITECTURES

    def tensors(
        self, dtype: torch.dtype, keep_packed: bool = False
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}  # a quantized layer's parts so far
        vision = 0
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for stored in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    name = self._text_model_name(stored)
                    if name is None:
                        vision += 1
                        continue
                    prefix, _, leaf = name.rpartition(".")
                    if self.quantization is None or leaf not in QUANTIZED_PARTS:
                        yield name, f.get_tensor(stored).to(dtype)
                        continue
                    pending.setdefault(prefix, {})[leaf] = f.get_tensor(stored)
        if vision:
            logger.warning(
                "%s: serving its text model; the vision tower's %d tensors are not loaded, so "
                "requests with images are refused (kiln takes text input)",
                hf_architecture(self.hf_config), vision,
            )  # fmt: skip
        for prefix, parts in pending.items():
            packed = gptq_tensor(prefix, parts, self.quantization)
            yield f"{prefix}.weight", packed if keep_packed else packed.dequantize().to(dtype)

    def _text_model_name(self, name: str) -> str | None:
        """A tensor's name in the text model (an image-text checkpoint's language model saved
        under `model.language_model.`), None for the vision tower's."""
        if not self.vision_language:
            return name
        if name.startswith(("model.visual.", "visual.")):
            return None
        if name.startswith("model.language_model."):
            return "model." + name.removeprefix("model.language_model.")
        return name

    def load_tokenizer(self) -> Tokenizer:
        return Tokenizer.from_directory(self.path, self.config.eos_token_ids)
