"""Starting and stopping a server under test: `kiln serve --profile ...` or an external engine's
command, each in its own process with its own log and (for kiln) its own compile cache."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

from kiln.bench.client import BenchError
from kiln.default_model import cached_hf_export, default_model_path
from kiln.profiles import Profile


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kiln_serve_command(profile: Profile, port: int, model: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "kiln", "serve", "--profile", profile.path, "--port", str(port)]
    path = launch_model(profile, model)
    return [*cmd, path] if path else cmd


def external_command(profile: Profile, port: int, model: str | None) -> list[str]:
    """Fills {python} (the profile's interpreter, else kiln's), {port}, {cpus} and {model} (the
    model's file or directory; the embedded GGUF by default)."""
    values = {
        "python": profile_python(profile) if "{python}" in "".join(profile.command) else "",
        "port": str(port),
        "model": launch_model(profile, model) or default_model_path(),
        "cpus": str(os.cpu_count() or 1),
    }
    return [arg.format(**values) for arg in profile.command]


def launch_model(profile: Profile, model: str | None) -> str | None:
    """The model a launch serves: --model, else the profile's (None: the embedded GGUF). An HF
    export the profile names is written first, once, into this process's kiln cache, and passed
    by path: a kiln server under test runs with a fresh KILN_CACHE_DIR of its own."""
    if model:
        return model
    if profile.export_from:
        return cached_hf_export(profile.export_from)
    return profile.model


def profile_python(profile: Profile) -> str:
    """The profile's `python` with ${VAR:-default}, $VAR and ~ expanded (kiln's interpreter if
    it names none), checked before the launch: a missing environment is a setup step to name,
    not a boot failure to read from a log."""
    if profile.python is None:
        return sys.executable
    with_defaults = re.sub(
        r"\$\{(\w+):-([^}]*)\}", lambda m: os.environ.get(m[1]) or m[2], profile.python
    )
    path = os.path.expanduser(os.path.expandvars(with_defaults))
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise BenchError(
            f"profile {profile.name!r}: python = {profile.python!r} is {path!r}, which is not an "
            "executable file: create that environment (docs/benchmark.md) or set the variable "
            "the profile names to an interpreter that has the engine installed"
        )
    return path


@dataclass
class LaunchedServer:
    proc: subprocess.Popen
    base_url: str
    log_path: str
    boot_s: float
    command: list[str]

    def death_note(self) -> str:
        """How the process ended and the end of its log, where it has exited (a crash is why a
        connection was refused); empty while it runs."""
        code = self.proc.poll()
        if code is None:
            return ""
        how = f"status {code}"
        if code < 0:
            try:
                how = f"signal {signal.Signals(-code).name}"
            except ValueError:
                how = f"signal {-code}"
        return f"; the server had exited with {how} (log {self.log_path}):\n{_tail(self.log_path)}"

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM (kiln drains and exits 0), SIGKILL after the timeout."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def launch(
    command: list[str],
    port: int,
    log_path: str,
    env: dict[str, str] | None = None,
    boot_timeout: float = 900,
    ready_path: str = "/v1/models",
) -> LaunchedServer:
    """Starts the command and waits until `ready_path` answers 200, the process exits (an
    error quoting its log) or the timeout passes (the process is stopped)."""
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL
        )
    server = LaunchedServer(proc, base, log_path, 0.0, command)
    while time.monotonic() - t0 < boot_timeout:
        if proc.poll() is not None:
            raise BenchError(
                f"the server exited with status {proc.returncode} during boot "
                f"({' '.join(command)}):\n{_tail(log_path)}"
            )
        if _ready(base + ready_path):
            server.boot_s = time.monotonic() - t0
            return server
        time.sleep(0.25)  # readiness polling, bounded by the boot timeout
    server.stop()
    raise BenchError(
        f"the server was not ready after {boot_timeout:.0f} s; raise --boot-timeout "
        f"(log: {log_path}):\n{_tail(log_path)}"
    )


def _ready(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _tail(path: str, n: int = 20) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])


def server_env(cache_dir: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("KILN_API_KEY", None)
    if cache_dir is not None:
        env["KILN_CACHE_DIR"] = cache_dir
    return env
