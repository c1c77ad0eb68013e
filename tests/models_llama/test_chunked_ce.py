"""st.chunked_cross_entropy against F.cross_entropy over the full logits: value and the gradients of the
hidden states, the weight and the bias, with masked labels, for chunk sizes that divide the rows and
that do not, and chunks whose labels are all masked."""

import pytest
import torch
import torch.nn.functional as F

import shardtrain as st
from shardtrain.models.chunked_ce import default_chunk_rows

ROWS, DIM, VOCAB = 48, 16, 37


def _case(*, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, ROWS // 2, DIM, generator=gen, dtype=torch.float64).float().requires_grad_()
    weight = torch.randn(VOCAB, DIM, generator=gen).requires_grad_()
    b = torch.randn(VOCAB, generator=gen).requires_grad_() if bias else None
    labels = torch.randint(0, VOCAB, (2, ROWS // 2), generator=gen)
    labels[0, 3:17] = -100  # a run of masked labels: whole chunks of 1 and 7 rows are masked
    labels[1, ::5] = -100
    return hidden, weight, b, labels


def _reference(hidden, weight, bias, labels, reduction):
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction=reduction)


def _grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk_rows", [1, 7, 64, ROWS, None])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_value_and_gradients_equal_the_full_cross_entropy(chunk_rows, bias, reduction):
    hidden, weight, b, labels = _case(bias=bias)
    want = _reference(hidden, weight, b, labels, reduction)
    got = st.chunked_cross_entropy(
        hidden, weight, labels, bias=b, chunk_rows=chunk_rows, reduction=reduction, backend="torch"
    )
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    scale = torch.tensor(0.37)  # the step scales the loss before backward: the stored gradients follow it
    for name, g, r in zip(
        ("hidden", "weight", "bias"),
        _grads(got * scale, (hidden, weight, b)),
        _grads(want * scale, (hidden, weight, b)),
    ):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=name)


def test_masked_rows_get_no_gradient_and_add_no_loss():
    hidden, weight, _, labels = _case(bias=False)
    labels[:] = -100
    loss = st.chunked_cross_entropy(hidden, weight, labels, chunk_rows=7, backend="torch")
    assert loss.item() == 0.0
    (g_hidden, g_weight) = _grads(loss, (hidden, weight))
    assert not g_hidden.any() and not g_weight.any()


def test_frozen_weight_and_bf16_hidden_follow_autograd():
    """LoRA's frozen head: only the hidden states' gradient, computed in the compute dtype like autograd's."""
    hidden, weight, _, labels = _case(bias=False, seed=1)
    hidden = hidden.detach().bfloat16().requires_grad_()
    weight = weight.detach().bfloat16()
    want = _reference(hidden, weight, None, labels, "sum")
    got = st.chunked_cross_entropy(hidden, weight, labels, chunk_rows=7, backend="torch")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(_grads(got, (hidden,))[0], _grads(want, (hidden,))[0], rtol=1.6e-2, atol=1e-3)


def test_accumulates_over_backwards_like_autograd():
    """Two micro-batches' backwards add into .grad as two full cross-entropies would."""
    hidden, weight, _, labels = _case(bias=False)
    ref = weight.detach().clone().requires_grad_()
    for half in (slice(0, 1), slice(1, 2)):
        st.chunked_cross_entropy(hidden[half], weight, labels[half], chunk_rows=5, backend="torch").backward()
        _reference(hidden[half], ref, None, labels[half], "sum").backward()
    torch.testing.assert_close(weight.grad, ref.grad, rtol=1e-5, atol=1e-6)


def test_no_gradients_are_computed_without_grad_mode():
    hidden, weight, _, labels = _case(bias=False)
    with torch.no_grad():
        loss = st.chunked_cross_entropy(hidden, weight, labels, chunk_rows=7, backend="torch")
    assert not loss.requires_grad
    torch.testing.assert_close(loss, _reference(hidden, weight, None, labels, "sum").detach())


def test_default_chunk_holds_about_as_many_logits_as_hidden_elements():
    assert default_chunk_rows(rows=8192, dim=4096, vocab=128256) == 256  # 8192 rows / ceil(31.3)
    assert default_chunk_rows(rows=3, dim=64, vocab=32) == 4


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        ({"reduction": "none"}, "use one of sum, mean"),
        ({"backend": "triton"}, "use one of auto, torch, liger"),
        ({"chunk_rows": 0}, "use 1 or more rows"),
        ({"backend": "liger"}, "pip install 'shardtrain[liger]'"),
    ],
)
def test_bad_arguments_are_refused(kwargs, fix):
    hidden, weight, _, labels = _case(bias=False)
    with pytest.raises(ValueError, match=fix.replace("[", r"\[").replace("]", r"\]")):
        st.chunked_cross_entropy(hidden, weight, labels, **kwargs)


def test_shapes_are_checked():
    hidden, weight, _, labels = _case(bias=False)
    with pytest.raises(ValueError, match="one label per row"):
        st.chunked_cross_entropy(hidden, weight, labels[:, :-1])
    with pytest.raises(ValueError, match="does not project hidden states of width 16"):
        st.chunked_cross_entropy(hidden, weight[:, :-1], labels)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_liger_kernel_equals_the_full_cross_entropy(dtype):
    pytest.importorskip("liger_kernel")
    hidden, weight, _, labels = _case(bias=False)
    hidden = hidden.detach().cuda().to(dtype).requires_grad_()
    weight = weight.detach().cuda().to(dtype).requires_grad_()
    labels = labels.cuda()
    want = _reference(hidden, weight, None, labels, "sum")
    got = st.chunked_cross_entropy(hidden, weight, labels, backend="liger")
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
    for g, r in zip(_grads(got, (hidden, weight)), _grads(want, (hidden, weight))):
        torch.testing.assert_close(g.float(), r.float(), **tol)
