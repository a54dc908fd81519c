"""The offline Python API, in the spirit of vLLM's `LLM`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from kiln.compilation import CompilationConfig
from kiln.config import CacheConfig, EngineConfig, SchedulerConfig, parse_bytes
from kiln.engine import LLMEngine
from kiln.errors import InvalidRequestError
from kiln.outputs import RequestOutput
from kiln.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]
Message = dict[str, Any]


def engine_config(model: str | None = None, **kwargs: Any) -> EngineConfig:
    """Build an EngineConfig from vLLM-style flat keyword arguments."""
    cache_keys = {
        "block_size",
        "kv_cache_memory",
        "kv_cache_memory_fraction",
        "enable_prefix_caching",
    }
    sched_keys = {"max_num_seqs", "max_num_batched_tokens", "max_model_len"}
    engine_keys = {
        "dtype",
        "device",
        "seed",
        "tokenizer",
        "enforce_eager",
        "strict_graphs",
        "attention_backend",
        "boot_timeout",
    }
    compilation = kwargs.pop("compilation_config", None)
    if not isinstance(compilation, CompilationConfig):
        compilation = CompilationConfig.from_json(compilation)
    unknown = set(kwargs) - cache_keys - sched_keys - engine_keys
    if unknown:
        raise TypeError(f"unknown engine options {sorted(unknown)}")
    cache = {k: v for k, v in kwargs.items() if k in cache_keys and v is not None}
    if "kv_cache_memory" in cache:
        cache["kv_cache_memory"] = parse_bytes(cache["kv_cache_memory"])
    sched = {k: v for k, v in kwargs.items() if k in sched_keys and v is not None}
    rest = {k: v for k, v in kwargs.items() if k in engine_keys and v is not None}
    return EngineConfig(
        model=model,
        cache=CacheConfig(**cache),
        scheduler=SchedulerConfig(**sched),
        compilation=compilation,
        **rest,
    )


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(engine_config(model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Free the KV cache and captured graphs now (see LLMEngine.close)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs come back in prompt order."""
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params, len(prompts))
        ids = [self._add(p, sp) for p, sp in zip(prompts, params)]
        finals: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out
        return [_whole(finals[i]) for i in ids]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.chat_prompt(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params)

    def chat_prompt(
        self, messages: list[Message], add_generation_prompt: bool = True
    ) -> dict[str, Any]:
        """The chat template applied and tokenized (the template holds the special tokens)."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return {"prompt_token_ids": ids, "prompt": text}

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield a RequestOutput (with delta_text) each time the request advances."""
        request_id = self._add(prompt, sampling_params or SamplingParams())
        while True:
            for out in self.engine.step():
                if out.request_id == request_id:
                    yield out
                    if out.finished:
                        return

    def _add(self, prompt: Prompt, params: SamplingParams) -> str:
        request_id = str(next(self._ids))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                self.engine.add_request(request_id, prompt["prompt_token_ids"], params)
                self.engine.requests[request_id].prompt = prompt.get("prompt")
                return request_id
            prompt = prompt.get("prompt", "")
        self.engine.add_request(request_id, prompt, params)
        return request_id


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        return [prompts]  # a single prompt given as token ids
    if not prompts:
        raise InvalidRequestError("no prompts given", "prompts")
    return prompts


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    params = list(params)
    if len(params) != n:
        raise InvalidRequestError(
            f"{len(params)} sampling params for {n} prompts", "sampling_params"
        )
    return params


def _whole(out: RequestOutput) -> RequestOutput:
    """A final output holds the whole text and tokens, not the last step's delta."""
    for c in out.outputs:
        c.delta_text, c.delta_token_ids = c.text, list(c.token_ids)
    return out
