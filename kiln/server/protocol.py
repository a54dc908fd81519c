"""Request bodies of the OpenAI API (pydantic), and the error envelope. Unknown fields are
ignored (logged at debug), as vLLM does, so clients that send extras keep working; known ones
that would change the output and that kiln does not implement are a 400 (UNSUPPORTED)."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiln.sampling_params import MAX_LOGPROBS, SamplingParams

logger = logging.getLogger(__name__)


# Fields of OpenAI's or vLLM's API that would change the output and that kiln does not
# implement: a request that uses them is refused rather than answered as if they were absent.
UNSUPPORTED = {
    "response_format": "structured output (JSON mode, JSON schema)",
    "tools": "tool calling",
    "functions": "function calling",
    "suffix": "completion suffixes",
    "best_of": "best_of",
    "prompt_logprobs": "prompt logprobs",
    "guided_json": "guided decoding",
    "guided_regex": "guided decoding",
    "guided_choice": "guided decoding",
    "guided_grammar": "guided decoding",
    "structured_outputs": "structured output",
}


def _in_use(name: str, value: Any) -> bool:
    """Whether a request asks for the feature, not just sends the field's neutral value."""
    if name == "response_format":
        return isinstance(value, dict) and value.get("type", "text") != "text"
    if name == "best_of":
        return value not in (None, 1)
    return not (value is None or value is False or value in ("", [], {}))


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _refuse_unsupported_then_ignore_extras(self) -> _Request:
        extras = self.model_extra or {}
        for name, value in extras.items():
            if name in UNSUPPORTED and _in_use(name, value):
                raise ValueError(
                    f"{name}: kiln does not support {UNSUPPORTED[name]}; remove {name}"
                )
        if extras:
            logger.debug("ignoring unknown request fields %s", sorted(extras))
        return self


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(_Request):
    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    include_stop_str_in_output: bool = False  # vLLM's extras
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.logit_bias,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # each choice's text starts with its prompt

    @model_validator(mode="after")
    def _echo_without_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            # OpenAI then returns the prompt's logprobs too, which kiln does not compute
            raise ValueError("echo with logprobs is not supported (no prompt logprobs): drop one")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _text_parts_only(self) -> ChatMessage:
        for part in self.content if isinstance(self.content, list) else ():
            if part.get("type") != "text":
                kind = part.get("type", "(no type)")
                raise ValueError(
                    f"content part type {kind!r} is not supported: kiln serves text-only "
                    "models; send text parts"
                )
        return self

    def text(self) -> str:
        if isinstance(self.content, list):  # text parts only (checked above)
            return "".join(p.get("text", "") for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


def error_body(
    message: str, type_: str, param: str | None = None, code: int | str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
