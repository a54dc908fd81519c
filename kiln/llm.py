"""The offline Python API, in the spirit of vLLM's `LLM`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from kiln.boot.builder import build_engine
from kiln.config.options import engine_config
from kiln.errors import InvalidRequestError
from kiln.outputs import RequestOutput
from kiln.sampling_params import SamplingParams

Prompt = str | list[int] | dict[str, Any]
Message = dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = build_engine(engine_config(model, **kwargs))
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
