"""Compute-stream kernel time per step by kernel: a real 2-GPU trace (`bench --profile --trace-dir`, 2 steps)
against a no-communication trace of the same engine (`no_comm_step.py --fake --trace`, 1 step).
usage: python compute_kernels_real_vs_no_comm.py TRACE_DIR  (trace_1.5b_<engine>.json.gz, fake_<engine>.json.gz)"""
import gzip, json, sys
from collections import defaultdict
sys.path.insert(0, "src")
from shardtrain.bench.profile import short_kernel_name
def load(path, steps):
    ev = json.load(gzip.open(path))["traceEvents"]
    dev = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("dur", 0) > 0]
    by = defaultdict(float)
    for e in dev:
        if "nccl" not in e["name"].lower():
            by[e["args"].get("stream")] += e["dur"]
    cs = max(by, key=by.get)
    t = defaultdict(float); n = defaultdict(int); side = defaultdict(float)
    for e in dev:
        k = short_kernel_name(e["name"])[:55]
        if e["args"].get("stream") == cs:
            t[k] += e["dur"] / 1000 / steps; n[k] += 1
        else:
            side[k] += e["dur"] / 1000 / steps
    return t, n, side, {s: v/1000/steps for s, v in by.items()}
for eng in ("shardtrain", "fsdp2"):
    r, rn, rs, rby = load(f"{sys.argv[1]}/trace_1.5b_{eng}.json.gz", 2)
    f, fn, fs, fby = load(f"{sys.argv[1]}/fake_{eng}.json.gz", 1)
    print(f"== {eng}: compute stream real {sum(r.values()):.1f} ms/step vs fake {sum(f.values()):.1f}; streams real {dict((k, round(v,1)) for k,v in rby.items())} fake {dict((k, round(v,1)) for k,v in fby.items())}")
    keys = sorted(set(r) | set(f), key=lambda k: -abs(r.get(k,0)-f.get(k,0)))
    for k in keys[:14]:
        print(f"  {k:55s} real {r.get(k,0):7.2f} ({rn.get(k,0)//2:4d})  fake {f.get(k,0):7.2f} ({fn.get(k,0):4d})  diff {r.get(k,0)-f.get(k,0):+6.2f}")
    print("  side (real):", {k: round(v,2) for k, v in sorted(rs.items(), key=lambda x: -x[1])[:8]})
    print("  side (fake):", {k: round(v,2) for k, v in sorted(fs.items(), key=lambda x: -x[1])[:8]})
