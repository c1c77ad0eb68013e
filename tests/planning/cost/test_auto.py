"""The automatic plan: hand-checked choices, the cost model's arithmetic, monotonic behaviour, errors."""

import copy
import re

import pytest
import torch
import torch.distributed as dist

import shardtrain as st
from shardtrain.models.llama import SHARD_UNITS, Block, Llama, llama_config
from shardtrain.planning.cost.auto import choose_plan
from shardtrain.planning.cost.candidates import batch_splits, checkpoint_options
from shardtrain.planning.cost.checkpointing import recompute_policy
from shardtrain.planning.cost.model_input import resolve_model
from shardtrain.planning.cost.offload_time import OffloadWork
from shardtrain.planning.cost.shard_auto import resolve_auto
from shardtrain.planning.cost.speed import GATHER_EXPOSED_TOKENS, STEP_OVERHEAD_TOKENS, efficiency, step_time
from shardtrain.strategy import Strategy
from tests.models import lm_loss, make_batches, tiny_llama

# 8b: dim 4096, 32 layers, 32 heads / 8 kv, ffn 14336, vocab 128256 (untied); 1.5b: 16 layers, dim 2048
P8, BLOCK8, DIM8, VOCAB = 8_030_261_248, 218_112_000, 4096, 128256
P15 = 1_532_037_120
SEQ = 4096
F8 = 6 * (P8 - VOCAB * DIM8) + 6 * 32 * DIM8 * SEQ  # training FLOPs per token (BENCHMARKS.md's MFU formula)
RECOMPUTE8 = 32 * (2 * BLOCK8 + 2 * DIM8 * SEQ) / F8  # every block's forward again, as a fraction of F8


def _plan(model="8b", memory="141GB", per_device=2, world=2, **kwargs):
    return choose_plan(
        model,
        world_size=world,
        device_memory=memory,
        seq_len=SEQ,
        global_batch_tokens=world * per_device * SEQ,
        **kwargs,
    )


def test_8b_on_two_h200_runs_without_checkpointing_and_beats_full_checkpointing_by_more_than_15_percent():
    choice = _plan()
    assert (choice.strategy, choice.recompute_every, choice.cpu_offload) == (Strategy.SHARD_GRAD_OP, 0, False)
    assert (choice.micro_batch, choice.grad_accum, choice.activation_checkpointing) == (2, 1, False)
    bill = st.estimate_memory("8b", world_size=2, strategy="shard_grad_op", micro_batch=2, seq_len=SEQ)
    assert choice.predicted_bytes == bill.total + bill.reserve <= choice.usable_memory == int(141e9 * 0.95)
    # Step time in token-times: 8192 tokens in one micro-batch at efficiency 8192 / (8192 + 256), plus the
    # per-step overhead; shard_grad_op has no exposed second all-gather.
    compute = 8192 + 256
    assert choice.step_time.total == pytest.approx(compute + STEP_OVERHEAD_TOKENS)
    assert choice.relative_step_time == pytest.approx((compute + 1950) / 8192)
    baseline = compute * (1 + RECOMPUTE8) + GATHER_EXPOSED_TOKENS + STEP_OVERHEAD_TOKENS  # full_shard, every block
    ratio = baseline / (compute + STEP_OVERHEAD_TOKENS)
    assert ratio == pytest.approx(1.265, abs=0.002) and ratio >= 1.15
    reasons = "\n".join(choice.reasons)
    assert f"predicted {ratio:.2f}x the tokens/s" in reasons
    assert "activation checkpointing: none" in reasons and "CPU offload: not needed" in reasons
    assert "full_shard is predicted 1.2% slower" in reasons and "no_shard needs 169.35 GiB" in reasons
    assert str(choice).startswith("automatic plan: shard_grad_op, activation checkpointing none, micro-batch 2 x 1")


def test_the_cost_model_reproduces_the_fsdp2_8b_anchors():
    spec = resolve_model("8b")

    def tokens_per_s(micro_batch: int, blocks: int) -> float:  # relative: tokens per token-time
        t = step_time(
            model=spec,
            strategy=Strategy.FULL_SHARD,
            shard_size=2,
            checkpointed_blocks=blocks,
            micro_batch=micro_batch,
            grad_accum=1,
            seq_len=SEQ,
        )
        return t.tokens / t.total

    base = tokens_per_s(
        1, 32
    )  # torch FSDP2, 8B, batch 1, checkpointed, 2 x H200: 6,784 tokens/s/GPU (BENCHMARKS.md, step-time model)
    assert tokens_per_s(1, 0) / base == pytest.approx(8215 / 6784, rel=0.01)
    assert tokens_per_s(2, 32) / base == pytest.approx(7967 / 6784, rel=0.01)


def test_step_time_arithmetic_by_hand():
    spec = resolve_model("8b")
    t = step_time(
        model=spec,
        strategy=Strategy.FULL_SHARD,
        shard_size=2,
        checkpointed_blocks=8,
        micro_batch=1,
        grad_accum=3,
        seq_len=SEQ,
        offload=OffloadWork(params=4_000_000_000, units=17),
    )
    compute = 3 * SEQ / efficiency(SEQ)
    assert efficiency(SEQ) == SEQ / (SEQ + 256)
    assert t.compute == pytest.approx(compute)
    assert t.recompute == pytest.approx(compute * RECOMPUTE8 / 4)  # 8 of 32 blocks
    assert t.gathers == pytest.approx(3 * 0.03 * 4096)  # one exposed gather per micro-batch
    # One token-time: 48.25 GFLOP at 79% of 790 TFLOP/s. Overlapped (the default), the forward takes
    # the host AdamW beside it (4e9 x 0.185 ns x 381 / 283), longer than its third of the resident step;
    # the backward (2/3 of it) outlasts the copies both ways (2 x 16 GB at 54.5 GB/s).
    assert t.token_s == pytest.approx(48.25e9 / (0.79 * 790e12), rel=1e-3) and t.tokens == 3 * SEQ
    resident = (t.compute + t.recompute + t.gathers + t.overhead) * t.token_s
    host = 4e9 * 0.185e-9 * 381 / 283
    assert resident / 3 < host and 2 / 3 * resident > 2 * 16e9 / 54.5e9 and t.disk == 0
    offloaded = host + 2 / 3 * resident
    assert t.offload * t.token_s == pytest.approx(offloaded - resident) and t.seconds == pytest.approx(offloaded)
    alone = step_time(
        model=spec,
        strategy=Strategy.FULL_SHARD,
        shard_size=1,
        checkpointed_blocks=0,
        micro_batch=1,
        grad_accum=1,
        seq_len=SEQ,
    )
    assert alone.gathers == 0 and alone.recompute == 0  # nothing to gather within a group of one


def test_a_tiny_model_needs_no_sharding_of_parameters_nor_checkpointing():
    choice = _plan("tiny", memory="80GB", per_device=8)
    assert choice.strategy in (Strategy.SHARD_GRAD_OP, Strategy.NO_SHARD)
    assert (choice.recompute_every, choice.cpu_offload, choice.micro_batch, choice.grad_accum) == (0, False, 8, 1)


def test_offload_only_when_nothing_fits_on_the_device_and_it_says_so():
    choice = _plan(memory="70GB")
    assert choice.cpu_offload
    smallest = st.estimate_memory("8b", world_size=2, activation_checkpointing=True, micro_batch=2, seq_len=SEQ)
    assert smallest.total + smallest.reserve > int(70e9 * 0.95)  # full_shard + every block does not fit
    offload = next(r for r in choice.reasons if r.startswith("CPU offload"))
    assert "chosen because nothing fits on the device without it" in offload and "66.64 GiB" in offload
    assert choice.estimate.host > 0 and "per process in host memory" in offload


def test_nothing_fits_says_what_to_change():
    with pytest.raises(
        ValueError,
        match=r"nothing fits in 14.90 GiB per device .* needs 66.64 GiB\. To fit: use at "
        r"least 32 devices .*; or use devices with at least 70.15 GiB; or allow CPU",
    ):
        _plan(memory="16GB", allow_offload=False)
    with pytest.raises(ValueError, match=r"use at least 4 devices .* CPU offload\); or shorten seq_len to 2048"):
        _plan(memory="16GB")


def test_less_memory_never_means_less_checkpointing_or_a_faster_step():
    sizes = [141, 130, 120, 110, 100, 95, 90, 85, 80]
    blocks = [
        choose_plan(
            "8b",
            world_size=2,
            device_memory=f"{gb}GB",
            seq_len=SEQ,
            micro_batch=2,
            strategies=("full_shard",),
            split_batch=False,
        ).checkpointed_blocks
        for gb in sizes
    ]
    assert blocks == sorted(blocks) and blocks[0] == 0 and blocks[-1] == 32
    times = [_plan(memory=f"{gb}GB").step_time.total for gb in sizes + [60, 40]]
    assert times == sorted(times)


def test_gradient_accumulation_keeps_the_global_batch_and_counts_its_no_sync_gradients():
    choice = _plan("1.5b", memory="40GB", per_device=8)
    assert (choice.micro_batch, choice.grad_accum, choice.recompute_every) == (1, 8, 0)
    bill = st.estimate_memory("1.5b", world_size=2, strategy=choice.strategy, micro_batch=1, seq_len=SEQ)
    assert choice.predicted_bytes == bill.total + bill.reserve + P15 * 4  # fp32 unsharded grads under no_sync
    batch = next(r for r in choice.reasons if r.startswith("batch:"))
    assert "keeps the global batch of 65,536 tokens" in batch and "no_sync holds 5.71 GiB" in batch
    assert "micro-batch 2 would need" in batch


def test_candidates_enumeration():
    assert checkpoint_options(6) == [(0, 0), (6, 1), (3, 2), (2, 3), (1, 6)]
    assert [count for _, count in checkpoint_options(32)] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 16, 32]
    assert batch_splits(6) == [(6, 1), (3, 2), (2, 3), (1, 6)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(global_batch_tokens=3 * 4096),
            r"not a multiple of world_size 2 x seq_len 4096 = 8,192 tokens; use 8,192",
        ),
        (dict(global_batch_tokens=8192, micro_batch=1), r"both give the batch"),
        (dict(), r"no batch given"),
        (dict(micro_batch=1, safety_margin=1.0), r"safety_margin=1.0 must be a fraction"),
        (dict(micro_batch=1, strategies=()), r"strategies=\(\) is empty"),
        (dict(micro_batch=1, strategies=("zero4",)), r"unknown sharding strategy 'zero4'"),
    ],
)
def test_bad_inputs_name_the_value_and_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        choose_plan("tiny", world_size=2, device_memory="80GB", seq_len=SEQ, **kwargs)


def test_resolve_auto_keeps_the_callers_micro_batch_and_gives_st_shard_arguments():
    with torch.device("meta"):
        model = Llama(llama_config("1.5b"))
    choice = resolve_auto(model, world_size=2, micro_batch=2, seq_len=SEQ, wrap={Block}, device_memory="38GB")
    assert (choice.micro_batch, choice.grad_accum) == (2, 1)
    assert any(r.startswith("batch: micro-batch 2 x 1, as given") for r in choice.reasons)
    same = _plan("1.5b", memory="38GB", split_batch=False)
    assert (choice.strategy, choice.recompute_every) == (same.strategy, same.recompute_every)
    assert 1 < choice.recompute_every < 16  # a partial checkpointing: 1 block in k
    kwargs = choice.shard_kwargs(model, wrap={Block})
    assert kwargs["strategy"] is choice.strategy and kwargs["cpu_offload"] is False
    picked = [i for i, layer in enumerate(model.layers) if kwargs["activation_checkpointing"](layer)]
    assert picked == list(range(0, 16, choice.recompute_every))
    with pytest.raises(ValueError, match="needs wrap="):
        resolve_auto(model, world_size=2, micro_batch=2, seq_len=SEQ, wrap=None, device_memory="38GB")


def test_checkpoint_policy_forms():
    with torch.device("meta"):
        model = Llama(llama_config("7m"))
    assert recompute_policy(model, wrap={Block}, every=False) is None
    assert recompute_policy(model, wrap={Block}, every=True) == {Block}
    every2 = recompute_policy(model, wrap={Block}, every=2)
    assert [every2(m) for m in model.layers] == [True, False, True, False, True, False]
    assert not every2(model) and not every2(model.layers[0].attn)
    with pytest.raises(ValueError, match=r"activation_checkpointing=-1 is not understood; use False / 0"):
        recompute_policy(model, wrap={Block}, every=-1)


def test_checkpoint_policy_leaves_the_embedding_and_head_units_alone():
    with torch.device("meta"):
        model = Llama(llama_config("7m"))
    every = recompute_policy(model, wrap=SHARD_UNITS, every=True)
    assert [every(m) for m in model.layers] == [True] * 6
    assert not every(model.embed) and not every(model.head) and not every(model)
    every3 = recompute_policy(model, wrap=SHARD_UNITS, every=3)
    assert [every3(m) for m in model.layers] == [True, False, False, True, False, False]
    assert not every3(model.embed) and not every3(model.head)


def _sharded_as_chosen(every: int) -> dict:
    """st.shard with resolve_auto's arguments, checkpointing 1 block in `every`: exactly those blocks
    recompute, and one step's gradient norm matches the unsharded model's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = tiny_llama()
    model = copy.deepcopy(ref)
    choice = resolve_auto(
        model, world_size=world, micro_batch=2, seq_len=16, wrap={Block}, device_memory="8GiB", mixed_precision=None
    )
    kwargs = choice.shard_kwargs(model, wrap={Block})
    kwargs["activation_checkpointing"] = recompute_policy(model, wrap={Block}, every=every)
    st.shard(model, wrap={Block}, **kwargs)
    x, y = make_batches("llama", steps=1, global_batch=2 * world)[0]
    lm_loss(model, (x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])).backward()
    lm_loss(ref, (x, y)).backward()
    return {
        "strategy": choice.strategy.value,
        "checkpointed": [getattr(b, "_shardtrain_checkpointed", False) for b in model.layers],
        "norm": float(st.clip_grad_norm_(model, 1e9)),  # the global gradient norm, over every rank's shard
        "ref_norm": float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()]))),
    }


def test_the_choice_applies_through_st_shard(pools):
    for every, expected in [(2, [True, False, True]), (0, [False, False, False])]:
        for out in pools(2).run(_sharded_as_chosen, every):
            assert out["checkpointed"] == expected
            assert out["strategy"] in ("shard_grad_op", "optimizer_only", "no_shard")
            assert out["norm"] == pytest.approx(out["ref_norm"], rel=1e-5)


def test_shard_auto_refuses_tensor_parallelism_before_planning():
    policy = st.AutoPolicy(micro_batch=1, seq_len=64, device_memory="8GiB")
    refused = "st.shard_auto with tp_plan= or a mesh with a 'tp' dimension: the automatic plan does not plan"
    with pytest.raises(ValueError, match=re.escape(refused)):
        st.shard_auto(tiny_llama(), policy=policy, wrap={Block}, tp_plan=st.tp.llama_plan())


def test_offload_must_fit_the_host_memory_too():
    kwargs = dict(world_size=2, device_memory="141GB", seq_len=SEQ, micro_batch=1)
    roomy = choose_plan("30b", host_memory="125GiB", **kwargs)
    assert roomy.cpu_offload == 0.5 and roomy.estimate.host <= 125 * 2**30 * 0.95
    # Half the model needs ~111 GiB per process on the host; a quarter does not fit the device.
    with pytest.raises(
        ValueError,
        match=r"more host memory per process \(offloading more of the model needs more "
        r"than the 95\.00 GiB usable here\)",
    ):
        choose_plan("30b", host_memory="100GiB", **kwargs)
