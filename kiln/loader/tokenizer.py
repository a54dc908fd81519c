"""Tokenizers come from transformers (HF directories, or converted from GGUF metadata).
A GGUF conversion takes seconds, so its result is cached as a tokenizer directory keyed by the
file's path, size and modification time."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from typing import Any

from kiln.errors import InvalidRequestError, ModelLoadError
from kiln.paths import kiln_cache_dir, temp_dir_in, writable_dir

logger = logging.getLogger(__name__)


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.hf = hf_tokenizer
        eos = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(hf_tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = len(hf_tokenizer)

    @classmethod
    def from_directory(cls, path: str, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        from transformers import AutoTokenizer

        if not os.path.isdir(path):
            raise ModelLoadError(
                f"tokenizer {path!r} is not a directory: pass a local HF directory with "
                "tokenizer files (kiln never downloads)"
            )
        try:
            hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {exc}") from None
        return cls(hf, eos_token_ids)

    @classmethod
    def from_gguf(cls, path: str, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        cached = _converted_tokenizer_dir(path)
        if not os.path.isdir(cached):
            _convert_gguf_tokenizer(path, cached)
        return cls.from_directory(cached, eos_token_ids)

    @property
    def backend(self) -> Any:
        """The `tokenizers.Tokenizer` underneath, for incremental decoding."""
        return self.hf.backend_tokenizer

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        _check_unicode(text, "prompt")
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if not self.has_chat_template:
            raise InvalidRequestError(
                "this model has no chat template; send a plain prompt (or use --raw)", "messages"
            )
        if not messages:
            raise InvalidRequestError("messages is empty; send at least one message", "messages")
        for m in messages:
            if isinstance(m.get("content"), str):
                _check_unicode(m["content"], "messages")
        from jinja2 import TemplateError

        try:
            return self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except TemplateError as exc:  # templates raise on e.g. roles out of order
            raise InvalidRequestError(
                f"the chat template rejected the messages: {exc}", "messages"
            ) from None


def _check_unicode(text: str, param: str) -> None:
    """JSON can carry lone UTF-16 surrogates ("\\ud8a2") that no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{param} is not valid Unicode: {exc.reason} at position {exc.start}", param
        ) from None


def word_level_tokenizer(vocab_size: int) -> Any:
    """A tokenizer that needs no file ("w5" is token 5), for random-weight models that are fed
    token ids: benchmarks and tests on machines without the embedded model."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def _converted_tokenizer_dir(path: str) -> str:
    st = os.stat(path)
    key = f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(kiln_cache_dir(), "tokenizers", digest)


def _convert_gguf_tokenizer(path: str, target: str) -> None:
    from transformers import AutoTokenizer

    logger.info("converting the GGUF tokenizer of %s (cached for later runs)", path)
    try:
        hf = AutoTokenizer.from_pretrained(
            os.path.dirname(path) or ".", gguf_file=os.path.basename(path)
        )
    except Exception as exc:
        raise ModelLoadError(
            f"cannot build a tokenizer from the GGUF metadata of {path!r}: {exc}"
        ) from None
    tmp = temp_dir_in(writable_dir(os.path.dirname(target)))
    hf.save_pretrained(tmp)
    try:
        os.rename(tmp, target)  # atomic: a concurrent conversion either wins or finds it done
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
