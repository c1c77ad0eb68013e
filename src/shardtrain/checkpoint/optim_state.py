"""Optimizer state <-> sharded parameters, so optimizer state reshards exactly like the parameters.

A torch optimizer keys its state by parameter; the parameters it holds are the sharded model's
(`unit.params`), so each maps to a (unit, parameter) by identity. State entries shaped like their
parameter (Adam's exp_avg, exp_avg_sq, SGD's momentum_buffer) are *elementwise*: this rank's rows of
them are stored like the parameter's rows and reshard with them. Other entries (Adam's 0-dim `step`)
are per-parameter *scalars* kept in the metadata. Param groups are stored with their hyperparameters
and the names of their parameters, and restored by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..core.param_layout import ParamShard
from ..core.sharded_param import local_of
from ..tp.boxes import Box
from .entries import ShardedOptimizer
from .format import dtype_code, short_list
from .values import decode, encode

_NOT_HYPERPARAMETERS = ("params", "param_names")


@dataclass(frozen=True, kw_only=True)
class OptimizerSnapshot:
    """One optimizer's state on this rank, split into elementwise pieces (local rows) and scalars."""

    cls: str
    module: str
    elementwise: dict[str, torch.dtype]  # state key -> dtype
    pieces: dict[str, dict[str, torch.Tensor]]  # fqn -> key -> this rank's rows
    scalars: dict[str, dict[str, Any]]  # fqn -> key -> value
    groups: list[tuple[dict[str, Any], list[str]]]  # (hyperparameters, parameter names)

    def piece(self, fqn: str, key: str) -> torch.Tensor | None:
        """This rank's rows of state `key` of parameter `fqn` (None when the parameter has no such state)."""
        return self.pieces.get(fqn, {}).get(key)

    def has(self, fqn: str, key: str) -> bool:
        return key in self.pieces.get(fqn, {})

    def record(self, name: str) -> dict[str, Any]:
        """The metadata.json entry (rank 0's snapshot; scalars and groups are the same on every rank)."""
        where = f"optimizer state[{name!r}]"
        return {
            "module": self.module,
            "class": self.cls,
            "elementwise": {k: dtype_code(d) for k, d in self.elementwise.items()},
            "groups": [
                {"hparams": encode(h, f"{where} param group {i}"), "params": names}
                for i, (h, names) in enumerate(self.groups)
            ],
            "state": {
                fqn: {
                    "elementwise": sorted(self.pieces.get(fqn, {})),
                    "scalars": encode(self.scalars.get(fqn, {}), f"{where}[{fqn!r}]"),
                }
                for fqn in sorted(self.pieces.keys() | self.scalars.keys())
            },
        }


def snapshot(sharded: ShardedOptimizer) -> OptimizerSnapshot:
    state_dict = sharded.optimizer.state_dict()
    params = sharded.params()
    fqns = [sharded.refs[id(p)].name for p in params]
    per_param = dict(state_dict["state"].items())
    keys = {k for s in per_param.values() for k in s}
    elementwise: dict[str, torch.dtype] = {}
    for key in sorted(keys):
        values = [(params[i], s[key]) for i, s in per_param.items() if key in s]
        shaped_like_param = all(isinstance(v, torch.Tensor) and v.shape == p.shape for p, v in values)
        if shaped_like_param and any(v.dim() for _, v in values):
            dtypes = {v.dtype for _, v in values}
            if len(dtypes) > 1:
                raise ValueError(
                    f"optimizer state {key!r} mixes dtypes {sorted(map(str, dtypes))} across parameters; "
                    "checkpoints store it in one dtype: keep it in one dtype"
                )
            elementwise[key] = dtypes.pop()
    pieces, scalars = {}, {}
    for i, s in per_param.items():
        pieces[fqns[i]] = {k: local_of(v).detach() for k, v in s.items() if k in elementwise}
        scalars[fqns[i]] = {
            k: local_of(v) if isinstance(v, torch.Tensor) else v for k, v in s.items() if k not in elementwise
        }
    groups = [
        ({k: v for k, v in g.items() if k not in _NOT_HYPERPARAMETERS}, [fqns[i] for i in g["params"]])
        for g in state_dict["param_groups"]
    ]
    return OptimizerSnapshot(
        cls=type(sharded.optimizer).__name__,
        module=sharded.module,
        elementwise=elementwise,
        pieces=pieces,
        scalars=scalars,
        groups=groups,
    )


class StateSource(Protocol):
    def saved_name(self, shard: ParamShard, shape: tuple[int, ...]) -> str | None: ...
    def read_state_box(self, optimizer: str, key: str, name: str, box: Box) -> torch.Tensor: ...


def restore_optimizer(
    sharded: ShardedOptimizer, name: str, record: dict[str, Any], source: StateSource, *, strict: bool
) -> None:
    """Load the saved state of optimizer `name` into `sharded.optimizer`, cut to this rank's rows."""
    optimizer = sharded.optimizer
    params = sharded.params()
    refs = [sharded.refs[id(p)] for p in params]
    saved = [source.saved_name(r.layout, r.shape) for r in refs]
    group_of = {fqn: g for g, group in enumerate(record["groups"]) for fqn in group["params"]}
    missing = [r.name for r, n in zip(refs, saved) if n not in group_of]
    unexpected = sorted(group_of.keys() - set(saved))
    if strict and (missing or unexpected):
        raise ValueError(
            f"optimizer state[{name!r}] does not match the checkpoint: parameters missing from it "
            f"{short_list(missing)}, parameters only in it {short_list(unexpected)}; build the optimizer "
            "over the same parameters, or pass strict=False"
        )
    groups, first = [], 0
    for g, group in enumerate(optimizer.param_groups):
        indices = list(range(first, first + len(group["params"])))
        first += len(indices)
        origins = sorted({group_of[saved[i]] for i in indices if saved[i] in group_of})
        if len(origins) > 1:
            raise ValueError(
                f"param group {g} of optimizer state[{name!r}] holds parameters the checkpoint keeps "
                f"in param groups {origins}; group the parameters as they were when saved"
            )
        hparams = {k: v for k, v in group.items() if k not in _NOT_HYPERPARAMETERS}
        if origins:
            hparams.update(decode(record["groups"][origins[0]]["hparams"]))
        groups.append({**hparams, "params": indices})
    state = {}
    for i, (ref, fqn) in enumerate(zip(refs, saved)):
        entry = record["state"].get(fqn) if fqn in group_of else None
        if entry is None or fqn is None:
            continue
        local, box = ref.local, ref.box
        values = decode(entry["scalars"])
        for key in entry["elementwise"]:
            rows = source.read_state_box(name, key, fqn, box).reshape(local.shape).to(local.device)
            values[key] = ref.wrap(rows)
        state[i] = values
    optimizer.load_state_dict({"state": state, "param_groups": groups})
