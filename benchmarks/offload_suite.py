"""Issue 28's one-GPU offload comparison in one invocation: one `offload_step.py` process per row.

    python benchmarks/offload_suite.py            # one H200, world size 1, about 6 minutes

Rows (bf16 compute, fp32 masters, fused AdamW, seq 4096): 1.5B batch 2 resident; full offload with
the host step in sequence, overlapped with the next forward, and in backward (each unit steps once
its gradients landed, `st.CPUOffload(step_in_backward=True)`), also under shard_grad_op (the bf16
parameters kept from forward to backward: no second host-to-device copy, planning/cost/offload_time.py
says why it matters), and in backward with every core for the step (the default leaves the main thread
one); torch FSDP2 with CPUOffloadPolicy; 14.5B (`14b`) batch 2, every block checkpointed, half
offloaded, in backward (also with the offloaded units kept gathered from forward to backward,
`st.CPUOffload(reshard_after_forward=False)`), overlapped and in sequence. Prints each row's JSON line, a table with the
breakdown (offload_step.py's docstring) and the ratios issue 28 asks for, each beside the estimate of
planning/cost/offload_time.py. A row that fails or runs out of time is reported and the next one runs.

    python benchmarks/offload_suite.py --only "resident" "offload sequential" "offload in backward" \
        "offload in backward shard_grad_op" "offload in backward 16 threads" "fsdp2 CPUOffloadPolicy"
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

STEP = Path(__file__).with_name("offload_step.py")
TODAY_14B_TOK_S = 2065  # issue 28: 14.5B half offloaded, the host step in sequence
ROWS = {
    "resident": "--size 1.5b --batch 2 --split",
    "offload sequential": "--size 1.5b --batch 2 --split --offload --host-step sequential",
    "offload overlapped": "--size 1.5b --batch 2 --split --offload",
    "offload overlapped shard_grad_op": "--size 1.5b --batch 2 --split --offload --strategy shard_grad_op",
    "offload in backward": "--size 1.5b --batch 2 --split --offload --host-step backward",
    "offload in backward shard_grad_op": "--size 1.5b --batch 2 --split --offload --host-step backward "
    "--strategy shard_grad_op",
    "offload in backward 16 threads": "--size 1.5b --batch 2 --split --offload --host-step backward --host-threads 16",
    "fsdp2 CPUOffloadPolicy": "--size 1.5b --batch 2 --offload --engine fsdp2",
    "14b half in backward": "--size 14b --batch 2 --ac --split --offload 0.5 --host-step backward",
    "14b half in backward kept": "--size 14b --batch 2 --ac --split --offload 0.5 --host-step backward "
    "--keep-offloaded",
    "14b half overlapped": "--size 14b --batch 2 --ac --split --offload 0.5",
    "14b half sequential": "--size 14b --batch 2 --ac --split --offload 0.5 --host-step sequential",
}
COLUMNS = [
    "tok_s_gpu",
    "step_ms",
    "fwd_ms",
    "bwd_ms",
    "step_call_ms",
    "host_step_ms",
    "in_backward_ms",
    "waits_ms",
    "copy_ms",
    "peak_alloc_gib",
    "host_rss_gib_rank0",
]


def run_row(name: str, argv: list[str], *, budget_s: float, port: int) -> dict | None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=1",
        f"--master_port={port}",
        str(STEP),
        *argv,
    ]
    print(f"== {name}: {' '.join(argv)}", flush=True)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=budget_s)
    except subprocess.TimeoutExpired:
        print(f"   {name}: out of time after {budget_s:.0f} s", flush=True)
        return None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        print(f"   {name}: failed (exit {done.returncode}):\n{done.stderr[-3000:]}", flush=True)
        return None
    print(lines[-1], flush=True)
    return json.loads(lines[-1])


MODES = ("offload overlapped", "offload overlapped shard_grad_op", "offload in backward",
         "offload in backward shard_grad_op", "offload in backward 16 threads")  # fmt: skip


def ratios(rows: dict[str, dict]) -> list[str]:
    """Issue 28's ratios for every 1.5B mode that ran, and the estimate of each step time."""
    out = []
    fsdp, seq, resident = rows.get("fsdp2 CPUOffloadPolicy"), rows.get("offload sequential"), rows.get("resident")
    for name in [n for n in MODES if rows.get(n)]:
        row = rows[name]
        if fsdp:
            out.append(
                f"1.5B {name} / FSDP2 CPUOffloadPolicy tok/s: {row['tok_s_gpu'] / fsdp['tok_s_gpu']:.2f} (need >= 1.8)"
            )
        if seq:
            out.append(f"1.5B {name} / sequential tok/s: {row['tok_s_gpu'] / seq['tok_s_gpu']:.2f}")
        if seq and resident:
            parts = {
                "resident step": resident["step_ms"],
                "host AdamW alone": seq["host_step_ms"],
                "copies": row["copy_ms"],
            }
            what = ", ".join(f"{k} {v:.0f} ms" for k, v in parts.items())
            out.append(f"1.5B {name} step / max({what}): {row['step_ms'] / max(parts.values()):.2f} (need <= 1.25)")
        if resident:
            out.append(f"1.5B {name}: {row['step_ms']:.0f} ms, estimated {estimate(name, resident, row):.0f} ms")
    for name in ("14b half in backward", "14b half in backward kept", "14b half overlapped", "14b half sequential"):
        if rows.get(name):
            out.append(
                f"{name} / today's {TODAY_14B_TOK_S} tok/s: {rows[name]['tok_s_gpu'] / TODAY_14B_TOK_S:.2f} (need >= 1.5)"
            )
    return out


def estimate(name: str, resident: dict, row: dict) -> float:
    """planning/cost/offload_time.py's step time (ms) for a 1.5B row, from the resident row's step, the
    offloaded parameters and the units measured here (its host AdamW rate: issue 28's figure)."""
    from shardtrain.planning.cost.offload_time import offload_step_time

    t = offload_step_time(
        resident_step_s=resident["step_ms"] / 1000,
        offloaded_params=row["offloaded_params"],
        checkpointed=False,
        reshard_after_forward="shard_grad_op" not in name,
        pcie_bytes_per_s=row["h2d_gbs"] * 1e9,
        units=row["offloaded_units"],
    )
    return 1000 * (t.in_backward_s if "in backward" in name else t.overlapped_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=float, default=570, help="seconds for the whole suite")
    parser.add_argument("--only", nargs="*", choices=list(ROWS), help="run these rows only")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget
    rows: dict[str, dict] = {}
    for i, (name, argv) in enumerate(ROWS.items()):
        left = deadline - time.monotonic()
        if args.only and name not in args.only:
            continue
        if left < 30:
            print(f"== {name}: skipped, {left:.0f} s left", flush=True)
            continue
        result = run_row(name, argv.split(), budget_s=left, port=29600 + i)
        if result is not None:
            rows[name] = result
    print("\n| row | " + " | ".join(COLUMNS) + " |")
    print("|---|" + "---:|" * len(COLUMNS))
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[c]:,.1f}" for c in COLUMNS) + " |")
    print()
    for line in ratios(rows):
        print(line)


if __name__ == "__main__":
    main()
