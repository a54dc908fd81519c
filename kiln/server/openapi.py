"""The OpenAPI document, true to what the server does: the responses each route gives (OpenAI's
error envelope with 400, never FastAPI's 422), the shapes of the bodies, text/event-stream when
streaming and Prometheus text for /metrics, the API key where one is set, and the bounds that
come from the served model (token ids below its vocabulary, token prompts shorter than its
context). `schemathesis run URL/openapi.json --checks all` checks the server against it."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

FinishReason = Literal["stop", "length", "abort"]  # abort: the server stopped it (shutdown)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int | str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None  # the stop token or string that ended it (vLLM's)


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


_ERRORS = {
    400: "invalid parameters, a prompt longer than the context, malformed JSON",
    401: "a missing or wrong API key (only when the server has one)",
    404: "the request names another model than the one served",
    413: "the request body is larger than --max-body-bytes",
    500: "an internal error (a bug: the log has its traceback)",
    503: "the waiting queue is full, or the server is shutting down; retry after Retry-After",
}
_HEADERS = {
    401: {"WWW-Authenticate": {"schema": {"type": "string"}, "required": True}},
    503: {"Retry-After": {"schema": {"type": "string"}, "required": True}},
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The error responses a route can give, in OpenAI's envelope; 500 for every route."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in sorted({*codes, 500}):
        out[code] = {"model": ErrorResponse, "description": _ERRORS[code]}
        if code in _HEADERS:
            out[code]["headers"] = _HEADERS[code]
    return out


# one server-sent event (OpenAPI 3.1: the schema of a text/event-stream describes each event)
_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "type": "string",
            "description": "a chunk object as JSON, with `choices[].delta` (chat) or "
            "`choices[].text` (completions); the last event is `[DONE]`",
        },
        "event": {"type": "string"},
    },
}


def streamed(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A 200 that is `model` as JSON, or server-sent events with `"stream": true`."""
    return {200: {"model": model, "content": {"text/event-stream": {"schema": _EVENT}}}}


def install_openapi(app: FastAPI, vocab_size: int, max_model_len: int, api_key: bool) -> None:
    """Replace the app's document with the true one, built once, on first request."""

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _drop_validation_errors(schema)
            _bound_by_model(schema, vocab_size, max_model_len)
            _document_api_key(schema, api_key)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = document


def _operations(schema: dict[str, Any]):
    for path, item in schema.get("paths", {}).items():
        for method, operation in item.items():
            yield path, method, operation


def _drop_validation_errors(schema: dict[str, Any]) -> None:
    """FastAPI documents a 422 on every route with a body; kiln answers those with 400."""
    for _, _, operation in _operations(schema):
        operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)


def _bound_by_model(schema: dict[str, Any], vocab_size: int, max_model_len: int) -> None:
    """Token ids below the vocabulary, and token prompts that leave room for one new token."""
    id_bound = {"minimum": 0, "maximum": vocab_size - 1}
    for node in _walk(schema.get("components", {}).get("schemas", {})):
        _bound_token_lists(node, id_bound, max_model_len)
        props = node.get("properties", {})
        if "logit_bias" in props:
            props["logit_bias"] = _logit_bias_schema(vocab_size)


def _bound_token_lists(node: dict[str, Any], id_bound: dict, max_model_len: int) -> None:
    items = node.get("items")
    if node.get("type") != "array" or not isinstance(items, dict):
        return
    if items.get("type") == "integer" and items.get("minimum") == 0:
        items.update(id_bound)
        if node.get("minItems") == 1:  # a prompt: the model must be able to add a token
            node["maxItems"] = max_model_len - 1


def _logit_bias_schema(vocab_size: int) -> dict[str, Any]:
    bias = {"type": "number", "minimum": -100, "maximum": 100}
    keys = {"type": "string", "pattern": f"^({decimal_below(vocab_size)})$"}
    table = {"type": "object", "propertyNames": keys, "additionalProperties": bias}
    return {"anyOf": [table, {"type": "null"}], "description": "token id (a JSON key) -> bias"}


def decimal_below(bound: int) -> str:
    """A regular expression for the decimal numbers 0 .. bound - 1, no leading zeros."""
    top = str(bound - 1)
    alternatives = ["0"]
    for length in range(1, len(top)):  # every number with fewer digits than the top one
        alternatives.append("[1-9]" + "[0-9]" * (length - 1))
    alternatives += _same_length_below(top)
    return "|".join(dict.fromkeys(alternatives))


def _same_length_below(top: str) -> list[str]:
    """Numbers with as many digits as `top` and at most `top`."""
    out = []
    for i, digit in enumerate(top):
        lowest = "1" if i == 0 else "0"
        if int(digit) > int(lowest):
            upper = str(int(digit) - 1)
            out.append(top[:i] + f"[{lowest}-{upper}]" + "[0-9]" * (len(top) - i - 1))
    out.append(top)
    return [p for p in out if not (len(top) == 1 and p == "0")]


def _walk(node: Any):
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def _document_api_key(schema: dict[str, Any], api_key: bool) -> None:
    """With a key: /v1 needs it (bearer), and answers 401 without it. Without: no 401."""
    if not api_key:
        for _, _, operation in _operations(schema):
            operation.get("responses", {}).pop("401", None)
        return
    schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes["apiKey"] = {"type": "http", "scheme": "bearer", "description": "--api-key"}
    for path, _, operation in _operations(schema):
        if path.startswith("/v1"):
            operation["security"] = [{"apiKey": []}]
