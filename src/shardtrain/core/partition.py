"""Partition a module tree into sharding units.

A unit is a module subtree minus the subtrees of the units nested in it. Each parameter belongs to
exactly one unit. A parameter registered under several modules (tied weights, shared submodules)
that would fall into different units moves to the unit of the modules' lowest common ancestor:
that unit is unsharded for the whole time any of the users run (an ancestor's forward encloses its
descendants'), so the tie keeps working without user action.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from ..policy import SizePolicy, describe_policy, module_classes, resolve_module_policy

# Module paths that wrappers insert: torch.compile's OptimizedModule and torch's checkpoint wrapper.
_WRAPPER_SEGMENTS = ("_orig_mod", "_checkpoint_wrapped_module")


def clean_name(path: str) -> str:
    """`path` without the segments that torch.compile and torch's checkpoint wrapper insert, so that a
    parameter has one name whether its module is wrapped or not (torch.distributed.checkpoint's
    state-dict helpers name parameters the same way)."""
    return ".".join(part for part in path.split(".") if part not in _WRAPPER_SEGMENTS)


def looks_up_in_place(module: nn.Module) -> bool:
    """Whether `module` is a plain `nn.Embedding` lookup (its forward not replaced on the instance, e.g.
    by activation checkpointing, and none of the options that change or renormalise the table)."""
    if not isinstance(module, nn.Embedding) or type(module).forward is not nn.Embedding.forward:
        return False
    return not (
        "forward" in module.__dict__ or module.max_norm is not None or module.scale_grad_by_freq or module.sparse
    )


@dataclass(frozen=True, kw_only=True, eq=False)
class Occurrence:
    """One registration of a parameter: `module._parameters[attr]`, at module path `raw` and known as
    `fqn` (the same without wrapper segments, `clean_name`)."""

    module: nn.Module
    attr: str
    fqn: str
    raw: str


@dataclass(kw_only=True, eq=False)
class UnitSpec:
    name: str  # module path ("" for the root)
    module: nn.Module
    params: list[nn.Parameter] = field(default_factory=list)
    occurrences: list[list[Occurrence]] = field(default_factory=list)  # per param, first is canonical

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)

    @property
    def can_look_up(self) -> bool:
        """Whether the unit is a plain `nn.Embedding` holding only its own weight: sharded over several
        ranks (neither offloaded nor resident), it looks rows up in place and never gathers (core.lookup)."""
        only_weight = [[(o.module, o.attr) for o in occ] for occ in self.occurrences] == [[(self.module, "weight")]]
        return only_weight and looks_up_in_place(self.module)


@dataclass(frozen=True, kw_only=True)
class Partition:
    units: tuple[UnitSpec, ...]  # module pre-order: parents before children; root first
    notes: tuple[str, ...]  # what the partitioner decided on the user's behalf (tied weights moved)


def _size_policy_roots(root: nn.Module, policy: SizePolicy) -> set[str]:
    """Post-order: a module becomes a unit when the parameters its child units left reach min_params."""
    chosen: set[str] = set()
    seen_params: set[int] = set()

    def visit(module: nn.Module, path: str) -> int:
        remaining = 0
        for name, child in module.named_children():
            remaining += visit(child, f"{path}.{name}" if path else name)
        for p in module.parameters(recurse=False):
            if id(p) not in seen_params:
                seen_params.add(id(p))
                remaining += p.numel()
        if path and remaining >= policy.min_params:
            chosen.add(path)
            return 0
        return remaining

    visit(root, "")
    return chosen


def _unit_roots(root: nn.Module, policy, *, what: str) -> set[str]:
    resolved = resolve_module_policy(policy, what=what)
    if resolved is None:
        return set()
    if isinstance(resolved, SizePolicy):
        chosen = _size_policy_roots(root, resolved)
    else:
        chosen = {path for path, m in root.named_modules() if path and resolved(m)}
        if resolved(root):
            chosen.add("")
    if not chosen:
        classes = module_classes(root.modules())
        extra = ""
        if isinstance(resolved, SizePolicy):
            largest = max((sum(p.numel() for p in m.parameters()) for _, m in root.named_children()), default=0)
            extra = f"; the largest child module has {largest:,} parameters, lower min_params"
        raise ValueError(
            f"{what}={describe_policy(policy)} matches no module of {type(root).__name__}; "
            f"the model contains {classes}{extra}"
        )
    return chosen


def _nearest_unit(path: str, unit_paths: set[str]) -> str:
    while path and path not in unit_paths:
        path = path.rpartition(".")[0]
    return path


def _common_prefix(paths: list[str]) -> str:
    parts = [p.split(".") if p else [] for p in paths]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def matching_paths(root: nn.Module, policy, *, what: str) -> set[str]:
    """Module paths a policy selects (used by activation checkpointing too)."""
    return _unit_roots(root, policy, what=what)


def partition(root: nn.Module, wrap) -> Partition:
    unit_paths = _unit_roots(root, wrap, what="wrap") | {""}
    modules = dict(root.named_modules(remove_duplicate=False))
    # Note: a shared submodule appears under several paths; keep the first as its home.
    home: dict[int, str] = {}
    for path, module in modules.items():
        home.setdefault(id(module), path)

    occurrences: dict[int, list[Occurrence]] = {}
    params: dict[int, nn.Parameter] = {}
    for path, module in modules.items():
        for attr, p in module._parameters.items():
            if p is None:
                continue
            raw = f"{path}.{attr}" if path else attr
            params[id(p)] = p
            occurrences.setdefault(id(p), []).append(Occurrence(module=module, attr=attr, fqn=clean_name(raw), raw=raw))

    order = {path: i for i, path in enumerate(modules)}
    specs = {
        path: UnitSpec(name=clean_name(path), module=modules[path])
        for path in sorted(unit_paths, key=order.__getitem__)
    }
    notes = []
    for pid, occ in occurrences.items():
        owners = {_nearest_unit(o.raw.rpartition(".")[0], unit_paths) for o in occ}
        owner = owners.pop() if len(owners) == 1 else None
        if owner is None:
            owner = _nearest_unit(_common_prefix([o.raw.rpartition(".")[0] for o in occ]), unit_paths)
            names = ", ".join(o.fqn for o in occ)
            notes.append(f"tied parameter ({names}) spans several units; it is kept in unit '{owner or '<root>'}'")
        specs[owner].params.append(params[pid])
        specs[owner].occurrences.append(occ)
    # A matched module left without parameters (its weight tied into an ancestor's unit) gets no unit:
    # there is nothing to gather, and its ancestor's unit is gathered whenever it runs.
    units = tuple(spec for spec in specs.values() if spec.params or not spec.name)
    return Partition(units=units, notes=tuple(notes))


def repeated_blocks(modules: list[nn.Module]) -> list[nn.Module]:
    """The modules whose class occurs more than once among `modules` (a model's blocks, not its embedding
    or head); all of them when none repeats."""
    counts = Counter(type(m) for m in modules)
    return [m for m in modules if counts[type(m)] > 1] or modules
