"""`ShardOptions` and `resolve_options`: every accepted spelling of every `st.shard` option, pinned.

A new option is a deliberate change of shardtrain/options.py and of this file (FIELDS, and a line
below for each of its spellings).
"""

import dataclasses
import functools
import inspect
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import BackwardPrefetch, CPUOffloadPolicy, MixedPrecisionPolicy, ShardingStrategy
from torch.distributed.fsdp import CPUOffload as TorchCPUOffload
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy, transformer_auto_wrap_policy

import shardtrain as st
from shardtrain.options import GatherMode, ShardOptions, offload_setting, precision_name, resolve_options
from shardtrain.sharding import shard
from shardtrain.strategy import Strategy

FIELDS = [
    "strategy",
    "wrap",
    "precision",
    "activation_checkpointing",
    "offload",
    "mesh",
    "device",
    "process_group",
    "prefetch",
    "param_init_fn",
    "sync_module_states",
    "tp_plan",
    "overlap_host_step",
    "gather",
    "check_order",
]
# st.CPUOffload's fields: each earns its place in docs/design.md, Note [Offload settings]
OFFLOAD_FIELDS = [
    "params",
    "optimizer",
    "fraction",
    "threads",
    "step_in_backward",
    "reshard_after_forward",
    "disk_dir",
    "disk_buffer_bytes",
]
ROOT = Path(__file__).resolve().parents[1]
BF16 = st.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
FP16 = st.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)


def test_the_fields_and_the_entry_points_keywords_are_pinned():
    assert [f.name for f in dataclasses.fields(ShardOptions)] == FIELDS
    # st.shard forwards its keywords to resolve_options unchanged: the same names and defaults
    shard_params = list(inspect.signature(shard).parameters.values())[1:]
    resolve_params = list(inspect.signature(resolve_options).parameters.values())
    assert [(p.name, p.default) for p in shard_params] == [(p.name, p.default) for p in resolve_params]
    assert resolve_options() == ShardOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ShardOptions().prefetch = 2  # type: ignore[misc]
    with pytest.raises(TypeError, match="build it with resolve_options"):
        ShardOptions(strategy="zero3")  # type: ignore[arg-type]


def test_the_offload_fields_and_the_environment_switches_are_pinned_and_justified():
    """A new CPUOffload field or SHARDTRAIN_ environment switch is a deliberate change of this file and of
    docs/design.md's Note [Offload settings], which says why each exists."""
    assert [f.name for f in dataclasses.fields(st.CPUOffload)] == OFFLOAD_FIELDS
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.CPUOffload().threads = 2  # type: ignore[misc]
    design = (ROOT / "docs" / "design.md").read_text()
    assert "### Note [Offload settings]" in design
    note = design.split("### Note [Offload settings]", 1)[1].split("\n#", 1)[0]
    switches = {m for p in (ROOT / "src").rglob("*.py") for m in re.findall(r'"(SHARDTRAIN_[A-Z_]+)"', p.read_text())}
    assert switches == {
        "SHARDTRAIN_HOST_STEP",
        "SHARDTRAIN_GATHER",
        "SHARDTRAIN_CHECK_ORDER",
        "SHARDTRAIN_LAUNCHER_PID",
    }
    assert [n for n in OFFLOAD_FIELDS + sorted(switches) if f"`{n}`" not in note and f"`{n}=" not in note] == []


@pytest.mark.parametrize(
    "spelling, strategy",
    [
        ("full_shard", Strategy.FULL_SHARD),
        ("zero3", Strategy.FULL_SHARD),
        ("FULL_SHARD", Strategy.FULL_SHARD),
        (ShardingStrategy.FULL_SHARD, Strategy.FULL_SHARD),
        (Strategy.FULL_SHARD, Strategy.FULL_SHARD),
        ("shard_grad_op", Strategy.SHARD_GRAD_OP),
        ("zero2", Strategy.SHARD_GRAD_OP),
        (ShardingStrategy.SHARD_GRAD_OP, Strategy.SHARD_GRAD_OP),
        ("optimizer_only", Strategy.OPTIMIZER_ONLY),
        ("zero1", Strategy.OPTIMIZER_ONLY),
        ("no_shard", Strategy.NO_SHARD),
        ("ddp", Strategy.NO_SHARD),
        (ShardingStrategy.NO_SHARD, Strategy.NO_SHARD),
        ("hybrid_shard", Strategy.HYBRID_SHARD),
        (ShardingStrategy.HYBRID_SHARD, Strategy.HYBRID_SHARD),
        ("hybrid_shard_zero2", Strategy.HYBRID_SHARD_ZERO2),
        ("_hybrid_shard_zero2", Strategy.HYBRID_SHARD_ZERO2),
        (ShardingStrategy._HYBRID_SHARD_ZERO2, Strategy.HYBRID_SHARD_ZERO2),
    ],
)
def test_strategy_spellings(spelling, strategy):
    assert resolve_options(strategy=spelling).strategy is strategy
    assert resolve_options(sharding_strategy=spelling).strategy is strategy


def test_reshard_after_forward_names_a_strategy():
    assert resolve_options(reshard_after_forward=True).strategy is Strategy.FULL_SHARD
    assert resolve_options(reshard_after_forward=False).strategy is Strategy.SHARD_GRAD_OP
    with pytest.raises(ValueError, match="reshard_after_forward=2: shardtrain takes True"):
        resolve_options(reshard_after_forward=2)


@pytest.mark.parametrize(
    "spelling, precision",
    [
        (None, st.MixedPrecision()),
        ("bf16", BF16),
        ("bf16-mixed", BF16),
        ("BF16", BF16),
        ("fp16", FP16),
        ("16-mixed", FP16),
        ("fp32", st.MixedPrecision()),
        ("32", st.MixedPrecision()),
        ("32-true", st.MixedPrecision()),
        (st.MixedPrecision(param_dtype="bf16"), st.MixedPrecision(param_dtype=torch.bfloat16)),
        (
            TorchMixedPrecision(param_dtype=torch.bfloat16),  # FSDP1's casts no inputs by default
            st.MixedPrecision(param_dtype=torch.bfloat16, cast_forward_inputs=False),
        ),
        (
            MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32),
            st.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32),
        ),
    ],
)
def test_precision_spellings(spelling, precision):
    assert resolve_options(mixed_precision=spelling).precision == precision
    if not isinstance(spelling, str) and spelling is not None and type(spelling).__module__.startswith("torch"):
        assert resolve_options(mp_policy=spelling).precision == precision


@pytest.mark.parametrize(
    "spelling, offload",
    [
        (False, None),
        (None, None),
        (True, st.CPUOffload()),
        (0.25, st.CPUOffload(fraction=0.25)),
        (1.0, st.CPUOffload()),
        (st.CPUOffload(threads=2), st.CPUOffload(threads=2)),
        (st.CPUOffload(params=False, optimizer=False), None),
        (TorchCPUOffload(offload_params=True), st.CPUOffload()),
        (TorchCPUOffload(offload_params=False), None),
        (CPUOffloadPolicy(), st.CPUOffload()),
    ],
)
def test_offload_spellings(spelling, offload):
    assert resolve_options(cpu_offload=spelling).offload == offload


def test_torch_offload_policy_names():
    assert resolve_options(offload_policy=CPUOffloadPolicy()).offload == st.CPUOffload()
    with pytest.raises(ValueError, match="parameters and optimizer state are offloaded together"):
        resolve_options(cpu_offload=st.CPUOffload(optimizer=False))
    with pytest.raises(TypeError, match="cpu_offload='yes'"):
        resolve_options(cpu_offload="yes")


def test_wrap_spellings():
    assert resolve_options(wrap={nn.Linear}).wrap == {nn.Linear}
    assert resolve_options(auto_wrap_policy=ModuleWrapPolicy({nn.Linear})).wrap == {nn.Linear}
    transformer = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear})
    assert resolve_options(auto_wrap_policy=transformer).wrap == {nn.Linear}
    sized = functools.partial(size_based_auto_wrap_policy, min_num_params=1000)
    assert resolve_options(auto_wrap_policy=sized).wrap == st.SizePolicy(min_params=1000)
    with pytest.raises(TypeError, match=r"wrap=\[3\]: every entry must be an nn.Module subclass"):
        resolve_options(wrap=[3])
    with pytest.raises(TypeError, match="activation_checkpointing=5 is not a policy"):
        resolve_options(activation_checkpointing=5)


def test_device_and_prefetch_spellings():
    assert resolve_options(device="cpu").device == torch.device("cpu")
    assert resolve_options(device_id=torch.device("cpu")).device == torch.device("cpu")
    assert resolve_options().device is None
    with pytest.raises(ValueError, match="device='gpu0' is not a device"):
        resolve_options(device="gpu0")
    assert resolve_options(prefetch=2).prefetch == 2
    assert resolve_options(forward_prefetch=False, backward_prefetch=None).prefetch == 0
    assert resolve_options(limit_all_gathers=False).prefetch == 2
    assert resolve_options(backward_prefetch=BackwardPrefetch.BACKWARD_PRE).prefetch == 1
    assert resolve_options(use_orig_params=True) == resolve_options()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            dict(strategy="auto"),
            ValueError,
            r"st.shard_auto\(model, policy=st.AutoPolicy\(micro_batch=..., seq_len=...\)",
        ),
        (dict(strategy=st.AutoPolicy(micro_batch=1, seq_len=8)), ValueError, "st.shard_auto"),
        (dict(strategy="zero4"), ValueError, "unknown sharding strategy 'zero4'"),
        (
            dict(strategy="zero3", sharding_strategy="zero2"),
            ValueError,
            "got both strategy= and torch's sharding_strategy=",
        ),
        (dict(mixed_precision="int8"), ValueError, "mixed_precision='int8' is not understood"),
        (dict(prefetch=-1), ValueError, "prefetch=-1: give the number of units"),
        (dict(sync_module_states=1), TypeError, "sync_module_states=1: use True or False"),
        (dict(param_init_fn=5), TypeError, "param_init_fn=5: pass a callable"),
        (dict(process_group="world"), TypeError, "process_group='world': pass a torch.distributed ProcessGroup"),
        (dict(use_orig_params=False), ValueError, "use_orig_params=False asks for flat parameters"),
        (dict(flatten=True), TypeError, r"unexpected keyword arguments \['flatten'\]"),
    ],
)
def test_bad_spellings_are_one_line_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        resolve_options(**kwargs)


def test_the_environment_switches(monkeypatch, tmp_path):
    """SHARDTRAIN_HOST_STEP, _GATHER and _CHECK_ORDER are read here, once."""
    for name in ("SHARDTRAIN_HOST_STEP", "SHARDTRAIN_GATHER", "SHARDTRAIN_CHECK_ORDER"):
        monkeypatch.delenv(name, raising=False)
    default = resolve_options()
    assert (default.overlap_host_step, default.gather, default.check_order) == (True, None, True)
    monkeypatch.setenv("SHARDTRAIN_HOST_STEP", "sequential")
    monkeypatch.setenv("SHARDTRAIN_GATHER", "Grouped")
    monkeypatch.setenv("SHARDTRAIN_CHECK_ORDER", "0")
    given = resolve_options()
    assert (given.overlap_host_step, given.gather, given.check_order) == (False, GatherMode.GROUPED, False)
    with pytest.raises(ValueError, match=r"SHARDTRAIN_HOST_STEP=sequential: the disk tier streams"):
        resolve_options(cpu_offload=st.CPUOffload(disk_dir=str(tmp_path)))
    for name, value, message in [
        ("SHARDTRAIN_HOST_STEP", "later", "SHARDTRAIN_HOST_STEP='later': use 'overlapped' or 'sequential'"),
        ("SHARDTRAIN_GATHER", "ring", "SHARDTRAIN_GATHER='ring': use 'grouped' or 'flat'"),
    ]:
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=message):
            resolve_options()
        monkeypatch.delenv(name)


def test_the_automatic_plan_is_its_own_entry_point():
    with pytest.raises(TypeError, match=r"st.shard_auto chooses \['cpu_offload', 'strategy'\] itself"):
        st.shard_auto(
            nn.Linear(2, 2), policy=st.AutoPolicy(micro_batch=1, seq_len=8), strategy="zero3", cpu_offload=True
        )
    with pytest.raises(TypeError, match="policy=8: pass st.AutoPolicy"):
        st.shard_auto(nn.Linear(2, 2), policy=8)
    with pytest.raises(
        ValueError, match=r"Engine\(strategy='auto'\) needs the batch.*st.AutoPolicy\(micro_batch=..., seq_len=...\)"
    ):
        st.Engine(devices=1, accelerator="cpu", strategy="auto")


def test_the_edge_rules_written_once():
    assert precision_name("auto", accelerator="cuda") == "bf16-mixed"
    assert precision_name("auto", accelerator="cpu") == "32-true"
    assert precision_name("fp16", accelerator="cuda") == "fp16"
    assert [offload_setting(f) for f in (0.0, 0.5, 1.0)] == [False, 0.5, True]


def test_offload_setting_with_the_disk_tier(tmp_path):
    disk = str(tmp_path)
    assert offload_setting(0.0, disk_dir=disk) is False  # nothing offloaded: no disk tier either
    assert offload_setting(1.0, disk_dir=disk) == st.CPUOffload(disk_dir=disk)
    assert offload_setting(True, disk_dir=disk) == st.CPUOffload(disk_dir=disk)
