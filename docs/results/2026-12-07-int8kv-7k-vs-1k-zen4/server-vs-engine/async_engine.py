import sys, time, asyncio
from kiln.cli.parsers import build_parser
from kiln.cli.serve import resolve_serve_args
from kiln.cli.engine_args import engine_kwargs
from kiln.config.options import engine_config
from kiln.boot.builder import build_engine
from kiln.server.async_engine import AsyncEngine
from kiln import SamplingParams
args = resolve_serve_args(build_parser().parse_args(["serve", "--profile", sys.argv[1]]))
cfg = engine_config(args.model, **engine_kwargs(args))
ae = AsyncEngine(lambda: build_engine(cfg), 256)
tok = ae.engine.tokenizer
async def main():
    for r in range(3):
        ids = tok.encode(f"Tell me a story {r}")
        t = time.perf_counter()
        async for out in ae.generate(f"q{r}", None, ids, SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)):
            pass
        print(f"async engine wall {time.perf_counter() - t:.2f}", flush=True)
asyncio.run(main())
ae.stop()
