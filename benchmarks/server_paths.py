"""One stream's decode through the layouts a server can give the engine, to find where the
server's extra time per token goes: greedy tokens after a short prompt, the engine built from
`kiln serve`'s own arguments (a profile), wall seconds per request.

    python benchmarks/server_paths.py PROFILE direct    # stepped on the main thread
    python benchmarks/server_paths.py PROFILE thread    # booted and stepped on another thread
    python benchmarks/server_paths.py PROFILE async     # AsyncEngine, consumed by asyncio here
    python benchmarks/server_paths.py PROFILE inverse   # stepped here, outputs to a loop thread
    python benchmarks/server_paths.py PROFILE wakeups --work-ms 0.5
        # stepped here, requests alternating without and with a loop thread woken after every
        # step to run WORK_MS of Python

Each layout is its own process; run them alternately, since a shared machine drifts."""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

from kiln import SamplingParams
from kiln.boot.builder import build_engine
from kiln.cli.engine_args import engine_kwargs
from kiln.cli.parsers import build_parser
from kiln.cli.serve import resolve_serve_args
from kiln.config.options import engine_config
from kiln.engine.llm_engine import LLMEngine
from kiln.server.async_engine import AsyncEngine


def _params(tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)


def _run(engine: LLMEngine, tag: str, tokens: int, after_step=None) -> float:
    ids = engine.tokenizer.encode(f"Tell me a story {tag}")
    start = time.perf_counter()
    engine.add_request(tag, ids, _params(tokens))
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if after_step is not None:
            after_step(outputs)
    return time.perf_counter() - start


def _loop_thread() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return loop


def direct(build, args) -> None:
    engine = build()
    for r in range(args.requests):
        print(f"{args.layout} {_run(engine, str(r), args.tokens):.2f} s", flush=True)


def on_thread(build, args) -> None:
    worker = threading.Thread(target=direct, args=(build, args), name="kiln-engine")
    worker.start()
    worker.join()


def through_async_engine(build, args) -> None:
    engine = AsyncEngine(build)

    async def requests() -> None:
        for r in range(args.requests):
            ids = engine.engine.tokenizer.encode(f"Tell me a story {r}")
            start = time.perf_counter()
            async for _ in engine.generate(str(r), None, ids, _params(args.tokens)):
                pass
            print(f"async {time.perf_counter() - start:.2f} s", flush=True)

    asyncio.run(requests())
    engine.stop()


def inverse(build, args) -> None:
    engine, loop = build(), _loop_thread()

    def deliver(outputs) -> None:
        for out in outputs:
            loop.call_soon_threadsafe(_take, out)

    for r in range(args.requests):
        print(f"inverse {_run(engine, str(r), args.tokens, deliver):.2f} s", flush=True)


def wakeups(build, args) -> None:
    engine, loop = build(), _loop_thread()

    def busy() -> None:
        end = time.perf_counter() + args.work_ms / 1e3
        while time.perf_counter() < end:
            pass

    for r in range(args.requests):
        quiet = _run(engine, f"a{r}", args.tokens)
        woken = _run(engine, f"b{r}", args.tokens, lambda _: loop.call_soon_threadsafe(busy))
        print(f"no loop {quiet:.2f} s, loop woken per step ({args.work_ms} ms) {woken:.2f} s")


def _take(out) -> None:
    """Where `inverse` delivers: the loop thread wakes and takes the output, as a stream's
    queue would."""


LAYOUTS = {
    "direct": direct,
    "thread": on_thread,
    "async": through_async_engine,
    "inverse": inverse,
    "wakeups": wakeups,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", help="a kiln serve profile (.toml or shipped name)")
    ap.add_argument("layout", choices=sorted(LAYOUTS))
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--work-ms", type=float, default=0.0, help="(wakeups) Python per wake-up")
    args = ap.parse_args()
    serve = resolve_serve_args(build_parser().parse_args(["serve", "--profile", args.profile]))
    config = engine_config(serve.model, **engine_kwargs(serve))
    LAYOUTS[args.layout](lambda: build_engine(config), args)


if __name__ == "__main__":
    main()
