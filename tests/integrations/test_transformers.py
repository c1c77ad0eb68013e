"""ShardtrainTrainer against transformers.Trainer with DDP (2 CPU ranks under torchrun, fp32)."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")

from tests.integrations.runs import run_script


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    """One launch: 10 steps (accumulation 2, clipping) under DDP and under ShardtrainTrainer with the
    documents' `fsdp="full_shard auto_wrap"`; evaluate, save_model, generate; then resume from
    checkpoint-5 with transformers 5's `fsdp=True` + fsdp_config spelling; then a run with
    load_best_model_at_end=True."""
    return run_script("hf_run.py", str(tmp_path_factory.mktemp("hf")), torchrun=True)


def test_trainer_matches_ddp_saves_generates_and_resumes(parity):
    r = parity
    assert len(r["losses"]) == 10
    assert r["accumulating_reduces"] == [0] * 10  # no gradient exchange on accumulating micro-batches
    assert len(r["syncing_reduces"]) == 10 and min(r["syncing_reduces"]) >= 3
    assert r["losses"] == pytest.approx(r["ddp_losses"], abs=1e-5)
    assert r["grad_norms"] == pytest.approx(r["ddp_grad_norms"], abs=1e-5)
    assert min(r["grad_norms"]) > 0.5  # max_grad_norm=0.5 clipped every step
    assert r["eval"] == pytest.approx(r["ddp_eval"], abs=1e-5)
    assert r["generated"] == r["ddp_generated"]
    assert r["saved_names_match"] and r["saved_max_diff"] < 1e-5
    assert r["tokenizer_round_trip"]
    assert {"model.safetensors", "config.json", "tokenizer.json", "shardtrain"} <= set(r["checkpoint_files"])
    assert r["resumed_losses"] == pytest.approx(r["losses"][5:], abs=1e-6)


def test_load_best_model_at_end_loads_the_best_checkpoints_weights(parity):
    r = parity["best_model"]
    evals = {int(step): loss for step, loss in r["evals"].items()}
    assert sorted(evals) == [2, 4, 6]
    best_step = max(evals, key=evals.get)  # greater_is_better=True on eval_loss
    assert best_step != 6  # the last step's weights are not the best: loading them must change the model
    assert r["best_checkpoint"] == f"checkpoint-{best_step}"
    assert r["best_metric"] == evals[best_step]
    distances = {int(step): d for step, d in r["diff_to_checkpoint"].items()}
    assert distances[best_step] == 0.0  # the best step's weights, exactly
    assert distances[6] > 1e-3
    assert r["eval_after_load"] == pytest.approx(evals[best_step], abs=1e-6)


@pytest.mark.slow
def test_trl_sft_trainer_with_the_mixin_trains(tmp_path):
    pytest.importorskip("trl")
    r = run_script("hf_run.py", str(tmp_path), "--mode", "sft", torchrun=True)
    assert r["sharded"]
    assert len(r["losses"]) == 4 and all(0 < loss < 10 for loss in r["losses"])


@pytest.mark.slow
def test_one_process_meta_model_loaded_after_sharding(tmp_path):
    r = run_script("hf_run.py", str(tmp_path), "--mode", "single")
    assert r["world"] == 1
    assert r["dtypes"] == ["torch.float32"] and r["mixed_precision"] == "bf16"  # bf16=True: fp32 masters
    assert r["loaded_diff"] == 0.0
    assert r["saved_diff"] == 0.0
    assert len(r["losses"]) == 3 and all(0 < loss < 10 for loss in r["losses"])
