"""Request bodies of the OpenAI API (pydantic), and the error envelope. Unknown fields are
ignored (logged at debug), as vLLM does, so clients that send extras keep working; known ones
that would change the output and that kiln does not implement are a 400 (UNSUPPORTED)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

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


def _neutral(name: str, value: Any) -> bool:
    """Whether the request sends the field without asking for the feature: JSON's null, false,
    "", [] or {} (for best_of also 1, for response_format a "text" format). The same values,
    and only these, are what the OpenAPI document allows (NEUTRAL_SCHEMAS)."""
    if value is None:
        return True
    if name == "response_format":
        return isinstance(value, dict) and value.get("type", "text") == "text"
    if name == "best_of":
        return type(value) in (int, float) and value == 1
    return value is False or (type(value) in (str, list, dict) and len(value) == 0)


_EMPTY = [
    {"type": "null"},
    {"const": False},
    {"type": "string", "maxLength": 0},
    {"type": "array", "maxItems": 0},
    {"type": "object", "maxProperties": 0},
]
NEUTRAL_SCHEMAS = {
    name: {"anyOf": _EMPTY, "description": f"not supported ({what}): only an empty value"}
    for name, what in UNSUPPORTED.items()
}
NEUTRAL_SCHEMAS["best_of"] = {
    "anyOf": [{"type": "null"}, {"const": 1}],
    "description": "not supported: only 1",
}
NEUTRAL_SCHEMAS["response_format"] = {
    "anyOf": [
        {"type": "null"},
        {"type": "object", "properties": {"type": {"const": "text"}}},
    ],
    "description": "only the plain text format: structured output is not supported",
}


def _schema(*rules: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    """A model's JSON schema extras: the unsupported fields with the values they may take,
    and the rules across fields that the model's validators enforce, as JSON Schema."""

    def extra(schema: dict[str, Any]) -> None:
        schema.setdefault("properties", {}).update(NEUTRAL_SCHEMAS)
        if rules:
            schema["allOf"] = list(rules)

    return extra


# strict: JSON's types as the OpenAPI document states them ("1.5" is no number, true no 1)
_STRICT = ConfigDict(extra="allow", strict=True)


def _whole(value: Any) -> Any:
    """JSON Schema's integers include numbers like 3.0; pydantic's strict ones do not."""
    return int(value) if type(value) is float and value.is_integer() else value


def _signed_64(value: int) -> int:
    """The same value for every 64-bit seed, the rest wrapped into that range."""
    return (value + 2**63) % 2**64 - 2**63


# the constraint before the validator, or pydantic documents it as an unknown "ge" keyword
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(_whole)]
NonNegativeInt = Annotated[int, Field(ge=0), BeforeValidator(_whole)]
TopK = Annotated[int, Field(ge=-1), BeforeValidator(_whole)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), BeforeValidator(_whole)]
NumChoices = Annotated[int, Field(ge=1, le=128), BeforeValidator(_whole)]
# any integer: one outside 64 bits is taken modulo 2**64 (its float bounds are not exact in JSON)
Seed = Annotated[int, BeforeValidator(_whole)]

# token ids and prompt lengths: their upper bounds are the served model's, added to the
# OpenAPI document when the app is built (openapi.py), and checked against the model
TokenId = NonNegativeInt
TokenPrompt = Annotated[list[TokenId], Field(min_length=1)]
NonEmptyText = Annotated[str, Field(min_length=1)]
# logit_bias keys are token ids written as JSON object keys: decimal, no sign, no leading zero
BiasKey = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]*)$")]
Bias = Annotated[float, Field(ge=-100, le=100)]


class _Request(BaseModel):
    model_config = ConfigDict(**_STRICT, json_schema_extra=_schema())

    @model_validator(mode="after")
    def _refuse_unsupported_then_ignore_extras(self) -> _Request:
        extras = self.model_extra or {}
        for name, value in extras.items():
            if name in UNSUPPORTED and not _neutral(name, value):
                raise ValueError(
                    f"{name}: kiln does not support {UNSUPPORTED[name]}; remove {name}"
                )
        if extras:
            logger.debug("ignoring unknown request fields %s", sorted(extras))
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class _Sampling(_Request):
    model: str | None = None
    n: NumChoices = 1
    max_tokens: PositiveInt | None = Field(
        None, description="at most the context left after the prompt (more is capped)"
    )
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: TopK | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: Seed | None = None
    stop: NonEmptyText | list[NonEmptyText] | None = None
    stop_token_ids: list[TokenId] | None = None
    min_tokens: NonNegativeInt = Field(0, description="capped at max_tokens")
    ignore_eos: bool = False
    logit_bias: dict[BiasKey, Bias] | None = None
    include_stop_str_in_output: bool = False  # vLLM's extras
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
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
            seed=None if self.seed is None else _signed_64(self.seed),
            max_tokens=max_tokens,
            min_tokens=min(self.min_tokens, max_tokens),
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


# OpenAI returns the prompt's logprobs for echo with logprobs, which kiln does not compute
_NO_ECHO_WITH_LOGPROBS = {
    "not": {
        "required": ["echo", "logprobs"],
        "properties": {"echo": {"const": True}, "logprobs": {"type": "integer"}},
    }
}


class CompletionRequest(_Sampling):
    model_config = ConfigDict(**_STRICT, json_schema_extra=_schema(_NO_ECHO_WITH_LOGPROBS))
    prompt: (
        NonEmptyText
        | TokenPrompt
        | Annotated[list[NonEmptyText], Field(min_length=1)]
        | Annotated[list[TokenPrompt], Field(min_length=1)]
    )
    logprobs: TopLogprobs | None = None
    echo: bool = False  # each choice's text starts with its prompt

    @model_validator(mode="after")
    def _echo_without_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs is not supported (no prompt logprobs): drop one")
        return self


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str = ""


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        """Said plainly, before the field's own error (a union of every case) would."""
        content = data.get("content") if isinstance(data, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") != "text":
                raise ValueError(
                    f"content part type {part.get('type', '(no type)')!r} is not supported: "
                    "kiln serves text-only models; send text parts"
                )
        return data

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


_TOP_LOGPROBS_NEED_LOGPROBS = {
    "not": {
        "required": ["top_logprobs"],
        "properties": {
            "top_logprobs": {"type": "integer", "minimum": 1},
            "logprobs": {"not": {"const": True}},
        },
    }
}


class ChatCompletionRequest(_Sampling):
    model_config = ConfigDict(**_STRICT, json_schema_extra=_schema(_TOP_LOGPROBS_NEED_LOGPROBS))
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


# exactly one of them, given and not null
_PROMPT_OR_MESSAGES = {
    "anyOf": [
        {
            "required": ["prompt"],
            "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}},
        },
        {
            "required": ["messages"],
            "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}},
        },
    ]
}


class TokenizeRequest(_Request):
    model_config = ConfigDict(**_STRICT, json_schema_extra=_schema(_PROMPT_OR_MESSAGES))
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
    tokens: list[TokenId]


def error_body(
    message: str, type_: str, param: str | None = None, code: int | str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
