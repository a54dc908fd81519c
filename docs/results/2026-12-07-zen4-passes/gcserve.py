import gc, sys, time, threading, os
log = open(os.environ.get("GCLOG", "/tmp/gcx/gc.log"), "w", buffering=1)
state = {"t": 0.0, "tot": [0.0, 0.0, 0.0], "n": [0, 0, 0]}
def cb(phase, info):
    if phase == "start":
        state["t"] = time.perf_counter()
    else:
        g = info["generation"]; d = time.perf_counter() - state["t"]
        state["tot"][g] += d; state["n"][g] += 1
        if g == 2:
            log.write(f"{time.time():.1f} gen2 {d*1e3:.1f} ms collected {info['collected']}\n")
gc.callbacks.append(cb)
def report():
    while True:
        time.sleep(15)
        rss = int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
        log.write(f"{time.time():.1f} objs {len(gc.get_objects())} rss {rss:.0f}MiB n {state['n']} tot_ms {[round(x*1e3) for x in state['tot']]}\n")
threading.Thread(target=report, daemon=True).start()
from kiln.cli import main
sys.argv = ["kiln"] + sys.argv[1:]
main()
