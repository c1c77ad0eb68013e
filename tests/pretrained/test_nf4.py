"""The NF4 layer against torchao: the same bits, the same dequantised weight, the same products."""

import math

import pytest
import torch
from torch import nn

from shardtrain.pretrained.nf4 import NF4Linear, quantizable

torchao = pytest.importorskip("torchao")


def _layer(out_features: int, in_features: int, dtype: torch.dtype) -> tuple[nn.Linear, NF4Linear]:
    torch.manual_seed(out_features + in_features)
    linear = nn.Linear(in_features, out_features, bias=True, dtype=dtype)
    nf4 = NF4Linear.replacing(linear)
    with torch.no_grad():
        for name, value in nf4.quantize_from(linear.weight).items():
            getattr(nf4, name).copy_(value)
    return linear, nf4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(128, 128), (32, 64), (96, 64), (256, 512)])
def test_dequantised_weight_is_torchaos_bit_for_bit(shape, dtype):
    from torchao.quantization import to_nf4

    linear, nf4 = _layer(*shape, dtype)
    blocks = linear.weight.numel() // 64
    assert nf4.scaler_block_size == min(256, blocks & -blocks)
    reference = to_nf4(linear.weight.detach(), 64, nf4.scaler_block_size)
    assert torch.equal(nf4.weight_nf4.flatten(), reference.quantized_data)
    assert torch.equal(nf4.weight_scalers, reference.quantized_scalers)
    assert torch.equal(nf4.dequantized(), reference.get_original_weight())
    assert (nf4.dequantized().float() - linear.weight.float()).abs().max() < 0.2 * linear.weight.abs().max()


def test_forward_and_input_gradient_are_those_of_the_dequantised_linear():
    linear, nf4 = _layer(96, 64, torch.float32)
    weight = nf4.dequantized()
    x = torch.randn(3, 5, 64, requires_grad=True)
    y = nf4(x)
    expected = nn.functional.linear(x, weight, linear.bias)
    assert torch.allclose(y, expected, atol=1e-6)
    g = torch.randn_like(y)
    (grad,) = torch.autograd.grad(y, x, g)
    assert torch.allclose(grad, g @ weight, atol=1e-6)
    assert not any(p.requires_grad for p in nf4.parameters())


def test_built_on_meta_it_initialises_quantised_as_nn_linear_draws():
    with torch.device("meta"):
        nf4 = NF4Linear.replacing(nn.Linear(256, 64, dtype=torch.bfloat16))
    nf4 = nf4.to_empty(device="cpu")
    nf4.reset_parameters()
    weight = nf4.dequantized()
    bound = 1 / math.sqrt(256)  # Kaiming-uniform with a = sqrt(5), as nn.Linear
    assert weight.dtype == torch.bfloat16 and weight.abs().max() <= bound * 1.01
    assert weight.float().std() > bound / 3


def test_only_linear_layers_of_whole_blocks_are_quantised():
    assert quantizable(nn.Linear(64, 3)) and not quantizable(nn.Linear(7, 9)) and not quantizable(nn.Conv1d(4, 4, 1))


@pytest.mark.gpu
def test_on_cuda_eager_and_compiled_dequantisation_equal_torchaos():
    """On the GPU: the eager path bit for bit, the compiled one (nf4.compile_dequantize) within a bf16
    rounding of the scales, and both through a forward and backward."""
    from torchao.quantization import to_nf4

    from shardtrain.pretrained import nf4 as module

    linear, layer = _layer(512, 1024, torch.bfloat16)
    layer = layer.cuda()
    reference = to_nf4(linear.weight.detach().cuda(), 64, 256).get_original_weight()
    assert torch.equal(layer.dequantized(), reference)
    x = torch.randn(4, 1024, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    eager = layer(x)
    module.compile_dequantize()
    try:
        compiled = layer(x)
        compiled.sum().backward()
        weight = module._dequantizer()(*layer.components(), shape=(512, 1024))
    finally:
        module.compile_dequantize(False)
    assert torch.allclose(weight.float(), reference.float(), rtol=1e-2, atol=1e-3)
    assert torch.allclose(compiled.float(), eager.float(), rtol=2e-2, atol=2e-2)
    assert torch.allclose(x.grad.float(), reference.float().sum(0).expand(4, -1), rtol=2e-2, atol=2e-2)
