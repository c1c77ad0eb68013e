"""The Lightning Trainer with ShardtrainStrategy against strategy="ddp" (2 CPU ranks, fp32)."""

import pytest

pytest.importorskip("lightning")

from tests.integrations.runs import run_script


def test_trainer_matches_ddp_and_resumes_from_ckpt_path(tmp_path):
    """One launch: configure_model (on meta under shardtrain), accumulate_grad_batches=2,
    gradient_clip_val=1.0 (firing), self.log, trainer.validate; ModelCheckpoint after epoch 1, then
    a fresh Trainer and module resumed with fit(ckpt_path=...) train epoch 2 identically. Units and
    recomputed blocks come from FSDPStrategy's auto_wrap_policy / activation_checkpointing_policy."""
    r = run_script("lightning_run.py", str(tmp_path))
    assert len(r["losses"]) == 12  # 6 optimizer steps of 2 micro-batches
    assert r["reduce_scatters"][0::2] == [0] * 6  # accumulating micro-batches: no gradient exchange
    assert min(r["reduce_scatters"][1::2]) >= 3  # the last of each step: the blocks and the root
    assert r["losses"] == pytest.approx(r["ddp_losses"], abs=1e-5)
    assert r["norms"] == pytest.approx(r["ddp_norms"], abs=1e-5)
    assert min(r["norms"]) > 1.0  # gradient_clip_val=1.0 clipped every step
    assert r["val"] == pytest.approx(r["ddp_val"], abs=1e-5)
    assert r["param_names_match"] and r["max_param_diff"] < 1e-5
    assert r["resumed_step"] == 6
    assert r["resumed_losses"] == pytest.approx(r["losses"][6:], abs=1e-6)
    blocks = ["model.blocks.0", "model.blocks.1"]
    assert r["layout"] == {"units": ["<root>", *blocks], "checkpointed": blocks}  # from sets of classes
    assert r["resumed_layout"] == r["layout"]  # from ModuleWrapPolicy and a torch policy callable


def test_the_name_shardtrain_and_its_precision_plugins():
    import lightning as L

    from shardtrain.integrations.lightning import ShardtrainStrategy
    from shardtrain.integrations.lightning_precision import ShardtrainHalfPrecision, ShardtrainMixedPrecision

    kinds = {"bf16-mixed": ShardtrainMixedPrecision, "bf16-true": ShardtrainHalfPrecision}
    for name, kind in kinds.items():
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy="shardtrain", precision=name, logger=False)
        assert isinstance(trainer.strategy, ShardtrainStrategy)
        assert isinstance(trainer.strategy.precision_plugin, kind)
    with pytest.raises(ValueError, match=r"precision='64-true'"):
        L.Trainer(accelerator="cpu", devices=1, strategy="shardtrain", precision="64-true", logger=False)
    with pytest.raises(ValueError, match=r"checkpoint_io"):
        ShardtrainStrategy(checkpoint_io=object())
