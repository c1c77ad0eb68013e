"""Units all-gathered during `opt.step()` for the next forward (core/gather_ahead.py).

The CPU never gathers ahead on its own; these tests let it, without a memory bound, so that the
split optimizer step, the early gathers and their invalidation run on Gloo.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import shardtrain as st
from shardtrain.core import gather_ahead
from tests.core.parity import Case, gathered_ahead, run_cases
from tests.models import MODELS, lm_loss, make_batches


def test_parity_when_units_are_gathered_during_the_optimizer_step(pools):
    # A unit gathered before the optimizer stepped it would run the next forward on old weights.
    cases = [Case(strategy=s, optim=o, precision=p, gather_ahead=True) for s, o, p in [
        ("full_shard", "adamw", None), ("shard_grad_op", "sgd", None), ("full_shard", "adamw_fused", "bf16"),
        ("full_shard", "adam_foreach", None)]]
    cases += [Case(strategy="full_shard", accum="no_sync", ac=True, clip=0.05, gather_ahead=True)]
    assert pools(2).run(run_cases, "llama", cases) == [len(cases)] * 2
    split = [Case(strategy="full_shard", optim="sgd", gather_ahead=True),
             Case(strategy="shard_grad_op", precision="bf16", gather_ahead=True)]
    assert pools(2).run(run_cases, "split_llama", split) == [len(split)] * 2


def _trained_one_step(optimizer_factory):
    torch.manual_seed(0)
    factory, wrap = MODELS["split_llama"]
    model = factory()
    initial = copy.deepcopy(model)
    st.shard(model, wrap=wrap)
    optimizers = optimizer_factory(model)
    rank = dist.get_rank()
    (x, y), = make_batches("split_llama", steps=1, global_batch=4)
    for _ in range(2):  # the first forward records the order the gathers ahead follow
        lm_loss(model, (x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])).backward()
        for opt in optimizers:
            opt.step()
    return model, initial, x


def _checks() -> int:
    default = gather_ahead.headroom_bytes
    gather_ahead.headroom_bytes = lambda device: 1 << 40
    try:
        model, initial, x = _trained_one_step(lambda m: [torch.optim.AdamW(m.parameters(), lr=1e-2)])
        # Every unit but the embedding (a sharded lookup, never gathered) was gathered ahead.
        assert gathered_ahead(model) == ["", "layers.0", "layers.1", "head"], gathered_ahead(model)
        # Grads are back after the step, and the step moved every parameter once.
        assert all(p.grad is not None for p in model.parameters())
        # A checkpoint loaded after the step wins over what was gathered ahead.
        st.load_full_state_dict(model, initial.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(model(x), initial(x))

        class SubclassedAdamW(torch.optim.AdamW):
            pass

        def subclassed(m):  # a subclass may step across parameters: left whole
            return [SubclassedAdamW(m.parameters(), lr=1e-2)]

        def unit_in_two_optimizers(m):  # layers.0 has a parameter in each
            lone = m.get_parameter("layers.0.ffn.w1.weight")
            return [torch.optim.SGD([p for p in m.parameters() if p is not lone], lr=1e-2),
                    torch.optim.SGD([lone], lr=1e-2)]

        model, _, _ = _trained_one_step(subclassed)
        assert gathered_ahead(model) == [], gathered_ahead(model)
        model, _, _ = _trained_one_step(unit_in_two_optimizers)
        assert gathered_ahead(model) == ["", "layers.1", "head"], gathered_ahead(model)
    finally:
        gather_ahead.headroom_bytes = default
    return 1


def test_gathered_units_follow_checkpoint_loads_and_skip_what_they_cannot_split(pools):
    assert pools(2).run(_checks) == [1, 1]
