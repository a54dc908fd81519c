"""`kiln serve`'s own options, beside the engine's: where it listens, what it answers to, how
much it queues and how long it drains. Each carries its help like the engine options, so the
command line and the launcher profiles derive from these fields (options.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.config.engine import option


@dataclass(frozen=True)
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata=option(str, "default 127.0.0.1"))
    # the port and the key are the launcher's and the operator's to give, not a profile's
    port: int = field(default=8000, metadata=option(int, "default 8000", profile=False))
    api_key: str | None = field(
        default=None,
        metadata=option(
            str,
            "require 'Authorization: Bearer KEY' on /v1/* (or set KILN_API_KEY)",
            profile=False,
        ),
    )
    served_model_name: str | None = field(
        default=None,
        metadata=option(str, "the model id clients send (default: the model's file name)"),
    )
    max_waiting_requests: int = field(
        default=256,
        metadata=option(
            int, "queue bound; beyond it requests get 503 with Retry-After (default 256)"
        ),
    )
    shutdown_timeout: float = field(
        default=30.0,
        metadata=option(
            float, "seconds running requests get to finish on SIGTERM/SIGINT (default 30)"
        ),
    )
    max_body_bytes: int = field(
        default=8 * 2**20, metadata=option(int, "request size limit (default 8 MiB)")
    )
