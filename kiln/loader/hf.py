"""A local HF directory: config.json, *.safetensors, tokenizer files."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open

from kiln.errors import ModelLoadError
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

    def tensors(
        self, dtype: torch.dtype, keep_packed: bool = False
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield name, f.get_tensor(name).to(dtype)

    def load_tokenizer(self) -> Tokenizer:
        return Tokenizer.from_directory(self.path, self.config.eos_token_ids)
