"""The FastAPI app: OpenAI endpoints, errors in the OpenAI envelope, auth, metrics."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

import kiln
from kiln.errors import InvalidRequestError
from kiln.outputs import RequestOutput
from kiln.server.async_engine import AsyncEngine, EngineOverloaded, EngineStopped
from kiln.server.metrics import ServerMetrics
from kiln.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from kiln.server.responses import ResponseBuilder

logger = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/metrics", "/version", "/docs", "/openapi.json")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def _error(
    status: int, message: str, type_: str, param: str | None = None, headers: dict | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, status), status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid request")
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {msg}", None
    return (f"{param}: {msg}" if param else msg), param


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
    core = engine.engine

    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        if api_key and path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _error(
                    401,
                    "invalid or missing API key (send 'Authorization: Bearer KEY')",
                    "AuthenticationError",
                )
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > max_body_bytes:
            return _error(
                413,
                f"the request body is {length} bytes; the limit is {max_body_bytes}",
                "BadRequestError",
            )
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _error(400, message, "BadRequestError", param)

    @app.exception_handler(InvalidRequestError)
    async def on_invalid(request: Request, exc: InvalidRequestError):
        return _error(400, str(exc), "BadRequestError", exc.param)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return _error(exc.status, exc.message, exc.type, exc.param)

    @app.exception_handler(EngineOverloaded)
    async def on_overload(request: Request, exc: EngineOverloaded):
        return _error(
            503,
            f"the server is overloaded: {exc}; retry later",
            "ServiceUnavailableError",
            headers={"Retry-After": "1"},
        )

    @app.exception_handler(EngineStopped)
    async def on_stopped(request: Request, exc: EngineStopped):
        return _error(503, str(exc), "ServiceUnavailableError", headers={"Retry-After": "5"})

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        kind = {404: "NotFoundError", 405: "MethodNotAllowedError"}.get(exc.status_code, "Error")
        return _error(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception):
        logger.exception("internal error on %s", request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}", "InternalServerError")

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise APIError(
                404,
                f"The model `{name}` does not exist; this server serves `{served_model_name}`",
                "NotFoundError",
                "model",
            )

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/version")
    async def version() -> dict:
        return {"version": kiln.__version__}

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": served_model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "kiln",
                    "root": core.source.path,
                    "parent": None,
                    "max_model_len": core.max_model_len,
                }
            ],
        }

    @app.get("/v1/engine")
    async def engine_info() -> dict:
        st = core.stats()
        return {
            "model": core.source.path,
            "model_config": core.model_config.to_dict(),
            "max_model_len": core.max_model_len,
            "device": str(core.device),
            "dtype": core.config.dtype,
            "scheduler": vars(core.config.scheduler),
            "cache": vars(core.config.cache),
            "attention_backend": {
                "name": core.attn_backend.name,
                "graph_support": core.attn_backend.graph_support.value,
            },
            "graph_plan": core.plan.to_dict(),
            "boot": dict(core.boot_phases),
            "capture": core.capture_stats(),
            "stats": {**vars(st), "prefix_cache_hit_rate": st.prefix_cache_hit_rate},
            "num_blocks": st.num_blocks,
            "num_free_blocks": st.num_free_blocks,
        }

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(body.model)
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
        check_model(body.model)
        vocab = core.model_config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens must be in [0, {vocab})", "BadRequestError", "tokens")
        return {"prompt": core.tokenizer.decode(body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompts = _completion_prompts(body.prompt)
        logprobs = body.logprobs
        return await _serve(request, body, "completion", prompts, logprobs)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        messages = [m.model_dump(exclude_none=True) | {"content": m.text()} for m in body.messages]
        text = core.tokenizer.apply_chat_template(messages, body.add_generation_prompt)
        ids = core.tokenizer.encode(text, add_special_tokens=False)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await _serve(request, body, "chat", [(text, ids)], logprobs)

    async def _serve(request: Request, body, kind: str, prompts, logprobs):
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        prepared = []
        for text, ids in prompts:
            if ids is None:
                ids = core.tokenizer.encode(text)
            # like vLLM: no max_tokens means "up to the context length"
            limit = max_tokens or max(1, core.max_model_len - len(ids))
            params = body.sampling_params(limit, logprobs)
            prepared.append((text, core.prepare_prompt(ids, params)[1], params))
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        rid = engine.new_request_id(prefix)
        builder = ResponseBuilder(kind, rid, served_model_name)
        streams = [
            engine.generate(f"{rid}-{i}", t, ids, p) for i, (t, ids, p) in enumerate(prepared)
        ]
        if body.stream:
            first = await _first_items(streams)  # raises 503 before any byte is sent
            return StreamingResponse(
                _sse(builder, streams, first, body), media_type="text/event-stream"
            )
        return JSONResponse(await _collect(request, streams, builder, body.n))

    return app


def _completion_prompts(prompt) -> list[tuple[str | None, list[int] | None]]:
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt:
        raise InvalidRequestError("prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [(None, list(prompt))]
    return [(p, None) if isinstance(p, str) else (None, list(p)) for p in prompt]


async def _first_items(streams) -> list[RequestOutput | None]:
    """Start every stream (admission errors surface here, as HTTP errors)."""
    firsts = []
    for s in streams:
        try:
            firsts.append(await s.__anext__())
        except StopAsyncIteration:
            firsts.append(None)
        except BaseException:
            for other in streams:
                await other.aclose()
            raise
    return firsts


async def _collect(request: Request, streams, builder: ResponseBuilder, n: int) -> dict:
    async def last(stream) -> RequestOutput:
        out = None
        async for out in stream:  # noqa: B007 - the last output is the final one
            pass
        return out

    tasks = [asyncio.ensure_future(last(s)) for s in streams]
    while not all(t.done() for t in tasks):
        await asyncio.wait(tasks, timeout=0.5)
        if await request.is_disconnected():
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise APIError(499, "client disconnected", "ClientDisconnected")
    return builder.final([t.result() for t in tasks], n)


async def _sse(builder: ResponseBuilder, streams, firsts, body) -> AsyncIterator[str]:
    queue: asyncio.Queue = asyncio.Queue()
    finals: dict[int, RequestOutput] = {}

    async def pump(i: int, stream, first) -> None:
        try:
            if first is not None:
                await queue.put((i, first))
            async for out in stream:
                await queue.put((i, out))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
    sent_role: set[int] = set()
    lp_sent: dict[int, int] = {}
    done = 0
    try:
        while done < len(tasks):
            i, out = await queue.get()
            if out is None:
                done += 1
                continue
            if out.finished:
                finals[i] = out
            for c in out.outputs:
                if not (c.delta_text or c.finished or c.delta_token_ids):
                    continue
                index = i * body.n + c.index
                chunk = builder.chunk(index, c, index not in sent_role, lp_sent.get(index, 0))
                sent_role.add(index)
                lp_sent[index] = len(c.logprobs or [])
                if chunk["choices"][0].get("finish_reason") == "abort":
                    chunk["choices"][0]["finish_reason"] = "stop"
                if body.include_usage:
                    chunk["usage"] = None
                yield f"data: {json.dumps(chunk)}\n\n"
        if body.include_usage:
            yield f"data: {json.dumps(builder.usage_chunk(list(finals.values())))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()
