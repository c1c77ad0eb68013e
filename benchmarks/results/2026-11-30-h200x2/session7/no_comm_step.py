"""One GPU, a fake world of 2: collectives are no-ops, so a step shows the engine's own overhead
(casts, copies, averages, hooks, host) and its memory bill without communication.
usage: PYTHONPATH=src python3 no_comm_step.py ENGINE SIZE BATCH AC(0/1) [--snapshot FILE] [--trace FILE]"""
import argparse, json, os, sys, types, time
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

p = argparse.ArgumentParser()
p.add_argument("engine"); p.add_argument("size"); p.add_argument("batch", type=int); p.add_argument("ac", type=int)
p.add_argument("--steps", type=int, default=8); p.add_argument("--warmup", type=int, default=3)
p.add_argument("--snapshot", default=""); p.add_argument("--trace", default=""); p.add_argument("--world", type=int, default=2)
p.add_argument("--fake", action="store_true", help="no-op collectives (default: loopback copies)")
a = p.parse_args()
LOOPBACK = not a.fake and 'LOCAL_RANK' not in os.environ

REAL = "LOCAL_RANK" in os.environ
CUDA = torch.cuda.is_available()
LR = int(os.environ.get("LOCAL_RANK", 0))
if CUDA: torch.cuda.set_device(LR)
dev = torch.device("cuda", LR) if CUDA else torch.device("cpu")
if REAL:
    dist.init_process_group("nccl" if CUDA else "gloo")
else:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=a.world)

import shardtrain.core.comm as comm, shardtrain.core.lookup as lookup, shardtrain.core.shard as shard
real = dist.get_backend
proxy = types.ModuleType("distproxy"); proxy.__dict__.update(dist.__dict__)
proxy.get_backend = lambda g=None: "nccl" if real(g) == "fake" else real(g)
if not REAL:
    comm.dist = proxy; lookup.dist = proxy
    shard.control_group = lambda pg: pg or dist.group.WORLD

p.add_argument  # loopback collectives: real values, local copies, no link
class _Done:
    def wait(self, *a, **k): return True
    def is_completed(self): return True
W = a.world
def _ag(out=None, inp=None, group=None, async_op=False, output=None, input=None, output_tensor=None, input_tensor=None):
    out = out if out is not None else (output if output is not None else output_tensor)
    inp = inp if inp is not None else (input if input is not None else input_tensor)
    out.view(W, -1).copy_(inp.reshape(1, -1).expand(W, -1)); return _Done() if async_op else None
def _rs(out=None, inp=None, op=None, group=None, async_op=False, output=None, input=None):
    out = out if out is not None else output
    inp = inp if inp is not None else input
    out.copy_(inp.reshape(W, -1)[0].view_as(out)); return _Done() if async_op else None
def _a2a(out, inp, *args, group=None, async_op=False, **k):
    out.copy_(inp); return _Done() if async_op else None
if LOOPBACK:
    for name, fn in (("all_gather_single", _ag), ("all_gather_into_tensor", _ag), ("reduce_scatter_single", _rs),
                     ("reduce_scatter_tensor", _rs), ("all_to_all_single", _a2a)):
        setattr(dist, name, fn); setattr(proxy, name, fn)
    comm._all_gather = _ag; comm._reduce_scatter = _rs; lookup._all_gather = _ag; lookup._reduce_scatter = _rs
from shardtrain.bench.spec import RunSpec
from shardtrain.bench.registry import resolve_engine
from shardtrain.bench.data import token_batches
from shardtrain.bench.worker import train_step
spec = RunSpec(engine=a.engine, size=a.size, batch=a.batch, seq=4096, ac=bool(a.ac), steps=a.steps, warmup=a.warmup,
               device=dev.type, precision="bf16", shard_world=a.world)
prep = resolve_engine(a.engine).build(spec, dev)
CUDA and torch.cuda.empty_cache()
batches = token_batches(vocab_size=spec.model_config().vocab_size, batch=spec.batch, seq=spec.seq, steps=a.warmup + a.steps + 2,
                        rank=dist.get_rank(), seed=0, device=dev)
for b in batches[:a.warmup]:
    train_step(prep, b)
if not CUDA:
    ms = []
    for b in batches[a.warmup:a.warmup + a.steps]:
        t = time.perf_counter(); train_step(prep, b); ms.append((time.perf_counter() - t) * 1e3)
    print("CPU", sorted(ms), train_step(prep, batches[-1])); sys.exit(0)
torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
ev = []
for b in batches[a.warmup:a.warmup + a.steps]:
    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    s.record(); train_step(prep, b); e.record(); ev.append((s, e))
torch.cuda.synchronize()
ms = sorted(s.elapsed_time(e) for s, e in ev)
if dist.get_rank() == 0: print(f"RESULT {a.engine} {a.size} b{a.batch} ac{a.ac}: median {ms[len(ms)//2]:.1f} ms  min {ms[0]:.1f} max {ms[-1]:.1f}  "
      f"peak alloc {torch.cuda.max_memory_allocated()/2**30:.3f} GiB  reserved {torch.cuda.max_memory_reserved()/2**30:.3f}")
extra = batches[a.warmup + a.steps:]
if a.snapshot:
    print(f'allocated before the snapshot step {torch.cuda.memory_allocated()/2**30:.3f} GiB')
    torch.cuda.memory._record_memory_history(max_entries=200000)
    torch.cuda.reset_peak_memory_stats()
    train_step(prep, extra[0]); torch.cuda.synchronize()
    torch.cuda.memory._dump_snapshot(a.snapshot)
    torch.cuda.memory._record_memory_history(enabled=None)
    print(f'peak in the snapshot step {torch.cuda.max_memory_allocated()/2**30:.3f} GiB')
if a.trace:
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=bool(os.environ.get('STACK'))) as prof:
        train_step(prep, extra[1]); torch.cuda.synchronize()
    if dist.get_rank() == 0:
        prof.export_chrome_trace(a.trace)
        os.system(f"gzip -f {a.trace}")
if REAL:
    dist.barrier(); dist.destroy_process_group()
