"""`--optim.schedule`: each schedule's learning-rate curve is transformers' (or the built-in cosine's)
for the same parameters, and a scheduler restored from its state dict continues the curve exactly."""

import json

import pytest
import torch
from transformers import get_scheduler

from shardtrain.checkpoint.values import decode, encode
from shardtrain.train import schedule
from shardtrain.train.schedule import build_scheduler, warmup_cosine
from shardtrain.train.sections import ConfigError, OptimConfig

TOTAL = 20


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=2e-3)


def _curve(scheduler, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        lrs.append(scheduler.get_last_lr()[0])
        scheduler.optimizer.step()
        scheduler.step()
    return lrs


# (our settings, transformers' get_scheduler arguments for the same curve)
CASES = {
    "constant": ({"warmup_steps": 3}, ("constant_with_warmup", 3, {})),
    "linear": ({"warmup_ratio": 0.1}, ("linear", 2, {})),
    "cosine_with_restarts": ({"warmup_steps": 2, "num_cycles": 3}, ("cosine_with_restarts", 2, {"num_cycles": 3})),
    "wsd": (
        {"warmup_steps": 4, "decay_fraction": 0.25, "min_lr_ratio": 0.05},
        ("warmup_stable_decay", 4, {"num_decay_steps": 5, "min_lr_ratio": 0.05}),
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_schedule_is_transformers_own_curve(name):
    ours, (hf_name, warmup, specific) = CASES[name]
    curve = _curve(build_scheduler(_optimizer(), optim=OptimConfig(schedule=name, **ours), total_steps=TOTAL), TOTAL)
    expected = get_scheduler(
        hf_name, _optimizer(), num_warmup_steps=warmup, num_training_steps=TOTAL, scheduler_specific_kwargs=specific
    )
    assert curve == _curve(expected, TOTAL)
    assert len(set(curve)) > 2  # the curve moves: warm-up and (but for constant) decay


def test_cosine_is_the_built_in_warmup_cosine():
    cfg = OptimConfig(schedule="cosine", warmup_steps=3, min_lr_ratio=0.2)
    curve = _curve(build_scheduler(_optimizer(), optim=cfg, total_steps=TOTAL), TOTAL)
    assert curve == [2e-3 * warmup_cosine(s, warmup_steps=3, total_steps=TOTAL, min_ratio=0.2) for s in range(TOTAL)]


@pytest.mark.parametrize("name", ["cosine", *sorted(CASES)])
def test_a_restored_scheduler_continues_the_curve_exactly(name):
    cfg = OptimConfig(schedule=name, warmup_steps=3, num_cycles=2)
    straight = _curve(build_scheduler(_optimizer(), optim=cfg, total_steps=TOTAL), TOTAL)
    first = build_scheduler(_optimizer(), optim=cfg, total_steps=TOTAL)
    head = _curve(first, 7)
    saved = json.loads(json.dumps(encode(first.state_dict(), "scheduler")))  # as a checkpoint's metadata keeps it
    resumed = build_scheduler(_optimizer(), optim=cfg, total_steps=TOTAL)
    resumed.load_state_dict(decode(saved))
    assert head + _curve(resumed, TOTAL - 7) == straight


def test_a_transformers_schedule_without_transformers_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(schedule.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"optim.schedule='wsd' is transformers' get_scheduler: pip install"):
        build_scheduler(_optimizer(), optim=OptimConfig(schedule="wsd"), total_steps=TOTAL)
    build_scheduler(_optimizer(), optim=OptimConfig(), total_steps=TOTAL)  # the default needs no transformers


def test_unknown_schedule_names_the_choices():
    with pytest.raises(ConfigError, match="optim.schedule='step' is invalid: use one of cosine, constant, linear"):
        OptimConfig(schedule="step")
