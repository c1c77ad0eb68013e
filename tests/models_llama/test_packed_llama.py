"""The built-in Llama on packed rows: each document's logits, loss and gradients are those of the
document run alone, under sdpa's block-diagonal mask and flex_attention's BlockMask, unsharded and
under st.shard (activation checkpointing, compiled blocks) at worlds 1 and 2."""

import pytest
import torch
import torch.distributed as dist

from shardtrain.models.llama import Llama, PackedAttention, document_mask, llama_config
from tests.models_llama.packing import (
    LENGTHS,
    alone_loss,
    packed_loss,
    packed_rows,
    sharded_packed_training,
    spans,
    worst_document_error,
)

TOL = 1e-5


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Llama(llama_config("tiny", n_layers=2))


def test_document_mask_is_causal_within_documents():
    positions = torch.tensor([[0, 1, 2, 0, 1], [1, 2, 0, 0, 1]])  # row 1 starts inside a document
    mask = document_mask(positions, PackedAttention.MASK)
    doc = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 2, 2]])
    i = torch.arange(5)
    expected = (doc[:, :, None] == doc[:, None, :]) & (i[None, :] <= i[:, None])
    assert mask.shape == (2, 1, 5, 5) and torch.equal(mask[:, 0], expected)


def test_each_packed_document_matches_the_document_alone(model):
    ids, positions, docs = packed_rows(LENGTHS, vocab=256, seed=1)
    assert worst_document_error(model, ids, positions, docs) < TOL


def test_loss_and_gradients_match_the_documents_alone(model):
    ids, positions, docs = packed_rows(LENGTHS, vocab=256, seed=2)
    loss = packed_loss(model(ids, position_ids=positions), ids, positions)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    ref = alone_loss(model, [d for row in docs for d in row])
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    torch.testing.assert_close(loss, ref, rtol=0, atol=TOL)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=TOL)


def test_flex_attention_matches_the_documents_alone(model):
    """flex's eager form on the CPU (forward only: it has no CPU backward); CUDA compiles it."""
    ids, positions, docs = packed_rows(LENGTHS, vocab=256, seed=3)
    model.packed_attention = PackedAttention.FLEX
    try:
        with torch.no_grad():
            assert worst_document_error(model, ids, positions, docs) < TOL
    finally:
        model.packed_attention = None


def test_changing_one_document_changes_no_other(model):
    ids, positions, docs = packed_rows(LENGTHS, vocab=256, seed=4)
    before = model(ids, position_ids=positions)
    changed = ids.clone()
    middle = spans(docs[0])[1]
    changed[0, middle] = (changed[0, middle] + 1) % 256
    after = model(changed, position_ids=positions)
    outside = torch.ones_like(ids, dtype=torch.bool)
    outside[0, middle] = False
    assert torch.equal(before[outside], after[outside])
    assert not torch.allclose(before[0, middle], after[0, middle])


def test_one_document_per_row_is_the_plain_causal_forward(model):
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(12).expand(2, 12)
    torch.testing.assert_close(model(ids, position_ids=positions), model(ids), rtol=0, atol=TOL)


def test_position_ids_of_another_shape_are_refused(model):
    with pytest.raises(ValueError, match=r"position_ids of shape \(2, 5\) for tokens of shape \(2, 6\)"):
        model(torch.zeros(2, 6, dtype=torch.long), position_ids=torch.zeros(2, 5, dtype=torch.long))


@pytest.mark.parametrize("world", [1, 2])
def test_sharded_packed_training_matches_the_documents_alone(pools, world):
    for r in pools(world).run(sharded_packed_training, "llama"):
        assert r["loss"] < TOL and r["weights"] < TOL, r


def test_compiled_blocks_train_packed_rows_like_the_documents_alone(pools):
    for r in pools(2).run(sharded_packed_training, "llama", compiled=True):
        assert r["loss"] < TOL and r["weights"] < TOL, r


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_flex_on_cuda_trains_like_the_documents_alone(compiled):
    """On CUDA packed rows take compiled flex_attention by default; with the blocks compiled too
    (inductor), the loss and gradients are still those of the documents run alone."""
    torch.manual_seed(0)
    model = Llama(llama_config("tiny", n_layers=2)).cuda()
    if compiled:
        for block in model.layers:
            block.compile()
    ids, positions, docs = packed_rows(LENGTHS, vocab=256, seed=7)
    ids, positions = ids.cuda(), positions.cuda()
    docs = [d.cuda() for row in docs for d in row]
    assert PackedAttention.for_device(ids.device) is PackedAttention.FLEX
    loss = packed_loss(model(ids, position_ids=positions), ids, positions)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    ref = alone_loss(model, docs)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-4)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
def test_sharded_checkpointed_compiled_flex_on_cuda_trains_like_the_documents_alone(tmp_path):
    """One rank on NCCL: st.shard, activation checkpointing and inductor-compiled blocks around flex."""
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        for compiled in (False, True):
            r = sharded_packed_training("llama", compiled=compiled)
            assert r["loss"] < 1e-4 and r["weights"] < 1e-4, (compiled, r)
    finally:
        dist.destroy_process_group()
