import json

import pytest
import torch

from shardtrain.train.metrics import MetricsLog, Summary, format_bytes, model_state_bytes, plot_metrics

RECORDS = [
    {"kind": "eval", "step": 0, "eval_loss": 5.5, "eval_loss_ema": 5.6, "elapsed_s": 0.1},
    {
        "kind": "train",
        "step": 1,
        "loss": 5.0,
        "lr": 1e-3,
        "grad_norm": None,
        "tokens_per_s": 100.0,
        "memory_bytes": [1000, 1200],
    },
    {
        "kind": "train",
        "step": 2,
        "loss": 4.0,
        "lr": 1e-3,
        "grad_norm": 1.5,
        "tokens_per_s": 120.0,
        "memory_bytes": [1000, 1200],
    },
    {"kind": "eval", "step": 2, "eval_loss": 3.3, "eval_loss_ema": 3.9, "elapsed_s": 0.3},
]


def test_jsonl_and_plot(tmp_path):
    log = MetricsLog(tmp_path)
    for r in RECORDS:
        log.write(r)
    log.close()
    assert [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == RECORDS
    plot_metrics(log.records, tmp_path / "m.png", memory_label="model state per rank (CPU)")
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


def test_model_state_bytes_counts_params_grads_and_optimizer_state():
    model = torch.nn.Linear(10, 10)  # 110 params
    opt = torch.optim.AdamW(model.parameters())
    assert model_state_bytes(model, opt) == 110 * 4
    model(torch.ones(1, 10)).sum().backward()
    opt.step()
    assert model_state_bytes(model, opt) == 110 * 4 * 4 + 2 * 4  # params, grads, two moments, two steps


def test_summary_drop_and_table():
    s = Summary(
        run_dir="runs/x",
        model="m",
        world="2 x cpu",
        steps=2,
        tokens=10,
        wall_s=1.0,
        tokens_per_s=5.0,
        first_eval_loss=5.0,
        final_eval_loss=2.0,
        memory_per_rank=[2048, 2048],
        memory_label="mem",
    )
    assert s.eval_loss_drop == pytest.approx(0.6)
    assert s.table().row_count == 9
    assert format_bytes(512) == "512 B" and format_bytes(3 * 2**20) == "3.0 MB"
