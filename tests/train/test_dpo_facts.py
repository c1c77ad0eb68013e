"""Issue 47's acceptance 2 on 2 CPU ranks: a tiny Llama tuned (SFT) on the 48 facts, then DPO on pairs that
prefer one phrasing of each answer ("The capital is X.") over another ("X is the capital.").

The held-out pairs' preference accuracy must pass 0.9 and the model must still give the answer to at least
85% of the 144 questions (in either phrasing). `python -m pytest -s` prints both numbers.
"""

import json

import pytest

from tests.train.facts import accuracy, chat_rows, llama_folder, preference_rows, write_jsonl
from tests.train.test_cli import _train_on

pytest.importorskip("datasets")

COMMON = ["--data.seq_len", "64", "--train.batch_size", "16", "--optim.weight_decay", "0", "--run.progress", "false"]


@pytest.mark.slow  # SFT 200 steps, DPO 60 steps, 288 generations: about two minutes on 2 cores
def test_dpo_after_sft_prefers_the_chosen_phrasing_and_still_answers(pools, tmp_path):
    base = llama_folder(tmp_path / "llama")
    runs = tmp_path / "runs"
    rows = write_jsonl(chat_rows(), tmp_path / "chat.jsonl")
    sft = ["--model.pretrained", str(base), "--data.path", str(rows), "--train.steps", "200"]
    run = ["--run.out_dir", str(runs), "--run.export_hf", "true", "--data.cache_dir", str(tmp_path / "cache")]
    _train_on(pools(2), [*sft, *COMMON, *run, "--run.name", "sft", "--optim.warmup_steps", "10"])
    tuned = runs / "sft" / "hf"
    before = accuracy(tuned, chat=True)

    pairs = write_jsonl(preference_rows(), tmp_path / "pairs.jsonl")
    dpo = ["--model.pretrained", str(tuned), "--data.path", str(pairs), "--train.objective", "dpo"]
    dpo += ["--dpo.beta", "0.1", "--data.val_fraction", "0.25", "--train.steps", "60", "--train.eval_every", "60"]
    dpo += ["--optim.lr", "3e-4", "--optim.warmup_steps", "5", "--train.log_every", "10"]
    out = _train_on(pools(2), [*dpo, *COMMON, *run, "--run.name", "dpo"])
    records = [json.loads(line) for line in (runs / "dpo" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    trains = [r for r in records if r["kind"] == "train"]
    answered = accuracy(runs / "dpo" / "hf", chat=True, within=True)
    held_out = evals[-1]["eval_rewards/accuracies"]
    print(
        f"SFT answers {before:.1%}; DPO held-out preference accuracy {evals[0]['eval_rewards/accuracies']:.3f} -> "
        f"{held_out:.3f} (margin {evals[-1]['eval_rewards/margins']:.3f}), answers after DPO {answered:.1%}"
    )
    assert "36 held out" in " ".join(out.split()) or "preference pairs" in out
    assert {"rewards/chosen", "rewards/margins", "rewards/accuracies", "logps/rejected"} <= set(trains[-1])
    assert evals[0]["eval_rewards/margins"] == 0.0  # the reference is the SFT model itself
    assert held_out > 0.9
    assert answered >= 0.85
