"""Lightning FSDPStrategy's policy arguments read by ShardtrainStrategy (one process, no launch): each form
picks the modules Lightning's own FSDP path picks; conflicts and unreadable values fail when it is built."""

import copy
import functools

import pytest

pytest.importorskip("lightning")

from torch import nn
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from shardtrain.integrations import fabric, lightning
from tests.integrations.toy import Block, Toy

STRATEGIES = [lightning.ShardtrainStrategy, fabric.ShardtrainStrategy]
POLICIES = {
    "set": {Block},
    "set of two classes": {Block, nn.Embedding},
    "ModuleWrapPolicy": ModuleWrapPolicy({Block}),
    "transformer_auto_wrap_policy": functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
    "size_based_auto_wrap_policy": functools.partial(size_based_auto_wrap_policy, min_num_params=3000),
    "lambda_auto_wrap_policy": functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear)),
    "CustomPolicy": CustomPolicy(lambda m: isinstance(m, nn.Linear) and m.out_features == 64),
}


def lightning_checkpoints(model: nn.Module, policy) -> list[str]:
    """The modules Lightning's FSDPStrategy(activation_checkpointing_policy=policy) wraps in torch's
    CheckpointWrapper (its own functions, on a copy of `model`)."""
    from lightning.fabric.strategies.fsdp import _activation_checkpointing_kwargs, _setup_activation_checkpointing
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    wrapped = copy.deepcopy(model)
    _setup_activation_checkpointing(wrapped, _activation_checkpointing_kwargs(None, policy))
    paths = [p for p, m in wrapped.named_modules() if isinstance(m, CheckpointWrapper)]
    return sorted(p.replace("._checkpoint_wrapped_module", "") for p in paths)


def picked(model: nn.Module, policy) -> list[str]:
    if callable(policy) and not isinstance(policy, type):
        return sorted(p for p, m in model.named_modules() if policy(m))
    return sorted(p for p, m in model.named_modules() if isinstance(m, tuple(policy)))


@pytest.mark.parametrize("strategy", STRATEGIES, ids=["Trainer", "Fabric"])
@pytest.mark.parametrize("form", list(POLICIES))
def test_each_form_picks_what_lightnings_fsdp_picks(strategy, form):
    policy, model = POLICIES[form], Toy()
    expected = lightning_checkpoints(model, policy)
    assert expected  # every form picks something in the toy
    built = strategy(auto_wrap_policy=policy, activation_checkpointing_policy=policy)
    options = built._shard_options.for_model(model)
    assert picked(model, options.wrap) == expected
    assert picked(model, options.activation_checkpointing) == expected


@pytest.mark.parametrize("strategy", STRATEGIES, ids=["Trainer", "Fabric"])
def test_the_older_spelling_and_agreeing_spellings_are_taken(strategy):
    model = Toy()
    options = strategy(activation_checkpointing=[Block])._shard_options.for_model(model)
    assert picked(model, options.activation_checkpointing) == ["blocks.0", "blocks.1"]
    options = strategy(wrap={Block}, auto_wrap_policy=ModuleWrapPolicy([Block]))._shard_options.for_model(model)
    assert picked(model, options.wrap) == ["blocks.0", "blocks.1"]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=["Trainer", "Fabric"])
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"wrap": {Block}, "auto_wrap_policy": {Toy}}, ValueError, r"wrap=\{Block\} and Lightning's auto_wrap_policy"),
        ({"wrap": {Block}, "auto_wrap_policy": POLICIES["CustomPolicy"]}, ValueError, r"pass one of them"),
        (
            {"activation_checkpointing": Block, "activation_checkpointing_policy": {nn.Linear}},
            ValueError,
            r"activation_checkpointing=\{Block\} and Lightning's activation_checkpointing_policy=\{Linear\}",
        ),
        ({"auto_wrap_policy": 3}, TypeError, r"auto_wrap_policy=3.*ModuleWrapPolicy.*wrap="),
        ({"activation_checkpointing_policy": {"Block"}}, TypeError, r"nn.Module subclass, got \['Block'\]"),
    ],
)
def test_conflicts_and_unreadable_policies_fail_when_built(strategy, kwargs, error, message):
    with pytest.raises(error, match=message):
        strategy(**kwargs)


def test_a_custom_policy_giving_a_unit_its_own_fsdp_arguments_is_refused_at_setup():
    policy = CustomPolicy(lambda m: {"sharding_strategy": "SHARD_GRAD_OP"} if isinstance(m, Block) else False)
    built = fabric.ShardtrainStrategy(auto_wrap_policy=policy)
    with pytest.raises(ValueError, match=r"CustomPolicy gives \['Block'\] their own FSDP arguments"):
        built._shard_options.for_model(Toy())
