"""`kiln serve [MODEL]`: the OpenAI-compatible server on uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import threading

import uvicorn

from kiln.boot.builder import build_engine
from kiln.cli.engine_args import engine_kwargs
from kiln.config.options import engine_config
from kiln.config.server import ServerConfig
from kiln.default_model import DEFAULT_MODEL_NAME
from kiln.errors import ConfigError
from kiln.profiles import load_profile
from kiln.server.app import build_app
from kiln.server.async_engine import AsyncEngine

logger = logging.getLogger("kiln.serve")


def resolve_serve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Flags given on the command line win over the profile, which wins over the defaults."""
    merged = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
    merged["api_key"] = os.environ.get("KILN_API_KEY")
    if args.profile:
        profile = load_profile(args.profile)
        if profile.engine != "kiln":
            raise ConfigError(f"profile {profile.name!r} launches another engine, not kiln serve")
        merged |= profile.serve_defaults()
        if args.model is None and profile.model is not None:
            args.model = profile.model
    for key, value in merged.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def _served_name(model: str | None, path: str) -> str:
    if model is None:
        return DEFAULT_MODEL_NAME
    base = os.path.basename(os.path.normpath(path))
    return base[:-5] if base.endswith(".gguf") else base


# after the drain deadline, the time aborted streams get to send their last chunk before
# uvicorn cancels what is left
FLUSH_S = 5.0


class GracefulServer(uvicorn.Server):
    """SIGTERM/SIGINT drain the server: new requests get a 503, running ones get the shutdown
    timeout to finish; then they are aborted, so that every answer still in flight ends with a
    last chunk (finish_reason "abort") and `[DONE]`, or its JSON, instead of being cut off.
    The process then exits 0 (uvicorn would re-raise the signal after draining)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, drain_s: float) -> None:
        super().__init__(config)
        self.engine, self.drain_s = engine, drain_s

    async def shutdown(self, sockets=None) -> None:
        self.engine.refuse_new()
        deadline = asyncio.get_running_loop().call_later(self.drain_s, self.engine.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def run(args: argparse.Namespace) -> int:
    args = resolve_serve_args(args)
    logging.getLogger("kiln").setLevel(logging.INFO)
    engine_cfg = engine_config(args.model, **engine_kwargs(args))
    async_engine = AsyncEngine(lambda: build_engine(engine_cfg), args.max_waiting_requests)
    engine = async_engine.engine
    name = args.served_model_name or _served_name(args.model, engine.boot.model_path)
    app = build_app(async_engine, name, args.api_key, args.max_body_bytes)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        timeout_graceful_shutdown=args.shutdown_timeout + FLUSH_S,
    )
    server = GracefulServer(config, async_engine, args.shutdown_timeout)
    logger.info(
        "serving %s as %r on http://%s:%d", engine.boot.model_path, name, args.host, args.port
    )
    server.run()  # returns after SIGTERM/SIGINT once connections drained (or the timeout)
    async_engine.abort_all()
    async_engine.stop(timeout=args.shutdown_timeout)
    return 0
