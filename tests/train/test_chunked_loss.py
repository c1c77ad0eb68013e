"""train.chunked_loss: the step's loss through the output head in chunks gives the loss and gradients of
the full logits' F.cross_entropy, for a transformers model called as usual (its head swapped for the call),
a built-in Llama whose head is a sharding unit of its own (tied too), and peft LoRA, on 2 ranks with 2
micro-batches per step and masked (prompt) labels. tests/train/test_loss_scale.py checks a transformers
model's chunked step against one reference forward over all rows."""

import pytest
import torch
import torch.nn.functional as F

from shardtrain.train.chunked_choice import check_chunked_loss_config
from shardtrain.train.config import load_config
from shardtrain.train.head_loss import head_loss_sum, probe
from tests.pretrained.hf_models import VOCAB, config
from tests.train.loss_ranks import data_args, step_zero, uneven_rows_case

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return uneven_rows_case(tmp_path_factory.mktemp("chunked"))


def _both(pools, args: list[str]) -> tuple[dict, dict]:
    """Rank 0's step 0 with the chunked loss and over the full logits, 2 ranks x 2 micro-batches."""
    runs = []
    for chunked in (True, False):
        got = pools(2).run(step_zero, *args, "--train.grad_accum", "2", "--train.chunked_loss", str(chunked).lower())
        assert [g["chunked"] for g in got] == [chunked, chunked]
        runs.append(got[0])
    return runs[0], runs[1]


def _assert_same_step(chunked: dict, full: dict) -> None:
    assert chunked["loss"] == pytest.approx(full["loss"], rel=1e-6)
    assert set(chunked["grads"]) == set(full["grads"])
    for name, g in chunked["grads"].items():
        want = full["grads"][name]  # fp32 sums in another order: the tolerance follows the gradient's scale
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5 * want.abs().max().item(), msg=name)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_builtin_llama_with_the_head_as_its_own_unit(pools, case, tied):
    folder, data, cache = case
    args = [
        "--model.name",
        "llama-tiny",
        "--model.kwargs",
        f"{{vocab_size: 512, tie_embeddings: {str(tied).lower()}}}",
        "--model.wrap",
        "Block,Embedding,OutputHead" if not tied else "Block",
        "--data.tokenizer",
        folder,
        *data_args(data, cache),
    ]
    _assert_same_step(*_both(pools, args))


def test_peft_lora_adapters(pools, case):
    folder, data, cache = case
    chunked, full = _both(pools, ["--model.pretrained", folder, "--lora.rank", "4", *data_args(data, cache)])
    assert chunked["grads"] and all("lora_" in name for name in chunked["grads"])
    _assert_same_step(chunked, full)


def _tiny_hf(*, tied: bool = False):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(config("llama_tied" if tied else "llama_untied"))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_transformers_model_loss_equals_its_full_logits(tied):
    model = _tiny_hf(tied=tied)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, 1)
    labels[:, -1] = -100
    labels[0, :5] = -100
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]] * 2)  # packed: two documents per row
    got = head_loss_sum(model, ids, labels=labels, position_ids=positions)
    mine = torch.autograd.grad(got, list(model.parameters()))
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    want = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    for g, r in zip(mine, torch.autograd.grad(want, list(model.parameters()))):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6 * r.abs().max().item())  # fp32 sums, other orders


def test_a_model_that_changes_its_logits_after_the_head_is_refused():
    model = _tiny_hf()
    inner = model.forward

    def softcapped(*args, **kwargs):
        out = inner(*args, **kwargs)
        out.logits = torch.tanh(out.logits / 30) * 30
        return out

    model.forward = softcapped
    verdict = probe(model, device=torch.device("cpu"))
    assert verdict.reason == "LlamaForCausalLM changes its logits after the head"
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="pass --train.chunked_loss false"):
        head_loss_sum(model, ids, labels=ids, position_ids=None)


def test_chunked_loss_true_is_refused_under_tensor_parallelism():
    cfg = load_config(None, ["--train.chunked_loss", "true", "--engine.tp", "2"])
    with pytest.raises(ValueError, match="train.chunked_loss=true with engine.tp=2"):
        check_chunked_loss_config(cfg)
    check_chunked_loss_config(load_config(None, ["--engine.tp", "2"]))  # auto: off, silently
