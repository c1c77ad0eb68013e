"""Compute-stream kernel time per step, split into forward, loss + backward and optimizer, from profiler traces.
usage: python phases.py NAME=TRACE.json.gz ...  (traces of `bench --profile --trace-dir` or `no_comm_step.py --trace`)"""
import gzip, json, sys
from collections import defaultdict
def load(path):
    ev = json.load(gzip.open(path))["traceEvents"]
    dev = [e for e in ev if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and e.get("dur", 0) > 0]
    by = defaultdict(float)
    for e in dev:
        if "nccl" not in e["name"].lower(): by[e["args"].get("stream")] += e["dur"]
    cs = max(by, key=by.get)
    comp = sorted([e for e in dev if e["args"].get("stream") == cs], key=lambda e: e["ts"])
    nccl = sorted([e for e in dev if "nccl" in e["name"].lower()], key=lambda e: e["ts"])
    # step boundaries: the optimizer's multi_tensor_apply kernels; loss: SoftMax kernels
    loss = [e for e in comp if "SoftMax" in e["name"] or "softmax" in e["name"].lower()]
    opt = [e for e in comp if "multi_tensor" in e["name"]]
    return comp, nccl, loss, opt
for name, path in (arg.split("=", 1) for arg in sys.argv[1:]):
    comp, nccl, loss, opt = load(path)
    # split by steps using the optimizer kernel clusters
    t0 = comp[0]["ts"]
    # phases: forward = from step start (first kernel after previous opt) to first softmax; backward = first softmax to first opt kernel
    steps = []
    opt_starts = []
    prev = None
    for e in opt:
        if prev is None or e["ts"] - prev > 20000: opt_starts.append(e["ts"])
        prev = e["ts"] + e["dur"]
    print(name, "optimizer clusters at", [round((t - t0)/1000, 1) for t in opt_starts], "loss kernels", len(loss))
    bounds = [comp[0]["ts"]] + opt_starts
    for i in range(len(opt_starts)):
        s, o = bounds[i] if i == 0 else [e for e in comp if e["ts"] > opt_starts[i-1] and "multi_tensor" not in e["name"]][0]["ts"], opt_starts[i]
        l = [e for e in loss if s <= e["ts"] < o]
        lf = l[0]["ts"] if l else o
        fw = sum(e["dur"] for e in comp if s <= e["ts"] < lf) / 1000
        bw = sum(e["dur"] for e in comp if lf <= e["ts"] < o and "multi_tensor" not in e["name"]) / 1000
        op = sum(e["dur"] for e in comp if o <= e["ts"] < o + 30000 and "multi_tensor" in e["name"]) / 1000
        nf = sum(e["dur"] for e in nccl if s <= e["ts"] < lf) / 1000
        nb = sum(e["dur"] for e in nccl if lf <= e["ts"] < o) / 1000
        print(f"  step {i}: forward kernels {fw:.1f} ms (wall {(lf-s)/1000:.1f}, nccl {nf:.1f}), loss+backward kernels {bw:.1f} (wall {(o-lf)/1000:.1f}, nccl {nb:.1f}), optimizer {op:.1f}")
