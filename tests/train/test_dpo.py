"""The main job's DPO step (2 ranks, accumulation 2) against the paper's formula in one process, at fp32.

The reference below is written from Rafailov et al. (2023) on the Hugging Face model itself (peft's model
for LoRA): the summed log-probability of each answer's tokens, the reference's the same with the adapters
disabled (LoRA) or of an untouched copy (full fine-tuning), and the mean of -log sigmoid(beta * (the
chosen log-ratio - the rejected one)) over the step's 8 pairs; for --dpo.loss ipo, Azar et al.'s (2023) squared
loss on the per-token log-ratios. One step of plain SGD at lr 1 moves each
trained weight by minus its gradient, which must equal the reference's.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.train.dpo_ranks import dpo_step
from tests.train.facts import llama_folder, preference_rows, write_jsonl

pytest.importorskip("peft")
pytest.importorskip("datasets")

BETA = 0.1
STEP = ["--train.batch_size", "8", "--train.grad_accum", "2", "--dpo.beta", str(BETA), "--data.val_fraction", "0.25"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo")
    return llama_folder(tmp / "model", hidden=32), write_jsonl(preference_rows()[:24], tmp / "pairs.jsonl"), tmp


def _answer_logps(model, batch, *, per_token: bool = False) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"]).logits
    scored = batch["labels"] != -100
    logp = torch.log_softmax(logits, -1).gather(-1, batch["labels"].clamp(min=0)[..., None])[..., 0]
    return (logp * scored).sum(-1) / (scored.sum(-1) if per_token else 1)


def _paper_loss(policy, reference_logps, batches, *, ipo: bool) -> torch.Tensor:
    """DPO's -log sigmoid(beta h), or IPO's (h - 1 / (2 beta))^2 with h of the mean per-token log-probabilities
    (Azar et al., 2023, eq. 17, as TRL's loss_type="ipo")."""
    losses = []
    for batch in batches:
        n = batch["pair"].numel()
        pi = _answer_logps(policy, batch, per_token=ipo)
        with torch.no_grad():
            ref = reference_logps(batch, per_token=ipo)
        h = (pi[:n] - ref[:n]) - (pi[n:] - ref[n:])
        losses.append((h - 1 / (2 * BETA)) ** 2 if ipo else -F.logsigmoid(BETA * h))
    return torch.cat(losses).mean()


def _reference_step(folder, results, *, lora: bool, ipo: bool = False):
    """(loss, {name: gradient}) of the step's pairs (every rank's micro-batches) by the paper's formula."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if lora:
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    weights = results[0]["before"]
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert set(trained) == set(weights)
    with torch.no_grad():
        for name, p in trained.items():
            p.copy_(weights[name])
    if lora:

        def reference_logps(batch, *, per_token):
            with model.disable_adapter():
                return _answer_logps(model, batch, per_token=per_token)
    else:
        frozen = copy.deepcopy(model).eval()

        def reference_logps(batch, *, per_token):
            return _answer_logps(frozen, batch, per_token=per_token)

    batches = [b for r in results for b in r["batches"]]
    loss = _paper_loss(model, reference_logps, batches, ipo=ipo)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in trained.items()}


@pytest.mark.parametrize(("lora", "ipo"), [(False, False), (True, False), (True, True)], ids=["full", "lora", "ipo"])
def test_dpo_step_equals_the_papers_formula(pools, setup, lora, ipo):
    folder, data, tmp = setup
    extra = (["--lora.rank", "4"] if lora else []) + (["--dpo.loss", "ipo"] if ipo else [])
    results = pools(2).run(dpo_step, str(folder), str(data), str(tmp / "cache"), *STEP, *extra)
    loss, grads = _reference_step(folder, results, lora=lora, ipo=ipo)
    r = results[0]
    assert r["loss"] == pytest.approx(loss, rel=1e-5)
    # the reference is the starting policy: log 2, or IPO's (1 / (2 beta))^2
    assert loss == pytest.approx(25.0 if ipo else 0.693147, abs=1e-5)
    moved = 0
    for name, grad in grads.items():
        step = r["before"][name] - r["after"][name]  # SGD at lr 1: the gradient
        torch.testing.assert_close(step, grad, rtol=1e-4, atol=1e-6, msg=name)
        moved += int(grad.abs().max() > 0)
    assert moved >= len(grads) // 2  # not a vacuous comparison of zeros (LoRA's A starts with zero gradient)
    assert r["metrics"]["rewards/margins"] == 0.0 and r["metrics"]["logps/chosen"] < 0
    assert r["eval"]["eval_rewards/margins"] > 0  # after the step the held-out chosen answers gain on the rejected


def test_precomputed_reference_equals_the_live_one(pools, setup):
    """dpo.precompute_ref: the tables hold the frozen copy's log-probabilities; the step and evaluation equal
    the live reference's; a second run reads the cache."""
    folder, data, tmp = setup
    run = pools(2).run
    live = run(dpo_step, str(folder), str(data), str(tmp / "cache"), *STEP)[0]
    pre = run(dpo_step, str(folder), str(data), str(tmp / "cache"), *STEP, "--dpo.precompute_ref", "true")[0]
    for name, weight in live["after"].items():
        torch.testing.assert_close(pre["after"][name], weight, rtol=0, atol=1e-6)
    assert pre["eval"]["eval_loss"] == pytest.approx(live["eval"]["eval_loss"], rel=1e-6)
    table = pre["precomputed"]
    for batch in live["batches"]:
        n = batch["pair"].numel()
        assert table.shape[1] == 2 and (table[batch["pair"]] < 0).all()
        assert len(set(batch["pair"].tolist())) == n
    again = run(dpo_step, str(folder), str(data), str(tmp / "cache"), *STEP, "--dpo.precompute_ref", "true")[0]
    torch.testing.assert_close(again["precomputed"], table, rtol=0, atol=0)
