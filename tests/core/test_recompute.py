"""A forward without gradients between a training forward and its backward (a DPO reference pass on
the same weights, self-distillation, a probe) leaves the backward, and the recomputation of
checkpointed units in it, exactly what the training forward saw (docs/design.md, Note [Views across
a forward without gradients])."""

import pytest

from tests.core import recompute_ranks

FP32 = 1e-5
KEEP_GATHERED = {"shard_grad_op", "optimizer_only", "no_shard"}  # unsharded parameters kept through backward


def _check(results: list[dict], strategy: str) -> None:
    for r in results:
        assert r["names"] == [], r
        assert r["loss"] < FP32 and r["grad"] < FP32, r
        if strategy in KEEP_GATHERED:  # the probe reuses the kept parameters; backward needs no new gather
            assert r["gathers"].keys() <= {"train"}, r


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("ac", [True, False], ids=["checkpointed", "kept"])
@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "optimizer_only", "no_shard"])
def test_a_probe_between_forward_and_backward_changes_nothing(pools, world, ac, strategy):
    for pattern in recompute_ranks.PATTERNS:
        kwargs = dict(strategy=strategy, ac=ac, lora=False, pattern=pattern)
        _check(pools(world).run(recompute_ranks.probe_between_forward_and_backward, **kwargs), strategy)


@pytest.mark.parametrize("world", [1, 2])
def test_a_reference_pass_with_the_adapters_off_changes_nothing(pools, world):
    for pattern in recompute_ranks.PATTERNS:
        kwargs = dict(strategy="full_shard", ac=True, lora=True, pattern=pattern)
        _check(pools(world).run(recompute_ranks.probe_between_forward_and_backward, **kwargs), "full_shard")
