import sys, time, statistics, tomllib
from kiln import LLM, SamplingParams
prof = tomllib.load(open(sys.argv[1], "rb"))["serve"]; prof.pop("max_waiting_requests", None)
llm = LLM(None, **prof)
for r in range(3):
    ids = llm.tokenizer.encode(f"Tell me a story {r}")
    t = time.perf_counter()
    llm.engine.add_request(f"q{r}", ids, SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
    n = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step(); n += 1
    print(f"wall {time.perf_counter() - t:.2f} s, {n} steps", flush=True)
