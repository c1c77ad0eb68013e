"""Lightning FSDPStrategy's `auto_wrap_policy=` and `activation_checkpointing_policy=`, read as `st.shard`'s
`wrap=` and `activation_checkpointing=`, so a script switches from `FSDPStrategy(...)` to
`ShardtrainStrategy(...)` with the same arguments.

Lightning takes, for both: a set of module classes (it builds torch's `ModuleWrapPolicy` from it), a
`ModuleWrapPolicy`, a torch FSDP policy object (`CustomPolicy`), or a callable with FSDP's signature
`(module, recurse, nonwrapped_numel) -> bool` (`functools.partial(transformer_auto_wrap_policy, ...)`,
`size_based_auto_wrap_policy`, a user's function). Its older `activation_checkpointing=` (a class or a list
of classes) is `st.shard`'s own option with the same meaning and passes through untouched.

Classes (and `ModuleWrapPolicy`'s classes) become a set of classes. A callable or a policy object decides
on the model's tree (`nonwrapped_numel` depends on which descendants were chosen first), so it runs at
setup, on the model, through torch's own traversal (the one FSDP and `apply_activation_checkpointing`
use, with a wrapper that only records): the modules it picks become the units, or the checkpointed modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, _Policy, _recursive_wrap

# Lightning's name -> the st.shard option it sets.
LIGHTNING_POLICIES = {"auto_wrap_policy": "wrap", "activation_checkpointing_policy": "activation_checkpointing"}


@dataclass(frozen=True, kw_only=True)
class TreePolicy:
    """A Lightning policy that decides on the model's tree; `on(model)` runs it there."""

    argument: str  # the Lightning argument it was given as
    policy: Any

    def on(self, model: nn.Module) -> ChosenModules:
        return ChosenModules(described=f"{self.argument}={self.policy!r}", modules=_chosen(model, self.policy))


@dataclass(frozen=True, kw_only=True)
class ChosenModules:
    """`st.shard`'s predicate for the modules a `TreePolicy` picked in one model."""

    described: str
    modules: frozenset[nn.Module]

    def __call__(self, module: nn.Module) -> bool:
        return module in self.modules

    def __repr__(self) -> str:
        return self.described


def split_lightning_policies(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, TreePolicy]]:
    """`kwargs` (a ShardtrainStrategy's) with Lightning's policy arguments turned into `st.shard`'s options
    (classes as a set), and the policies to run on the model at setup, keyed by the option they set."""
    options = dict(kwargs)
    tree: dict[str, TreePolicy] = {}
    for argument, option in LIGHTNING_POLICIES.items():
        policy = options.pop(argument, None)
        if policy is None:
            continue
        classes = _classes(argument, policy)
        given = options.get(option)
        if given is not None and (classes is None or _as_classes(given) != classes):
            raise ValueError(
                f"ShardtrainStrategy got {option}={_described(given)} and Lightning's {argument}={_described(policy)}, "
                "which differ; pass one of them"
            )
        if classes is not None:
            options[option] = classes
        else:
            tree[option] = TreePolicy(argument=argument, policy=policy)
    return options, tree


def _classes(argument: str, policy: Any) -> set[type[nn.Module]] | None:
    """The module classes `policy` names; None for a policy that must see the tree; TypeError otherwise."""
    if isinstance(policy, ModuleWrapPolicy):
        return set(policy._module_classes)
    classes = _as_classes(policy)
    if classes is not None:
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(
                f"ShardtrainStrategy({argument}={policy!r}): every entry must be an nn.Module subclass, got {bad!r}"
            )
        return classes
    if callable(policy) or isinstance(policy, _Policy):
        return None
    raise TypeError(
        f"ShardtrainStrategy({argument}={policy!r}) is not a policy Lightning's FSDPStrategy takes: pass a set of "
        "module classes, torch's ModuleWrapPolicy, or a callable(module, recurse, nonwrapped_numel) -> bool; "
        "st.shard's own forms (st.SizePolicy, a callable(module) -> bool) go under wrap= / activation_checkpointing="
    )


def _as_classes(policy: Any) -> set | None:
    if isinstance(policy, type):
        return {policy}
    if isinstance(policy, (set, frozenset, list, tuple)):
        return set(policy)
    return None


def _described(policy: Any) -> str:
    classes = _as_classes(policy)
    if classes is None:
        return repr(policy)
    return "{" + ", ".join(sorted(getattr(c, "__name__", repr(c)) for c in classes)) + "}"


def _chosen(model: nn.Module, policy: Any) -> frozenset[nn.Module]:
    """The modules torch FSDP's traversal picks in `model` under `policy` (the root excepted, as there)."""
    if isinstance(policy, _Policy) and not callable(policy):
        targets = policy._run_policy(model, ignored_modules=set(), root_kwargs={})
        overridden = sorted({type(m).__name__ for m, arguments in targets.items() if arguments})
        if overridden:
            raise ValueError(
                f"{type(policy).__name__} gives {overridden} their own FSDP arguments; shardtrain shards every unit alike: "
                "return True for them instead of a dict"
            )
        return frozenset(m for m in targets if m is not model)
    chosen: list[nn.Module] = []
    _recursive_wrap(
        module=model,
        auto_wrap_policy=policy,
        wrapper_cls=_recorder(chosen),
        ignored_modules=set(),
        ignored_params=set(),
        only_wrap_children=True,
    )
    return frozenset(chosen)


def _recorder(chosen: list[nn.Module]):
    """A `wrapper_cls` for torch's traversal that wraps nothing: it notes the module and returns it."""

    def record(module: nn.Module, **_: Any) -> nn.Module:
        chosen.append(module)
        return module

    return record
