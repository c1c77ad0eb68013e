"""The loss is the mean over the trained tokens of the whole global batch: accumulation 1 vs 4 and world
1 vs 2 give the same gradient as one reference forward over all rows, for rows of unequal length, with
the loss over the full logits and in chunks (train.chunked_loss)."""

import pytest
import torch
import torch.nn.functional as F

from shardtrain.data import DataSpec, WindowBatches, prepare
from tests.train.loss_ranks import one_step, uneven_rows_case

pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return uneven_rows_case(tmp_path_factory.mktemp("loss"))


def _reference(folder: str, data: str, cache: str, *, packing: bool) -> tuple[dict, float, float]:
    """(gradients, loss per trained token, the mean of per-micro-batch means) of the step's 8 rows at once."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    spec = DataSpec(path=data, eval_path=data, seq_len=48, packing=packing)
    prepared = prepare(spec, tokenizer=tokenizer, cache_dir=cache, progress=False)
    batch = WindowBatches(
        prepared.train, seq_len=48, pad_id=0, global_batch=8, rank=0, world_size=1, seed=0, shuffle=True
    ).batch(0)
    model = AutoModelForCausalLM.from_pretrained(folder)
    logits = model(batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    per_token = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="none")
    loss = per_token.sum() / (batch["labels"] != -100).sum()
    loss.backward()
    micro = per_token.view(4, -1).sum(1) / (batch["labels"] != -100).view(4, -1).sum(1)
    return {n: p.grad for n, p in model.named_parameters()}, loss.item(), micro.mean().item()


@pytest.mark.parametrize(
    "packing, runs",
    [(False, [(1, 4, False), (2, 1, True), (2, 4, True)]), (True, [(2, 4, True)])],
    ids=["padded", "packed"],
)
def test_accumulation_and_world_size_give_the_reference_gradient(pools, case, packing, runs):
    grads, loss, per_micro_mean = _reference(*case, packing=packing)
    assert abs(per_micro_mean - loss) > 1e-3, "the rows must be unequal enough to tell the two normalisations apart"
    flag = ["--data.packing", str(packing).lower()]
    for world, accum, chunked in runs:  # (world size, micro-batches per step, train.chunked_loss)
        extra = ["--train.grad_accum", str(accum), "--train.chunked_loss", str(chunked).lower(), *flag]
        for got in pools(world).run(one_step, *case, *extra):
            assert got["chunked"] is chunked
            assert got["loss"] == pytest.approx(loss, rel=1e-5), (world, accum, chunked)
            assert set(got["grads"]) == set(grads)
            for name, g in got["grads"].items():
                torch.testing.assert_close(
                    g,
                    grads[name],
                    rtol=1e-4,
                    atol=1e-6,
                    msg=f"{name} at world {world}, accum {accum}, chunked {chunked}",
                )
