"""Start a real `kiln serve` process on a free localhost port and wait until it is healthy
(kiln's own benchmark launcher, so tests and `kiln bench matrix` boot servers the same way)."""

from __future__ import annotations

import os
import sys
import tempfile

from kiln.bench.launcher import free_port, launch, server_env


class ServerProcess:
    def __init__(self, *args: str, api_key: str | None = None, boot_timeout: float = 240) -> None:
        self.port = free_port()
        env = server_env(os.environ.get("KILN_CACHE_DIR"))
        if api_key:
            env["KILN_API_KEY"] = api_key
        fd, log_path = tempfile.mkstemp(prefix="kiln-serve-", suffix=".log")
        os.close(fd)
        command = [sys.executable, "-m", "kiln", "serve", "--port", str(self.port), *args]
        self.server = launch(command, self.port, log_path, env, boot_timeout, "/health")
        self.base = self.server.base_url
        self.proc = self.server.proc

    def stop(self) -> int:
        return self.server.stop()
