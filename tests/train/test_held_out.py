"""Held-out data of the main job: every row trains unless some are held out, and the held-out loss is
the mean over every held-out trained token, whatever the batch size and world size (a held-out set
smaller than a batch included), equal to one direct forward over those rows."""

import json

import pytest
import torch
import torch.nn.functional as F

from shardtrain.data import DataSpec, prepare
from tests.train.facts import llama_folder, prompt_completion_rows, write_jsonl
from tests.train.held_out_ranks import held_out_loss, train_without_held_out

pytest.importorskip("datasets")
HELD = 9  # held-out rows (one window each, unpacked): fewer than a batch of 16, not a multiple of 4 or 2 x 2


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    root = tmp_path_factory.mktemp("held")
    rows = prompt_completion_rows()
    return (
        str(llama_folder(root / "model", hidden=32, init_range=0.5)),
        str(write_jsonl(rows[:16], root / "train.jsonl")),
        str(write_jsonl(rows[16 : 16 + HELD], root / "held.jsonl")),
        str(root / "cache"),
    )


def _reference(folder: str, data: str, held: str, cache: str, *, windows: int = HELD) -> float:
    """Loss per trained token of the first `windows` held-out windows, each through the model on its own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = DataSpec(path=data, eval_path=held, seq_len=48, packing=False)
    prepared = prepare(spec, tokenizer=AutoTokenizer.from_pretrained(folder), cache_dir=cache, progress=False)
    model = AutoModelForCausalLM.from_pretrained(folder)
    total, count = 0.0, 0
    with torch.no_grad():
        for row in prepared.held_out.select(range(windows)):
            ids, labels = torch.tensor([row["input_ids"]]), torch.tensor(row["labels"])
            logits = model(ids, position_ids=torch.tensor([row["position_ids"]]), use_cache=False).logits[0]
            total += F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
            count += int((labels != -100).sum())
    assert len(prepared.held_out) == HELD
    return total / count


def test_the_held_out_loss_is_the_same_for_every_batch_and_world_size(pools, case):
    loss = _reference(*case)
    for world in (1, 2):
        for batch in (4, 16):  # 16: the held-out set is smaller than one batch
            got = pools(world).run(held_out_loss, *case, "--train.batch_size", str(batch))
            batches = -(-HELD // batch)
            for r in got:
                assert r["read"] == list(range(batches)), (world, batch)  # every rank runs the same forwards
                assert r["loss"] == pytest.approx(loss, rel=1e-5, abs=0), (world, batch)


def test_eval_batches_bounds_the_evaluation(pools, case):
    loss = _reference(*case, windows=4)
    for r in pools(2).run(held_out_loss, *case, "--train.batch_size", "4", "--train.eval_batches", "1"):
        assert r["read"] == [0] and r["loss"] == pytest.approx(loss, rel=1e-5, abs=0)


def test_val_fraction_0_trains_every_row_and_skips_evaluation_saying_so_once(pools, case, tmp_path):
    folder, data, _, cache = case
    ranks = pools(2).run(train_without_held_out, folder, data, cache, str(tmp_path))
    notice = "note: data.val_fraction is 0 and there is no data.eval_path: training on all the data, no evaluation"
    assert ranks[0]["stdout"].count(notice) == 1 and notice not in ranks[1]["stdout"]
    for r in ranks:
        assert r["held_out"] is None and r["eval_loss"] is None
        assert "none: nothing held out (data.val_fraction 0)" in r["table"]
        assert r["train_rows"] == r["stats_rows"] == 16  # one window per row, unpacked: every row trains
    records = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["train", "summary"]  # no eval record, though eval_every is 1
    assert records[-1]["eval_loss_drop"] is None
