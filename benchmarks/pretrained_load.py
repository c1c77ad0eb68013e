"""Loading an 8B-sized Hugging Face checkpoint into a sharded model, then fine-tuning it, on one device.

Phases, each in a fresh process (so that its peaks and timings are its own), world size 1:

  create   a Llama of the given shape with random bf16 weights, built on the device (the host never
           holds it in fp32), saved with save_pretrained(max_shard_size="5GB"): ~16 GB at 8B. Skipped
           when the folder already holds a model of this shape (--fresh rewrites it).
  st       model built on the meta device, st.shard (full_shard, bf16 compute, fp32 masters, every
           decoder layer activation-checkpointed), then st.load_pretrained: time, peak host RSS.
  hf       from_pretrained(dtype=bf16) into host memory, then the same st.shard: time, peak host RSS.
           Its fp32 masters must equal the st phase's (per-parameter float64 sums, bit for bit); the
           largest logit difference on a fixed input is reported (rotary tables computed on another
           device may differ in the last bit).
  full     --steps steps of full fine-tuning (fused AdamW on CUDA), batch 1 x --seq tokens.
  lora     --steps steps of LoRA (peft, r=8 on q_proj,v_proj; only the adapters train).

Peak host RSS is the process's peak resident size during the phase above its size at the phase's
start (Linux VmHWM, reset at the start; elsewhere sampled). Tokens/s is over the steps after the
first --warmup. Prints one table at the end; exits 1 if any phase failed.

    python benchmarks/pretrained_load.py --dir /scratch/llama8b                 # one H200: 16 GB on disk
    python benchmarks/pretrained_load.py --dir /tmp/tiny-llama --device cpu --layers 2 --hidden 256 \
        --heads 4 --kv-heads 2 --intermediate 512 --vocab 1024 --seq 128 --steps 3 --warmup 1   # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

PHASES = ("create", "st", "hf", "full", "lora")
RESULT = "RESULT "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="folder of the checkpoint (created, or reused if it matches)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--seq", type=int, default=4096, help="tokens per step (batch 1)")
    parser.add_argument("--steps", type=int, default=20, help="fine-tuning steps per phase")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of tokens/s")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument(
        "--full-offload",
        type=float,
        default=0.0,
        help="full phase only: share of the parameters (whole units) whose fp32 masters, gradients "
        "and AdamW state live in host memory (0: none; 0.25 if that phase runs out of memory)",
    )
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    parser.add_argument("--fresh", action="store_true", help="rewrite the checkpoint even if one of this shape exists")
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)  # a child process runs this one
    parser.add_argument("--scratch", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = sorted(set(args.phases.split(",")) - set(PHASES))
    if unknown:
        parser.error(f"--phases: unknown {unknown}; choose from {','.join(PHASES)}")
    return args


# ------------------------------------------------------------------------------------------ measuring
class HostPeak:
    """This process's peak resident memory above its size at `__enter__`."""

    def __init__(self) -> None:
        import psutil

        self._process = psutil.Process()
        self._linux = Path("/proc/self/clear_refs").exists()
        self._stop = threading.Event()

    def __enter__(self) -> HostPeak:
        self.start = self._process.memory_info().rss
        self.peak = self.start
        if self._linux:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM restarts from the current size
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._linux:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    self.peak = max(self.peak, int(line.split()[1]) * 1024)
        self.above = self.peak - self.start


def gib(n: float) -> float:
    return round(n / 2**30, 2)


# ------------------------------------------------------------------------------------------ the model
def llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(8192, args.seq),
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        dtype="bfloat16",
    )


SHAPE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "tie_word_embeddings",
)


def matching_checkpoint(args) -> bool:
    folder = Path(args.dir)
    config = folder / "config.json"
    if not config.is_file() or not (
        (folder / "model.safetensors").is_file() or (folder / "model.safetensors.index.json").is_file()
    ):
        return False
    saved, wanted = json.loads(config.read_text()), llama_config(args).to_dict()
    return all(saved.get(k) == wanted[k] for k in SHAPE_KEYS)


def folder_bytes(folder: str) -> int:
    return sum(p.stat().st_size for p in Path(folder).glob("*.safetensors"))


def init_process_group(device):
    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.ones(1, device=device)  # the CUDA context, before any measurement starts
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")


def meta_model(args):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.dir))


def shard(model, device, init_fn=None, offload: float = 0.0):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import shardtrain as st

    return st.shard(
        model,
        strategy="full_shard",
        wrap={LlamaDecoderLayer},
        mixed_precision="bf16",
        activation_checkpointing={LlamaDecoderLayer},
        device=device,
        param_init_fn=init_fn,
        cpu_offload=offload if offload else False,
    )


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gpu_peak(device) -> float | None:
    import torch

    return gib(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def fingerprint(model, args, device) -> dict:
    """What the st and hf phases compare: each parameter's sum in float64 and the logits of a fixed input."""
    import torch

    from shardtrain.core.shard_module import runtime_of

    sums = {
        s.fqn: torch.sum(u.held(i), dtype=torch.float64).item()
        for u in runtime_of(model).units
        for i, s in enumerate(u.layout.params)
    }
    tokens = torch.randint(0, args.vocab, (1, 64), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        return {"sums": sums, "logits": model(tokens).logits.float().cpu()}


# ------------------------------------------------------------------------------------------ phases
def phase_create(args, device) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    if not args.fresh and matching_checkpoint(args):
        return {"time_s": 0.0, "note": f"reused {args.dir} ({gib(folder_bytes(args.dir))} GiB)"}
    start = time.perf_counter()
    with HostPeak() as host:
        torch.set_default_dtype(torch.bfloat16)
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(llama_config(args))  # transformers' own init, on the device, in bf16
        torch.set_default_dtype(torch.float32)
        model.save_pretrained(args.dir, max_shard_size="5GB")
    files = sorted(p.name for p in Path(args.dir).glob("*.safetensors"))
    return {
        "time_s": time.perf_counter() - start,
        "host_gib": gib(host.above),
        "gpu_gib": gpu_peak(device),
        "note": f"{len(files)} file(s), {gib(folder_bytes(args.dir))} GiB, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:,.1f}M params",
    }


def phase_st(args, device) -> dict:
    import torch

    import shardtrain as st

    with HostPeak() as host:
        start = time.perf_counter()
        model = shard(meta_model(args), device)
        sync(device)
        sharded = time.perf_counter()
        st.load_pretrained(model, args.dir)
        sync(device)
        done = time.perf_counter()
    torch.save(fingerprint(model, args, device), Path(args.scratch) / "st.pt")
    rate = folder_bytes(args.dir) / (done - sharded) / 2**30
    return {
        "time_s": done - start,
        "host_gib": gib(host.above),
        "gpu_gib": gpu_peak(device),
        "note": f"shard {sharded - start:.1f} s + load_pretrained {done - sharded:.1f} s ({rate:.2f} GiB/s)",
    }


def phase_hf(args, device) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    with HostPeak() as host:
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.bfloat16)
        loaded = time.perf_counter()
        shard(model, device)
        sync(device)
        done = time.perf_counter()
    mine = fingerprint(model, args, device)
    reference = Path(args.scratch) / "st.pt"
    if reference.is_file():
        theirs = torch.load(reference, weights_only=True)
        differ = sorted(k for k in mine["sums"] if mine["sums"][k] != theirs["sums"].get(k))
        if differ or set(theirs["sums"]) != set(mine["sums"]):
            raise RuntimeError(
                f"the fp32 masters differ from the st phase's ({len(differ)} parameters, e.g. "
                f"{differ[:2]}): st.load_pretrained and from_pretrained disagree"
            )
        diff = (mine["logits"] - theirs["logits"]).abs().max().item()
        same = f"masters equal to st's, logits max diff {diff:.2g}"
    else:
        same = "st phase not run: nothing compared"
    return {
        "time_s": done - start,
        "host_gib": gib(host.above),
        "gpu_gib": gpu_peak(device),
        "note": f"from_pretrained {loaded - start:.1f} s + shard {done - loaded:.1f} s; {same}",
    }


def fine_tune(args, device, model, params) -> dict:
    import torch
    import torch.nn.functional as F

    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda")
    generator = torch.Generator().manual_seed(1)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for _ in range(args.steps):
        tokens = torch.randint(0, args.vocab, (1, args.seq + 1), generator=generator).to(device)
        sync(device)
        start = time.perf_counter()
        logits = model(tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        del logits
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    if not all(math.isfinite(x) for x in losses):
        raise RuntimeError(f"non-finite loss: {losses}")
    timed = times[args.warmup :] or times
    return {
        "time_s": sum(times),
        "tokens_s": args.seq * len(timed) / sum(timed),
        "gpu_gib": gpu_peak(device),
        "note": f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, {sum(p.numel() for p in params) / 1e6:,.2f}M "
        "trainable parameters",
    }


def phase_full(args, device) -> dict:
    import shardtrain as st

    with HostPeak() as host:
        model = shard(meta_model(args), device, offload=args.full_offload)
        st.load_pretrained(model, args.dir)
    out = fine_tune(args, device, model, list(model.parameters()))
    if args.full_offload and device.type == "cuda":  # st.shard keeps everything in place on a CPU device
        out["note"] += f"; {args.full_offload:g} of the parameters offloaded"
    return {**out, "host_gib": gib(host.above)}


def phase_lora(args, device) -> dict:
    import shardtrain as st
    from shardtrain.pretrained.lora import adapter_init, apply_lora

    with HostPeak() as host:
        model = apply_lora(
            meta_model(args), rank=args.lora_rank, alpha=2.0 * args.lora_rank, targets=("q_proj", "v_proj"), dropout=0.0
        )
        shard(model, device, init_fn=adapter_init(model))
        st.load_pretrained(model, args.dir)
    out = fine_tune(args, device, model, [p for p in model.parameters() if p.requires_grad])
    return {**out, "host_gib": gib(host.above)}


def run_phase(args) -> int:
    """In a child process: run one phase and print its result line."""
    import torch

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    try:
        import transformers.models.llama.modeling_llama  # noqa: F401 - imported before any clock starts

        init_process_group(device)
        result = {"phase": args.phase, "ok": True, **globals()[f"phase_{args.phase}"](args, device)}
    except Exception as exc:
        traceback.print_exc()
        oom = isinstance(exc, torch.OutOfMemoryError)
        result = {
            "phase": args.phase,
            "ok": False,
            "note": ("out of device memory: " if oom else f"{type(exc).__name__}: ") + str(exc).splitlines()[0],
        }
    print(RESULT + json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


# ------------------------------------------------------------------------------------------ driver
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.phase is not None:
        return run_phase(args)
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    forwarded = _without_phases(list(argv if argv is not None else sys.argv[1:]))
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for phase in args.phases.split(","):
            if phase != "create" and not matching_checkpoint(args):
                results.append(
                    {
                        "phase": phase,
                        "ok": False,
                        "note": f"no checkpoint of this shape in {args.dir}; run the create phase",
                    }
                )
                continue
            print(f"--- {phase}", flush=True)
            env = {
                **os.environ,
                "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                "PYTHONPATH": os.pathsep.join(
                    [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH", "")]
                ),
            }
            child = subprocess.run(
                [sys.executable, __file__, *forwarded, "--phase", phase, "--scratch", scratch],
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            lines = child.stdout.splitlines()
            sys.stdout.write("".join(f"{text}\n" for text in lines if not text.startswith(RESULT)))
            line = next((text for text in lines if text.startswith(RESULT)), None)
            results.append(
                json.loads(line[len(RESULT) :])
                if line
                else {"phase": phase, "ok": False, "note": f"the process died (exit code {child.returncode})"}
            )
    print(table(args, results))
    return 0 if all(r["ok"] for r in results) else 1


def _without_phases(argv: list[str]) -> list[str]:
    """`argv` without `--phases X` / `--phases=X` (each child gets its --phase instead)."""
    out, skip = [], False
    for a in argv:
        if not skip and not a.startswith("--phases="):
            if a == "--phases":
                skip = True
                continue
            out.append(a)
        else:
            skip = False
    return out


def table(args, results: list[dict]) -> str:
    title = (
        f"Llama {args.layers} layers x {args.hidden} (vocab {args.vocab}), {args.device}, world 1, full_shard, "
        f"bf16 compute / fp32 masters, batch 1 x {args.seq}, {args.steps} steps"
    )
    rows = [("phase", "ok", "time s", "tokens/s", "peak GPU GiB", "peak host GiB", "notes")]
    for r in results:
        rows.append(
            (
                r["phase"],
                "yes" if r["ok"] else "FAILED",
                _fmt(r.get("time_s"), ".1f"),
                _fmt(r.get("tokens_s"), ",.0f"),
                _fmt(r.get("gpu_gib"), ".2f"),
                _fmt(r.get("host_gib"), ".2f"),
                r.get("note", ""),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = [title] + ["  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1] for row in rows]
    return "\n".join(lines)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


if __name__ == "__main__":
    sys.exit(main())
