"""Two builds of shardtrain (two source trees) timed by `shardtrain bench` in one call, runs interleaved.

    python benchmarks/compare_builds.py --old OLD/src --new src --out OUT \
        --config "1.5b:--sizes 1.5b --batch 2 --seq 4096 --ac none" \
        --config "8b:--sizes 8b --batch 1 --seq 4096 --ac all" --repeats 2

For every repeat, for every config, each build runs `python -m shardtrain bench <config> --engines
shardtrain --repeats 1` in fresh processes with its tree first on PYTHONPATH, old and new
alternating, so that drifts of the machine hit both builds alike. Extra engines of a config (e.g.
`--engines shardtrain,fsdp2`) run under the new build only. Writes OUT/compare.json (every run) and
prints one line per config, build and engine: tokens/s per GPU (median over runs of each run's
median), peak allocated memory, the first run's last loss, and new / old.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_bench(src: str, args: list[str], json_path: Path) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(src), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "shardtrain", "bench", *args, "--repeats", "1", "--json", str(json_path)]
    print("+", shlex.join(command), f"(PYTHONPATH={src})", flush=True)
    subprocess.run(command, env=env, check=False)
    if not json_path.exists():
        return []
    return json.loads(json_path.read_text()).get("rows", [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the old build's source tree (the folder holding shardtrain/)")
    parser.add_argument("--new", required=True, help="the new build's source tree")
    parser.add_argument("--config", action="append", required=True, help="NAME:BENCH ARGUMENTS")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = [(c.partition(":")[0], shlex.split(c.partition(":")[2])) for c in args.config]
    results: list[dict] = []
    scratch = Path(tempfile.mkdtemp())
    for repeat in range(args.repeats):
        for name, bench_args in configs:
            for build, src in (("old", args.old), ("new", args.new)):
                engines = bench_args if build == "new" else _only_shardtrain(bench_args)
                rows = run_bench(src, engines, scratch / f"{name}_{build}_{repeat}.json")
                for row in rows:
                    results.append({"config": name, "build": build, "repeat": repeat, **row})
                (out / "compare.json").write_text(json.dumps(results, indent=1))
    print(
        f"\n{'config':<8} {'build':<5} {'engine':<28} {'tokens/s/GPU':>14} {'GiB':>7} {'loss':>9} {'runs':>5}  new/old"
    )
    for name, _ in configs:
        medians = {}
        for build in ("old", "new"):
            by_engine: dict[str, list[dict]] = {}
            for r in results:
                if r["config"] == name and r["build"] == build and r.get("status") == "ok":
                    by_engine.setdefault(r["label"], []).append(r)
            for label, rows in by_engine.items():
                tokens = statistics.median(r["tokens_per_s_gpu"]["median"] for r in rows)
                memory = max(r["allocated_gib"] or 0 for r in rows)
                medians[(build, label)] = tokens
                ratio = ""
                if build == "new" and ("old", label) in medians:
                    ratio = f"{tokens / medians[('old', label)]:.3f}"
                loss = rows[0].get("loss") or float("nan")
                print(
                    f"{name:<8} {build:<5} {label:<28} {tokens:>14,.0f} {memory:>7.2f} {loss:>9.4f} {len(rows):>5}  {ratio}"
                )
    return 0


def _only_shardtrain(bench_args: list[str]) -> list[str]:
    """The config's arguments with `--engines` restricted to shardtrain's own engines."""
    out = list(bench_args)
    if "--engines" in out:
        i = out.index("--engines")
        kept = [e for e in out[i + 1].split(",") if e.startswith("shardtrain")]
        out[i + 1] = ",".join(kept or ["shardtrain"])
    else:
        out += ["--engines", "shardtrain"]
    return out


if __name__ == "__main__":
    sys.exit(main())
