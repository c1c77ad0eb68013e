"""Lightning Fabric with ShardtrainStrategy against Fabric's own DDP strategy (2 CPU ranks, fp32)."""

import pytest

pytest.importorskip("lightning")

from tests.integrations.runs import run_script


def test_fabric_guide_loop_matches_ddp_and_resumes(tmp_path):
    """One launch: the guide's loop (meta init, accumulation with no_backward_sync, clipping that
    fires, all_reduce) under DDP and under shardtrain; save at step 3, load into fresh objects. The units
    and recomputed blocks come from torch FSDP policies given as Lightning's FSDPStrategy takes them."""
    r = run_script("fabric_run.py", str(tmp_path))
    assert r["on_meta_per_rank"] == [1, 1]  # init_module(empty_init=True) built nothing
    assert r["held_bytes_per_rank"] == [r["full_bytes"] // 2] * 2  # each rank its half, no full copy
    assert r["broadcast"] == 7
    assert r["reduce_scatters"][0::2] == [0, 0, 0]  # accumulating micro-batches: no gradient exchange
    assert min(r["reduce_scatters"][1::2]) >= 3  # the last of each step: the blocks and the root
    assert len(r["losses"]) == 6
    assert r["losses"] == pytest.approx(r["ddp_losses"], abs=1e-5)
    assert r["norms"] == pytest.approx(r["ddp_norms"], abs=1e-5)
    assert min(r["norms"]) > 0.05  # the clipping fired on every step
    assert r["param_names_match"] and r["max_param_diff"] < 1e-5
    assert r["resumed_step"] == 3
    assert r["resumed_losses"] == pytest.approx(r["losses"][3:], abs=1e-6)
    assert r["layout"] == {"units": ["<root>", "blocks.0", "blocks.1"], "checkpointed": ["blocks.0", "blocks.1"]}


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"wrapp": {object}}, TypeError, r"\['wrapp'\]"),
        ({"mixed_precision": "bf16"}, ValueError, r"mixed_precision=.*precision='bf16-mixed'"),
        ({"state_dict_type": "single"}, ValueError, r"state_dict_type='single'"),
        ({"strategy": "zero9"}, ValueError, r"'zero9'"),
    ],
)
def test_bad_options_fail_when_the_strategy_is_built(kwargs, error, message):
    from shardtrain.integrations.fabric import ShardtrainStrategy

    with pytest.raises(error, match=message):
        ShardtrainStrategy(**kwargs)


def test_the_name_shardtrain_and_precision_names():
    import lightning as L

    from shardtrain.integrations.fabric import ShardtrainMixedPrecision, ShardtrainStrategy

    fabric = L.Fabric(accelerator="cpu", devices=1, strategy="shardtrain", precision="bf16-mixed")
    assert isinstance(fabric.strategy, ShardtrainStrategy)
    assert isinstance(fabric.strategy.precision, ShardtrainMixedPrecision)
    with pytest.raises(ValueError, match=r"precision='64-true'"):
        L.Fabric(accelerator="cpu", devices=1, strategy="shardtrain", precision="64-true")


@pytest.mark.slow
def test_fabric_resumes_in_fresh_processes_then_half_precisions_and_full_checkpoints(tmp_path):
    """A second launch resumes the first's step-3 checkpoint in fresh processes, then (same launch: a
    launch costs seconds) trains the half precisions and round-trips a "full" checkpoint."""
    first = run_script("fabric_run.py", str(tmp_path / "first"))
    r = run_script("fabric_run.py", str(tmp_path / "fresh"), "--resume", str(tmp_path / "first" / "ckpt"), "--more")
    assert r["resumed_step"] == 3
    assert r["resumed_losses"] == pytest.approx(first["losses"][3:], abs=1e-6)
    assert r["bf16-mixed"]["dtypes"] == ["torch.float32"]  # fp32 masters, bf16 compute
    assert r["bf16-true"]["dtypes"] == ["torch.bfloat16"]
    scales = r["16-mixed"]["scales"]
    assert scales[0] == scales[1] and scales[0] <= 2.0**16  # both ranks keep the same loss scale
    for precision in ("bf16-mixed", "bf16-true", "16-mixed"):
        losses = r[precision]["losses"]
        assert all(3.5 < loss < 5 for loss in losses), losses  # ln(64) = 4.16 at the start
        assert losses[0] == pytest.approx(4.28672, abs=0.01)  # the fp32 run's first loss, in half precision
    assert r["full_file_diff"] == 0.0
    assert r["full_reload_diff"] == 0.0
