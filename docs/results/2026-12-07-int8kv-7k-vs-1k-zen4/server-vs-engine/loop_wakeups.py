import sys, time, statistics, tomllib, threading, json, asyncio
from kiln import LLM, SamplingParams
sys.path.insert(0, "benchmarks")  # run from the repository root
from engine_rounds import _prompts
prof = tomllib.load(open(sys.argv[1], "rb"))["serve"]; prof.pop("max_waiting_requests", None)
work_ms = float(sys.argv[2])
llm = LLM(None, **prof)
loop = asyncio.new_event_loop()
def busy():
    end = time.perf_counter() + work_ms / 1e3
    while time.perf_counter() < end: pass
threading.Thread(target=loop.run_forever, daemon=True).start()
def run(tag, helper):
    ids = _prompts(llm, 1, 1024, hash(tag) % 50)[0]
    llm.engine.add_request(tag, ids, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, min_tokens=128))
    steps = []
    while llm.engine.has_unfinished_requests():
        s = time.perf_counter(); llm.engine.step(); steps.append(time.perf_counter() - s)
        if helper: loop.call_soon_threadsafe(busy)
    return 1e3 * statistics.median(steps[-127:])
for r in range(4):
    a = run(f"a{r}", False); b = run(f"b{r}", True)
    print(f"round {r}: no helper {a:.2f} ms, helper ({work_ms} ms busy per step) {b:.2f} ms", flush=True)
