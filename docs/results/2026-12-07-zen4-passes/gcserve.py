"""`kiln serve` with a log of Python's garbage collector: every full collection (its time and
what it freed), and every 15 s the tracked objects, the resident memory and each generation's
collections so far. `python gcserve.py serve --profile smollm2-hf-bf16 --port 8011`, log in
$GCLOG (default gc.log)."""

import gc
import os
import sys
import threading
import time

from kiln.cli import main

LOG = open(os.environ.get("GCLOG", "gc.log"), "w", buffering=1)  # noqa: SIM115
STATE = {"start": 0.0, "ms": [0.0, 0.0, 0.0], "count": [0, 0, 0]}


def on_collection(phase: str, info: dict) -> None:
    if phase == "start":
        STATE["start"] = time.perf_counter()
        return
    generation, took = info["generation"], time.perf_counter() - STATE["start"]
    STATE["ms"][generation] += took * 1e3
    STATE["count"][generation] += 1
    if generation == 2:
        LOG.write(f"{time.time():.1f} gen2 {took * 1e3:.1f} ms collected {info['collected']}\n")


def report() -> None:
    while True:
        time.sleep(15)
        with open("/proc/self/statm") as statm:
            rss_mib = int(statm.read().split()[1]) * 4096 / 2**20
        ms = [round(x) for x in STATE["ms"]]
        LOG.write(
            f"{time.time():.1f} objs {len(gc.get_objects())} rss {rss_mib:.0f}MiB "
            f"n {STATE['count']} tot_ms {ms}\n"
        )


gc.callbacks.append(on_collection)
threading.Thread(target=report, daemon=True).start()
sys.argv = ["kiln", *sys.argv[1:]]
main()
