"""The FastAPI app: OpenAI endpoints, auth and body-size limits, kiln's engine info, metrics."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import kiln
from kiln.engine.llm_engine import LLMEngine
from kiln.errors import InvalidRequestError
from kiln.server.async_engine import AsyncEngine
from kiln.server.errors import APIError, add_error_handlers
from kiln.server.metrics import ServerMetrics
from kiln.server.middleware import RequestGuard, ResponseCounter
from kiln.server.openapi import (
    ChatCompletion,
    Completion,
    DetokenizeResponse,
    ModelList,
    TokenizeResponse,
    VersionResponse,
    errors,
    install_openapi,
    streamed,
)
from kiln.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kiln.server.responses import ResponseBuilder
from kiln.server.streaming import AbortingStream, collect, first_items, sse


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
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_body_bytes)
    app.add_middleware(ResponseCounter, counter=metrics.http_responses)  # outermost: sees all
    add_error_handlers(app)
    vocab, context = engine.engine.model_config.vocab_size, engine.engine.max_model_len
    install_openapi(app, vocab, context, api_key is not None)
    _add_info_routes(app, engine.engine, served_model_name, metrics)
    _add_token_routes(app, engine.engine, served_model_name)
    _add_generation_routes(app, engine, served_model_name)
    return app


GENERATION_ERRORS = errors(400, 401, 404, 413, 503)


def _check_model(name: str | None, served: str) -> None:
    if name is not None and name != served:
        raise APIError(
            404,
            f"The model `{name}` does not exist; this server serves `{served}`",
            "NotFoundError",
            "model",
        )


def _add_info_routes(app: FastAPI, core: LLMEngine, served: str, metrics: ServerMetrics) -> None:
    @app.get("/health", responses=errors())
    async def health() -> dict:
        return {}

    @app.get(
        "/version", response_model=None, responses={200: {"model": VersionResponse}, **errors()}
    )
    async def version() -> dict:
        return {"version": kiln.__version__}

    @app.get(
        "/v1/models", response_model=None, responses={200: {"model": ModelList}, **errors(401)}
    )
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

    @app.get("/v1/engine", responses=errors(401))
    async def engine() -> dict:
        """The resolved configuration (graph plan, compilation, capture, boot) and live stats."""
        return core.describe()

    @app.get("/metrics", response_class=PlainTextResponse, responses=errors())
    async def prometheus() -> PlainTextResponse:
        """Prometheus' text format."""
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _add_token_routes(app: FastAPI, core: LLMEngine, served: str) -> None:
    @app.post(
        "/tokenize",
        response_model=None,
        responses={200: {"model": TokenizeResponse}, **errors(400, 404, 413)},
    )
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

    @app.post(
        "/detokenize",
        response_model=None,
        responses={200: {"model": DetokenizeResponse}, **errors(400, 404, 413)},
    )
    async def detokenize(body: DetokenizeRequest) -> dict:
        _check_model(body.model, served)
        vocab = core.model_config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens must be in [0, {vocab})", "BadRequestError", "tokens")
        return {"prompt": core.tokenizer.decode(body.tokens)}


def _add_generation_routes(app: FastAPI, engine: AsyncEngine, served: str) -> None:
    core = engine.engine

    @app.post("/v1/completions", responses={**streamed(Completion), **GENERATION_ERRORS})
    async def completions(body: CompletionRequest, request: Request):
        _check_model(body.model, served)
        prompts = _completion_prompts(body.prompt)
        return await serve(request, body, "completion", prompts, body.logprobs)

    @app.post("/v1/chat/completions", responses={**streamed(ChatCompletion), **GENERATION_ERRORS})
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
            # no max_tokens, or more than the context leaves: up to the context length (a
            # prompt that fills the context is refused by prepare_prompt)
            room = max(1, core.max_model_len - len(ids))
            limit = min(max_tokens, room) if max_tokens else room
            params = body.sampling_params(limit, logprobs)
            prepared.append((text, core.prepare_prompt(ids, params)[1], params))
        rid = engine.new_request_id("chatcmpl" if kind == "chat" else "cmpl")
        echo = None
        if getattr(body, "echo", False):
            skip = body.skip_special_tokens
            echo = [t if t is not None else core.tokenizer.decode(i, skip) for t, i, _ in prepared]
        builder = ResponseBuilder(kind, rid, served, body.n, echo)
        rids = [f"{rid}-{i}" for i in range(len(prepared))]
        engine.admit(len(prepared))  # all of the request, or a 503 before anything runs
        streams = [
            engine.generate(r, t, ids, p, admitted=True) for r, (t, ids, p) in zip(rids, prepared)
        ]
        try:
            if body.stream:
                first = await first_items(streams)
                events = sse(builder, streams, first, body)
                return AbortingStream(events, on_close=lambda: [engine.abort(r) for r in rids])
            return JSONResponse(await collect(request, streams, builder))
        except BaseException:  # a disconnect, an engine failure: nothing may run on unwatched
            for r in rids:
                engine.abort(r)
            raise


def _completion_prompts(prompt) -> list[tuple[str | None, list[int] | None]]:
    if isinstance(prompt, str):
        return [(prompt, None)]
    if not prompt:
        raise InvalidRequestError("prompt is empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [(None, list(prompt))]
    return [(p, None) if isinstance(p, str) else (None, list(p)) for p in prompt]
