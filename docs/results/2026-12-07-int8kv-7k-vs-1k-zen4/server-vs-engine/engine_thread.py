import sys, time, threading
from kiln.cli.parsers import build_parser
from kiln.cli.serve import resolve_serve_args
from kiln.cli.engine_args import engine_kwargs
from kiln.config.options import engine_config
from kiln.boot.builder import build_engine
from kiln import SamplingParams
args = resolve_serve_args(build_parser().parse_args(["serve", "--profile", sys.argv[1]]))
cfg = engine_config(args.model, **engine_kwargs(args))
def body():
    eng = build_engine(cfg)
    for r in range(3):
        ids = eng.tokenizer.encode(f"Tell me a story {r}")
        t = time.perf_counter()
        eng.add_request(f"q{r}", ids, SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
        while eng.has_unfinished_requests(): eng.step()
        print(f"{sys.argv[2]} wall {time.perf_counter() - t:.2f}", flush=True)
if sys.argv[2] == "thread":
    t = threading.Thread(target=body); t.start(); t.join()
else:
    body()
