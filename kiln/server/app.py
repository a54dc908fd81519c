"""The FastAPI app: OpenAI endpoints, auth and body-size limits, kiln's engine info, metrics."""

from __future__ import annotations

import secrets

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import kiln
from kiln.engine.llm_engine import LLMEngine
from kiln.errors import InvalidRequestError
from kiln.server.async_engine import AsyncEngine
from kiln.server.errors import APIError, add_error_handlers, error_response
from kiln.server.metrics import ServerMetrics
from kiln.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kiln.server.responses import ResponseBuilder
from kiln.server.streaming import collect, first_items, sse


def build_app(
    engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = 8 * 2**20,
) -> FastAPI:
    app = FastAPI(title="kiln", version=kiln.__version__)
    metrics = ServerMetrics(engine.engine, lambda: engine.num_waiting)
    engine.on_output = metrics.observe
    app.state.engine, app.state.metrics = engine, metrics
    _add_guard(app, api_key, max_body_bytes)
    add_error_handlers(app)
    _add_info_routes(app, engine.engine, served_model_name, metrics)
    _add_token_routes(app, engine.engine, served_model_name)
    _add_generation_routes(app, engine, served_model_name)
    return app


def _add_guard(app: FastAPI, api_key: str | None, max_body_bytes: int) -> None:
    """The API key on /v1 (health, metrics and docs stay open) and the body-size limit."""

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return error_response(
                    401,
                    "invalid or missing API key (send 'Authorization: Bearer KEY')",
                    "AuthenticationError",
                )
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > max_body_bytes:
            return error_response(
                413,
                f"the request body is {length} bytes; the limit is {max_body_bytes}",
                "BadRequestError",
            )
        return await call_next(request)


def _check_model(name: str | None, served: str) -> None:
    if name is not None and name != served:
        raise APIError(
            404,
            f"The model `{name}` does not exist; this server serves `{served}`",
            "NotFoundError",
            "model",
        )


def _add_info_routes(app: FastAPI, core: LLMEngine, served: str, metrics: ServerMetrics) -> None:
    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/version")
    async def version() -> dict:
        return {"version": kiln.__version__}

    @app.get("/v1/models")
    async def models() -> dict:
        model = {
            "id": served,
            "object": "model",
            "created": 0,
            "owned_by": "kiln",
            "root": core.boot.model_path,
            "parent": None,
            "max_model_len": core.max_model_len,
        }
        return {"object": "list", "data": [model]}

    @app.get("/v1/engine")
    async def engine() -> dict:
        return core.describe()

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _add_token_routes(app: FastAPI, core: LLMEngine, served: str) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        _check_model(body.model, served)
        tok = core.tokenizer
        if body.messages is not None:
            text = tok.apply_chat_template(
                [m.model_dump() | {"content": m.text()} for m in body.messages]
            )
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": core.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        _check_model(body.model, served)
        vocab = core.model_config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens must be in [0, {vocab})", "BadRequestError", "tokens")
        return {"prompt": core.tokenizer.decode(body.tokens)}


def _add_generation_routes(app: FastAPI, engine: AsyncEngine, served: str) -> None:
    core = engine.engine

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, served)
        prompts = _completion_prompts(body.prompt)
        return await serve(request, body, "completion", prompts, body.logprobs)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        _check_model(body.model, served)
        messages = [m.model_dump(exclude_none=True) | {"content": m.text()} for m in body.messages]
        text = core.tokenizer.apply_chat_template(messages, body.add_generation_prompt)
        ids = core.tokenizer.encode(text, add_special_tokens=False)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await serve(request, body, "chat", [(text, ids)], logprobs)

    async def serve(request: Request, body, kind: str, prompts, logprobs):
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        prepared = []
        for text, ids in prompts:
            if ids is None:
                ids = core.tokenizer.encode(text)
            # like vLLM: no max_tokens means "up to the context length"
            limit = max_tokens or max(1, core.max_model_len - len(ids))
            params = body.sampling_params(limit, logprobs)
            prepared.append((text, core.prepare_prompt(ids, params)[1], params))
        rid = engine.new_request_id("chatcmpl" if kind == "chat" else "cmpl")
        echo = None
        if getattr(body, "echo", False):
            skip = body.skip_special_tokens
            echo = [t if t is not None else core.tokenizer.decode(i, skip) for t, i, _ in prepared]
        builder = ResponseBuilder(kind, rid, served, body.n, echo)
        streams = [
            engine.generate(f"{rid}-{i}", t, ids, p) for i, (t, ids, p) in enumerate(prepared)
        ]
        if body.stream:
            first = await first_items(streams)  # raises 503 before any byte is sent
            return StreamingResponse(
                sse(builder, streams, first, body), media_type="text/event-stream"
            )
        return JSONResponse(await collect(request, streams, builder))


def _completion_prompts(prompt) -> list[tuple[str | None, list[int] | None]]:
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt:
        raise InvalidRequestError("prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [(None, list(prompt))]
    return [(p, None) if isinstance(p, str) else (None, list(p)) for p in prompt]
