"""`kiln serve [MODEL]`: the OpenAI-compatible server on uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import threading

from kiln.cli.engine_args import add_engine_args, engine_kwargs
from kiln.errors import ConfigError

logger = logging.getLogger("kiln.serve")

SERVE_DEFAULTS = {
    "host": "127.0.0.1",
    "port": 8000,
    "max_waiting_requests": 256,
    "shutdown_timeout": 30.0,
    "max_body_bytes": 8 * 2**20,
}


def resolve_serve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Flags given on the command line win over the profile, which wins over the defaults."""
    merged = dict(SERVE_DEFAULTS)
    if args.profile:
        from kiln.profiles import load_profile

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


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a .gguf file or a local HF directory (default: the embedded model)",
    )
    p.add_argument("--host", help=f"default {SERVE_DEFAULTS['host']}")
    p.add_argument("--port", type=int, help=f"default {SERVE_DEFAULTS['port']}")
    p.add_argument(
        "--api-key",
        default=os.environ.get("KILN_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/* (or set KILN_API_KEY)",
    )
    p.add_argument("--served-model-name", help="the model id clients send (default: file name)")
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        help="queue bound; beyond it requests get 503 with Retry-After (default 256)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        help="seconds running requests get to finish on SIGTERM/SIGINT (default 30)",
    )
    p.add_argument("--max-body-bytes", type=int, help="request size limit (default 8 MiB)")
    p.add_argument(
        "--profile",
        help="a launcher profile (shipped name or .toml path) that sets every serving option; "
        "flags given here override it",
    )
    add_engine_args(p)
    p.set_defaults(func=run_serve)


def _served_name(model: str | None, path: str) -> str:
    from kiln.loader.default_model import DEFAULT_MODEL_NAME

    if model is None:
        return DEFAULT_MODEL_NAME
    base = os.path.basename(os.path.normpath(path))
    return base[:-5] if base.endswith(".gguf") else base


def _graceful_server_class():
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGTERM/SIGINT after draining, which ends the process with a
        signal status; kiln's drain is the intended end, so it exits 0."""

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

    return GracefulServer


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kiln.engine import LLMEngine
    from kiln.llm import engine_config
    from kiln.server.app import build_app
    from kiln.server.async_engine import AsyncEngine

    args = resolve_serve_args(args)
    logging.getLogger("kiln").setLevel(logging.INFO)
    engine_cfg = engine_config(args.model, **engine_kwargs(args))
    async_engine = AsyncEngine(lambda: LLMEngine(engine_cfg), args.max_waiting_requests)
    engine = async_engine.engine
    name = args.served_model_name or _served_name(args.model, engine.source.path)
    app = build_app(async_engine, name, args.api_key, args.max_body_bytes)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level="info",
        timeout_graceful_shutdown=args.shutdown_timeout,
    )
    server = _graceful_server_class()(config)
    logger.info("serving %s as %r on http://%s:%d", engine.source.path, name, args.host, args.port)
    server.run()  # returns after SIGTERM/SIGINT once connections drained (or the timeout)
    async_engine.abort_all()
    async_engine.stop(timeout=args.shutdown_timeout)
    return 0
