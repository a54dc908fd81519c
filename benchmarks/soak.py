"""A soak test of `kiln serve`: minutes of mixed traffic against one server on loopback, then the
checks that it lost nothing.

    python benchmarks/soak.py --duration 300 --clients 8

Traffic, drawn per request from a seeded generator: completions and chat completions, streamed
or not, `n` of 1 or 2, stop strings, short and long prompts, invalid requests (400), and clients
that go away in the middle of an answer (streamed: after a few chunks; one-shot: at a client
timeout). At the end, once the server is idle:

- no 5xx, and every status the way the client expects it (200, 400; 499 for a one-shot request
  whose client left: its response has no reader);
- no traceback and no ERROR line in the server's log;
- every KV block free, no request running or waiting;
- the server's resident memory within `--rss-tolerance` of what it was after a warm-up of the
  same traffic (the KV cache is allocated untouched, so its pages become resident as its blocks
  are first used: the warm-up cycles through them);
- /metrics equal to what the client counted: responses by route and status, and finished
  engine requests (ok + aborted = every prompt admitted).

Prints the figures as JSON and exits 1 when a check fails."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from kiln.bench.launcher import free_port, launch, server_env

WORDS = ["the", "lighthouse", "keeper", "wrote", "a", "long", "letter", "to", "the", "sea",
         "about", "storms", "and", "ships"]  # fmt: skip


@dataclass
class Tally:
    responses: Counter = field(default_factory=Counter)  # (route, status) -> count
    kinds: Counter = field(default_factory=Counter)
    prompts_admitted: int = 0  # engine requests the server took in (one per HTTP request here)
    disconnects: int = 0
    unexpected: list[str] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)  # sampled during the traffic


def _prompt(rng: random.Random) -> str:
    n = rng.choice([3, 12, 60, 200])  # short to a few hundred tokens
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _request(rng: random.Random) -> tuple[str, str, dict, str]:
    """(kind, route, body, what the client does: read | leave_stream | leave_oneshot)."""
    chat = rng.random() < 0.5
    route = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict = {"max_tokens": rng.choice([4, 16, 48]), "temperature": rng.choice([0, 0.8])}
    if chat:
        body["messages"] = [{"role": "user", "content": _prompt(rng)}]
    else:
        body["prompt"] = _prompt(rng)
    body["n"] = rng.choice([1, 1, 2])
    body["stream"] = rng.random() < 0.5
    if rng.random() < 0.3:
        body["stop"] = [rng.choice(WORDS)]
    roll = rng.random()
    if roll < 0.1:
        body["top_p"] = 5  # invalid: a 400
        return "bad_request", route, body, "read"
    if roll < 0.25:
        body.pop("stop", None)
        body.update(max_tokens=400, ignore_eos=True)  # long enough to leave in the middle
        leave = "leave_stream" if body["stream"] else "leave_oneshot"
        return "disconnect", route, body, leave
    return ("stream" if body["stream"] else "oneshot"), route, body, "read"


async def _one(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    kind, route, body, action = _request(rng)
    tally.kinds[kind] += 1
    if action == "leave_stream":
        async with client.stream("POST", route, json=body) as resp:
            chunks = 0
            async for line in resp.aiter_lines():
                chunks += line.startswith("data:")
                if chunks >= 3:
                    break  # leaving the context closes the connection
        tally.responses[(route, resp.status_code)] += 1
        tally.prompts_admitted += 1
        tally.disconnects += 1
        return
    if action == "leave_oneshot":
        try:
            await client.post(route, json=body, timeout=1.5)
        except httpx.ReadTimeout:
            tally.responses[(route, 499)] += 1  # what the server records for it
            tally.prompts_admitted += 1
            tally.disconnects += 1
            return
        tally.unexpected.append(f"{route}: a 400-token answer came back within 1.5 s")
        return
    resp = await _read(client, route, body)
    tally.responses[(route, resp.status_code)] += 1
    expected = 400 if kind == "bad_request" else 200
    if resp.status_code != expected:
        tally.unexpected.append(f"{kind} {route}: {resp.status_code} {resp.text[:200]}")
    elif expected == 200:
        tally.prompts_admitted += 1


async def _read(client: httpx.AsyncClient, route: str, body: dict) -> httpx.Response:
    if not body.get("stream"):
        return await client.post(route, json=body)
    async with client.stream("POST", route, json=body) as resp:
        lines = [line async for line in resp.aiter_lines() if line.startswith("data:")]
    if resp.status_code == 200 and (not lines or lines[-1] != "data: [DONE]"):
        raise AssertionError(f"{route}: a stream that did not end with [DONE]")
    return resp


async def traffic(
    base: str, clients: int, duration: float, seed: int, pid: int | None = None
) -> Tally:
    """`clients` loops of requests for `duration` seconds; with `pid`, that process's RSS
    sampled every 10 s (the trend tells a leak from pages touched once)."""
    tally = Tally()
    deadline = time.monotonic() + duration

    async def sample_rss() -> None:
        while pid is not None and time.monotonic() < deadline:
            tally.rss_mib.append(round(rss_bytes(pid) / 2**20, 1))
            await asyncio.sleep(min(10, max(0, deadline - time.monotonic())))

    async def client_loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=base, timeout=300) as client:
            while time.monotonic() < deadline:
                await _one(client, rng, tally)

    await asyncio.gather(sample_rss(), *(client_loop(i) for i in range(clients)))
    return tally


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def wait_idle(base: str, timeout: float = 120) -> dict:
    """/v1/engine once nothing runs or waits (aborts land within a step or two)."""
    end = time.monotonic() + timeout
    while True:
        info = httpx.get(base + "/v1/engine", timeout=10).json()
        idle = info["stats"]["num_running"] == 0 and info["stats"]["num_waiting"] == 0
        if idle or time.monotonic() > end:
            return info
        time.sleep(0.2)  # polling a condition, bounded by `timeout`


def scrape(base: str) -> tuple[Counter, Counter]:
    """kiln_http_requests_total by (route, status) and kiln_requests_total by status."""
    text = httpx.get(base + "/metrics", timeout=10).text
    http, engine = Counter(), Counter()
    for m in re.finditer(r'kiln_http_requests_total\{handler="([^"]*)",method="POST",'
                         r'status="(\d+)"\} ([0-9.]+)', text):  # fmt: skip
        http[(m.group(1), int(m.group(2)))] = int(float(m.group(3)))
    for m in re.finditer(r'kiln_requests_total\{status="(\w+)"\} ([0-9.]+)', text):
        engine[m.group(1)] = int(float(m.group(2)))
    return http, engine


def checks(tally: Tally, info: dict, log: str, rss: tuple[int, int], tol: float, base: str):
    http, engine = scrape(base)
    before, after = rss
    failed = list(tally.unexpected)
    if any(status >= 500 for _, status in tally.responses):
        failed.append(f"5xx responses: {dict(tally.responses)}")
    for marker in ("Traceback", "ERROR"):
        if marker in log:
            failed.append(f"{marker} in the server log")
    if info["num_free_blocks"] != info["num_blocks"]:
        failed.append(f"KV blocks in use when idle: {info['num_blocks'] - info['num_free_blocks']}")
    if after > before * (1 + tol):
        failed.append(f"RSS grew {after / before - 1:.1%} (> {tol:.0%})")
    if http != tally.responses:
        failed.append(f"/metrics responses {dict(http)} != the client's {dict(tally.responses)}")
    if engine["ok"] + engine["aborted"] != tally.prompts_admitted:
        failed.append(f"/metrics requests {dict(engine)} != the {tally.prompts_admitted} admitted")
    return failed, engine


def run(args: argparse.Namespace) -> dict:
    port, log_path = free_port(), tempfile.mkstemp(prefix="kiln-soak-", suffix=".log")[1]
    command = [sys.executable, "-m", "kiln", "serve", "--port", str(port), *args.serve_args]
    server = launch(command, port, log_path, server_env(os.environ.get("KILN_CACHE_DIR")))
    try:
        # the same traffic first: the KV cache's pages are resident once its blocks have all
        # been used (it is allocated untouched), and the allocators have their pools
        warm = asyncio.run(traffic(server.base_url, args.clients, args.warmup, args.seed + 1))
        wait_idle(server.base_url)
        rss_warm = rss_bytes(server.proc.pid)
        t0 = time.monotonic()
        pid = server.proc.pid
        tally = asyncio.run(traffic(server.base_url, args.clients, args.duration, args.seed, pid))
        elapsed = time.monotonic() - t0
        info = wait_idle(server.base_url)
        rss_end = rss_bytes(server.proc.pid)
        tally.responses += warm.responses  # the server counted the warm-up too
        tally.prompts_admitted += warm.prompts_admitted
        with open(log_path, errors="replace") as f:
            log = f.read()
        failed, engine = checks(tally, info, log, (rss_warm, rss_end), args.rss_tolerance,
                                      server.base_url)  # fmt: skip
    finally:
        server.stop()
    return {
        "duration_s": round(elapsed, 1),
        "clients": args.clients,
        "requests": sum(tally.kinds.values()),
        "kinds": dict(tally.kinds),
        "disconnects": tally.disconnects,
        "responses": {f"{r} {s}": n for (r, s), n in sorted(tally.responses.items())},
        "engine_requests": dict(engine),
        "rss_after_warmup_mib": round(rss_warm / 2**20, 1),
        "rss_at_end_mib": round(rss_end / 2**20, 1),
        "rss_change": round(rss_end / rss_warm - 1, 4),
        "rss_every_10_s_mib": tally.rss_mib,
        "log": log_path,
        "failed": failed,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=300, help="seconds of traffic")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients")
    p.add_argument(
        "--warmup", type=float, default=60, help="seconds of the same traffic before RSS"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rss-tolerance", type=float, default=0.05)
    p.add_argument("--output", help="write the summary here too (JSON)")
    p.add_argument(
        "serve_args",
        nargs="*",
        default=["--kv-cache-memory", "512MiB", "--max-num-seqs", "32"],
        help="kiln serve's options (after --)",
    )
    args = p.parse_args(argv)
    summary = run(args)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
