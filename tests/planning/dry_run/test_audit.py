"""Precision audit: the dtypes per unit for fp32 / bf16 / fp16 and each strategy, checked against what
st.shard really produces on a Gloo group."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardtrain as st
from shardtrain.core.comm import UnitComm
from shardtrain.models.llama import Block, Llama, llama_config
from shardtrain.planning.dry_run.audit import audit_precision, dtype_name
from tests.models import ConvNet, FrozenShared, lm_loss, make_batches, tiny_llama

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def _meta_llama() -> Llama:
    with torch.device("meta"):
        return Llama(llama_config("tiny"))


@pytest.mark.parametrize(
    "precision, compute, reduce",
    [
        (None, "fp32", "fp32"),
        ("32-true", "fp32", "fp32"),
        ("bf16", "bf16", "fp32"),
        ("bf16-mixed", "bf16", "fp32"),
        ("fp16", "fp16", "fp32"),
        ("16-mixed", "fp16", "fp32"),
    ],
)
def test_dtypes_per_unit_for_each_precision(precision, compute, reduce):
    audit = audit_precision(_meta_llama(), wrap={Block}, mixed_precision=precision)
    assert [u.name for u in audit.units] == ["", "layers.0", "layers.1"]
    assert [u.params for u in audit.units] == [2 * 256 * 64 + 64, 46_208, 46_208]
    root, block, _ = audit.units
    # stored, compute, grad, reduce, grad (opt), optimizer state, buffers (the rotary tables, fp32 as built)
    assert root.cells() == ("fp32", compute, compute, reduce, "fp32", "fp32", "fp32")
    assert block.cells() == ("fp32", compute, compute, reduce, "fp32", "fp32", "-")
    assert [name for name, _ in root.buffers] == ["rope_cos", "rope_sin"]
    gradscaler = any("st.GradScaler" in n for n in audit.notes)
    assert gradscaler == (compute == "fp16")
    assert any("stay as built" in n for n in audit.notes) == (compute != "fp32")


NARROW = (
    "gradients exchanged in bf16 (all-to-all) and summed in fp32 on arrival (a reduce-scatter in fp32 when "
    "accumulated under no_sync)"
)


@pytest.mark.parametrize(
    "strategy, communication, resident",
    [
        ("full_shard", f"all-gather (bf16) in forward and again in backward; {NARROW}", False),
        ("shard_grad_op", f"all-gather (bf16) in forward only (kept through backward); {NARROW}", False),
        ("optimizer_only", f"{NARROW}; all-gather (bf16) of the updated shards after the step", True),
        ("no_shard", "all-reduce of gradients in fp32; no all-gather", True),
        (
            "hybrid_shard",
            f"all-gather (bf16) in forward and again in backward; {NARROW}; "
            "all-reduce of the shards across replica groups",
            False,
        ),
        ("SHARD_GRAD_OP", "all-gather (bf16) in forward only", False),
    ],
)
def test_each_strategy_keeps_the_dtypes_and_names_its_collectives(strategy, communication, resident):
    audit = audit_precision(_meta_llama(), wrap={Block}, strategy=strategy, mixed_precision="bf16")
    assert audit.communication.startswith(communication)
    assert ("for good" in audit.placement) == resident
    assert {u.cells()[:6] for u in audit.units} == {("fp32", "bf16", "bf16", "fp32", "fp32", "fp32")}
    text = str(audit)
    assert f"precision audit: Llama, {audit.strategy.value}" in text and communication in text
    assert "stored  compute  grad  reduce  grad (opt)  optim state  buffers" in text
    assert "layers.1 46,208 fp32 bf16 bf16 fp32 fp32 fp32 -".split() in [line.split() for line in text.splitlines()]


def test_custom_precision_casts_float_buffers_only_and_warns_about_low_precision_reduction():
    mp = st.MixedPrecision(param_dtype=BF16, reduce_dtype=BF16, buffer_dtype=BF16)
    audit = audit_precision(ConvNet(), wrap=None, mixed_precision=mp)
    (root,) = audit.units
    assert root.cells() == ("fp32", "bf16", "bf16", "bf16", "fp32", "fp32", "bf16/int64")
    assert dict(root.buffers)["features.1.num_batches_tracked"] is torch.int64
    assert dict(root.buffers)["features.1.running_mean"] is BF16
    assert any("summed across ranks in bf16" in n for n in audit.notes)


def test_frozen_units_have_no_gradients_or_optimizer_state_and_offload_lives_on_the_host():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = FrozenShared()
            self.head = nn.Linear(3, 2)

    audit = audit_precision(Net(), wrap=lambda m: type(m).__name__ == "Residual", cpu_offload=True)
    frozen = next(u for u in audit.units if u.name == "body.frozen")
    assert frozen.cells() == ("fp32", "fp32", "-", "-", "-", "-", "-")
    assert next(u for u in audit.units if u.name == "body.shared").grad is F32
    assert audit.cpu_offload and audit.placement.startswith("host (CPU offload)")
    half = audit_precision(_meta_llama(), wrap={Block}, cpu_offload=st.CPUOffload(fraction=0.5))
    assert half.offloaded_units == tuple(
        u.name or "<root>"
        for u, on in zip(half.units, st.CPUOffload(fraction=0.5).select(u.params for u in half.units))
        if on
    )
    assert 0 < len(half.offloaded_units) < len(half.units)
    assert half.placement.startswith(f"host (CPU offload) for {len(half.offloaded_units)} of {len(half.units)} units")


def test_a_model_built_in_bf16_has_no_fp32_master_and_mixed_dtypes_get_a_row_per_group():
    low = tiny_llama().to(BF16)
    audit = audit_precision(low, wrap={Block})
    assert {u.stored for u in audit.units} == {BF16} and {u.optimizer_state for u in audit.units} == {BF16}
    assert any("no fp32 master copy" in n for n in audit.notes)
    with_masters = audit_precision(low, wrap={Block}, mixed_precision="bf16")
    assert {u.stored for u in with_masters.units} == {torch.float32}  # trainable bf16 parameters get fp32 masters
    mixed = tiny_llama()
    mixed.layers[0].attn.wq.to(F16).requires_grad_(False)
    rows = {u.name: u for u in audit_precision(mixed, wrap={Block}).units}
    assert rows["layers.0 [1/2]"].stored == torch.float32 and rows["layers.0 [1/2]"].grad == torch.float32
    frozen = rows["layers.0 [2/2]"]
    assert frozen.stored == F16 and frozen.grad is None and frozen.params == 64 * 64
    assert dtype_name(None) == "-" and dtype_name(torch.int64) == "int64"


def _observed_dtypes(strategy: str, precision) -> dict:
    """What st.shard really makes, per unit name: the audit's columns, observed during one step."""
    torch.manual_seed(0)
    model = st.shard(tiny_llama(), strategy=strategy, wrap={Block}, mixed_precision=precision)
    audit = audit_precision(tiny_llama(), wrap={Block}, strategy=strategy, mixed_precision=precision)
    compute, reduce = {}, []

    def seen(module: nn.Module, _inputs) -> None:
        compute[module] = module.weight.dtype

    hooks = [m.register_forward_pre_hook(seen) for m in model.modules() if isinstance(m, nn.Linear)]
    original = UnitComm.reduce_gradient

    def record(self, flat_grad, *, accumulate, **kwargs):
        def reduced(shard_grad):  # the dtype the ranks' gradients were summed in
            reduce.append(shard_grad.dtype)
            accumulate(shard_grad)

        return original(self, flat_grad, accumulate=reduced, **kwargs)

    UnitComm.reduce_gradient = record
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = make_batches("llama", steps=1, global_batch=2 * dist.get_world_size())[0]
        lm_loss(model, (x[:2], y[:2])).backward()
        opt.step()
    finally:
        UnitComm.reduce_gradient = original
        for h in hooks:
            h.remove()
    params = dict(model.named_parameters())
    observed = {
        "stored": {p.dtype for p in params.values()},
        "compute": set(compute.values()),
        "reduce": set(reduce),
        "grad": {p.grad.dtype for p in params.values() if p.grad is not None},
        "state": {t.dtype for s in opt.state.values() for t in (s["exp_avg"], s["exp_avg_sq"])},
        "buffers": {b.dtype for b in model.buffers()},
    }
    expected = {
        "stored": {u.stored for u in audit.units},
        "compute": {u.compute for u in audit.units},
        "reduce": {u.reduce for u in audit.units},
        "grad": {u.sharded_grad for u in audit.units},
        "state": {u.optimizer_state for u in audit.units},
        "buffers": {d for u in audit.units for d in u.buffer_dtypes},
    }
    return {"observed": observed, "expected": expected}


@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
def test_the_audit_matches_what_st_shard_really_makes(pools, strategy):
    for precision in [None, "bf16", st.MixedPrecision(param_dtype=F16, reduce_dtype=F16, buffer_dtype=BF16)]:
        for out in pools(2).run(_observed_dtypes, strategy, precision):
            assert out["observed"] == out["expected"], (strategy, precision)
