"""The packages form layers that import one way: each imports only from its own layer or those below.

    descriptions   policy, strategy, compat, options,    what users choose, read into one ShardOptions, the
                   float8_rule, models, tp               Linears float8 converts; the built-in model; tensor
                                                         parallelism whole: plans, the
                                                         mesh's roles, the split model core shards, what
                                                         Engine(tp=N) checks and builds
    engine         core, offload                         st.shard's machinery: units, runtime, comm; CPU offload
                                                         (the host step, the disk tier) on top of core
    entry          sharding                              the public st.shard: options read once, then core
    planning       planning                              the dry run (st.plan) and the cost model: estimates, st.shard_auto
    operations     ops, checkpoint, pretrained, data     around the step: norms, state dicts, checkpoints, HF weights,
                                                         fine-tuning data (tokenizers, masks, packing)
    testing        testing                               the test pools
    application    engine, train                         the Engine and `shardtrain train`
    tools          bench, cli                            `shardtrain bench` and the commands
    integrations   integrations                          adapters for Lightning and the Hugging Face Trainer

Nothing below the tools imports `bench`: the benchmark is a tool, not part of the call chain. Nothing
imports `integrations`: the engine does not know that the frameworks exist.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "shardtrain"
LAYERS = [
    {"policy", "strategy", "compat", "options", "float8_rule", "models", "tp"},
    {"core", "offload"},
    {"sharding"},
    {"planning"},
    {"ops", "checkpoint", "pretrained", "data"},
    {"testing"},
    {"engine", "train"},
    {"bench", "cli", "__main__", "__init__"},
    {"integrations"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
# within a layer: offload uses core (core never imports offload: the runtime reaches it through
# core/step_hook.py); checkpoint uses ops, pretrained both; train uses the engine
ORDER = {"core": 0, "offload": 1, "ops": 0, "checkpoint": 1, "pretrained": 2, "engine": 0, "train": 1}


def _package(path: Path) -> str:
    rel = path.relative_to(SRC).parts
    return rel[0].removesuffix(".py")


def _imported_packages(path: Path) -> set[str]:
    """Top-level shardtrain packages `path` imports (absolute `shardtrain.x` or relative)."""
    tree = ast.parse(path.read_text())
    depth = len(path.relative_to(SRC).parts) - 1  # 0 for shardtrain/x.py, 1 for shardtrain/pkg/x.py
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 0:
                parts = (node.module or "").split(".")
                if parts[0] == "shardtrain" and len(parts) > 1:
                    found.add(parts[1])
            elif node.level > depth:  # `from .. import x` or `from ..pkg import y`
                target = (node.module or "").split(".")[0]
                found |= {target} if target else {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "shardtrain" and len(parts) > 1:
                    found.add(parts[1])
    return {p for p in found if p in RANK}


def test_every_package_imports_only_from_its_layer_or_below():
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        mine = _package(path)
        for other in _imported_packages(path) - {mine}:
            same_layer = RANK[other] == RANK[mine]
            if RANK[other] > RANK[mine] or (same_layer and ORDER.get(other, 0) > ORDER.get(mine, 0)):
                wrong.append(f"{path.relative_to(SRC)} ({mine}) imports {other}")
            if other == "bench" and mine != "cli":
                wrong.append(f"{path.relative_to(SRC)} imports the benchmark tool")
    assert wrong == [], "\n".join(wrong)


PACKAGES = sorted(p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists())

# One fresh interpreter imports torch and the heavy torch modules shardtrain loads (torch.distributed.tensor,
# flex_attention, torch._dynamo for `@torch._dynamo.disable`), but no shardtrain module; it forks
# one child per package, which imports only `shardtrain.<pkg>` and writes its traceback, if any, to a
# pipe. Each child still imports every shardtrain module of its package fresh, so a circular or
# order-dependent import among them fails as in `python -c "import shardtrain.<pkg>"`; paying the
# torch imports once instead of per package saves ~5-10 s a package.
_FORK_IMPORTS = """
import json, os, sys, traceback
import torch, torch._dynamo, torch.distributed.tensor, torch.nn.attention.flex_attention
assert not [m for m in sys.modules if m.startswith("shardtrain")], "the parent imported shardtrain"
errors = {}
for package in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            __import__("shardtrain." + package)
            message = ""
        except BaseException:
            message = traceback.format_exc() or "failed"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    errors[package] = message or ("" if status == 0 else f"child exited with status {status}")
print(json.dumps(errors))
"""


@pytest.fixture(scope="module")
def import_errors() -> dict[str, str]:
    """Each package's traceback when imported alone in a fresh interpreter ("" when it imports)."""
    run = subprocess.run([sys.executable, "-c", _FORK_IMPORTS, *PACKAGES], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_alone(package, import_errors):
    assert import_errors[package] == "", import_errors[package][-2000:]


def _core_names_reached(path: Path) -> set[str]:
    """Names `path` imports from a module inside `core` (`from ..core.held import HeldParam`)."""
    depth = len(path.relative_to(SRC).parts) - 1
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = node.module or ""
        if node.level == 0 and module.startswith("shardtrain."):
            module, level_ok = module.removeprefix("shardtrain."), True
        else:
            level_ok = node.level == depth + 1
        if level_ok and module.startswith("core."):
            names |= {alias.name for alias in node.names}
    return names


def test_outside_core_only_the_names_core_exports():
    """`core.__all__` is the face the other packages use: an import of a core module's name from
    outside core names one of those."""
    tree = ast.parse((SRC / "core" / "__init__.py").read_text())
    exported = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["__all__"]
    )
    wrong = [
        f"{path.relative_to(SRC)}: {name}"
        for path in sorted(SRC.rglob("*.py"))
        if _package(path) != "core"
        for name in sorted(_core_names_reached(path) - set(exported))
    ]
    assert wrong == [], "\n".join(wrong)


def _modules_imported(path: Path, package: str) -> set[str]:
    """Modules under `package` that `path` imports anywhere in it (module level, TYPE_CHECKING,
    functions), as paths relative to the package without `.py` (`cost/estimate` in planning)."""
    here = path.relative_to(SRC).with_suffix("").parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(here[: len(here) - node.level])
            parts = base + (node.module.split(".") if node.module else [])
            found |= {"/".join(parts + [alias.name]) for alias in node.names} | {"/".join(parts)}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"shardtrain.{package}"):
            parts = node.module.split(".")[1:]
            found |= {"/".join(parts + [alias.name]) for alias in node.names} | {"/".join(parts)}
    return {
        name.removeprefix(f"{package}/")
        for name in found
        if name.startswith(f"{package}/") and (SRC / f"{name}.py").exists() and SRC / f"{name}.py" != path
    }


def _import_graph(package: str) -> dict[str, set[str]]:
    modules = {p.relative_to(SRC / package).with_suffix("").as_posix(): p for p in (SRC / package).rglob("*.py")}
    return {name: _modules_imported(path, package) for name, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[str]:
    """The modules of `graph` that reach themselves."""

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(
            nxt == goal or (nxt not in seen and not seen.add(nxt) and reaches(nxt, goal, seen)) for nxt in graph[start]
        )

    return sorted(name for name in graph if reaches(name, name, set()))


@pytest.mark.parametrize("package", ["core", "offload", "tp"])
def test_no_import_circle_inside_the_engine_packages(package):
    """core, offload and tp: no module reaches itself through imports, counting TYPE_CHECKING and
    function-level ones (a deferred import must not close a circle)."""
    graph = _import_graph(package)
    assert any(graph.values()), graph  # the walk sees the package's own imports
    assert _circles(graph) == []


def test_tensor_parallelism_lives_in_tp():
    """A reader finds tensor parallelism from the file list: outside tp/ only the planner prices it
    (planning/cost/tensor_parallel.py); "tp with offload" is refused in one module (tp/refusals.py)."""
    named = sorted(
        p.relative_to(SRC).as_posix()
        for p in SRC.rglob("*.py")
        if ("tensor_parallel" in p.name or p.name.startswith("tp_")) and _package(p) != "tp"
    )
    assert named == ["planning/cost/tensor_parallel.py"]
    refusing = sorted(
        p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py") if "offload is not supported" in p.read_text()
    )
    assert refusing == ["tp/refusals.py"]


def test_planning_parts_import_neither_each_other_nor_in_a_circle():
    """planning/dry_run and planning/cost do not import each other; no circle among planning's modules,
    counting imports inside functions too (a function-level import must not close one)."""
    graph = _import_graph("planning")
    assert "cost/model_spec" in graph["cost/module_spec"]  # the reader sees the imports
    crossing = [
        f"{name} imports {other}"
        for name, others in graph.items()
        for other in others
        if name.split("/")[0] != other.split("/")[0]
    ]
    assert crossing == [], "\n".join(crossing)
    assert _circles(graph) == []
