"""TRL's DPOTrainer with the shardtrain mixin against the same script under DDP (2 CPU ranks, fp32)."""

import pytest

pytest.importorskip("trl")
pytest.importorskip("peft")

from tests.integrations.runs import run_script

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One launch: per mode, 10 DPO steps (batch 2 x 2 ranks, accumulation 2) under DDP, then under the mixin."""
    return run_script("dpo_run.py", str(tmp_path_factory.mktemp("dpo")), torchrun=True, timeout=600)


@pytest.mark.parametrize("mode", ["full", "lora", "precompute", "lora_precompute"])
def test_dpo_trainer_with_the_mixin_matches_ddp(runs, mode):
    ddp, sharded = runs[mode]["ddp"], runs[mode]["sharded"]
    assert sharded["sharded"] and not ddp["sharded"]
    assert len(sharded["losses"]) == 10
    assert sharded["losses"] == pytest.approx(ddp["losses"], rel=1e-4)
    assert sharded["margins"] == pytest.approx(ddp["margins"], rel=1e-3, abs=1e-6)
    # the reference is the initial policy: rewards start at 0 and the loss at log 2; training separates them
    assert sharded["losses"][0] == pytest.approx(0.693147, abs=1e-5) and sharded["margins"][0] == 0.0
    assert sharded["losses"][-1] < sharded["losses"][0] - 0.05 and sharded["accuracies"][-1] == 1.0


def test_precomputed_reference_equals_the_live_one(runs):
    """The reference log-probabilities precomputed once (through the sharded model, fingerprinted by
    _trl_hash) give the losses the live reference gives, full fine-tuning and LoRA."""
    for live, precomputed in (("full", "precompute"), ("lora", "lora_precompute")):
        assert runs[precomputed]["sharded"]["losses"] == pytest.approx(runs[live]["sharded"]["losses"], rel=1e-5)
