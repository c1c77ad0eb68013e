"""The optimizer sees every parameter as on the unsharded model; frozen parameters cost no gradient.

Weight-decay groups chosen by `p.dim()` (nanoGPT, timm) are exercised by the whole parity matrix
(tests/core/parity.py builds every optimizer that way); here: shapes, names and counts of built-in
and Hugging Face models, PEFT LoRA's memory and traffic, and units that mix dtypes.
"""

import pytest
import torch

from tests.core import shapes


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", ["llama", "tied_llama", "hf_llama", "hf_llama_tied", "hf_gpt2"])
def test_parameters_keep_their_shapes_names_and_counts(pools, world, kind):
    for strategy in ["full_shard", "shard_grad_op", "no_shard"] if world == 2 else ["full_shard"]:
        for r in pools(world).run(shapes.optimizer_view, kind, strategy):
            assert r["problems"] == [], (kind, strategy, r["problems"])
            assert r["count"] and r["names"] and r["state_dict_global"] and r["full_tensor_equal"], (kind, strategy, r)


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "no_shard"])
def test_lora_trains_like_one_process_and_the_frozen_base_costs_no_gradient(pools, strategy):
    for r in pools(2).run(shapes.lora_training, strategy):
        assert r["frozen_none"]
        torch.testing.assert_close(r["losses"], r["ref_losses"], rtol=1e-5, atol=1e-6)
        assert r["worst"] < 1e-5, r["worst"]
        share = 1 if strategy == "no_shard" else r["world"]
        padding = (r["padded_numel"] - r["trainable_bytes"] // 4) * 4 // share
        assert r["grad_bytes"] <= 1.1 * r["trainable_bytes"] / share + padding, r
        # every element that crosses the wire is a trainable parameter's gradient (its rows padded)
        assert r["reduced_per_step"] == [r["padded_numel"]] * 3, r
        assert r["padded_numel"] < 0.1 * r["total_numel"]


@pytest.mark.parametrize("world", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_unit_mixing_a_frozen_bf16_base_and_fp32_parameters_trains_like_one_process(pools, world):
    for strategy in ["full_shard", "shard_grad_op", "no_shard"]:
        for r in pools(world).run(shapes.mixed_dtype_training, strategy):
            assert r["worst"] < 1e-5 and r["worst_loss"] < 1e-5, (strategy, r)
            assert r["base_dtype"] == torch.bfloat16 and r["adapter_dtype"] == torch.float32
            assert r["groups"] == 2  # bf16 and fp32 parameters in one unit, in two flat buffers


def test_an_optimizer_built_before_st_shard_is_repointed(pools):
    for r in pools(2).run(shapes.optimizer_built_before_shard):
        assert r["rebound"] and r["foreign_untouched"], r
        assert r["changed"] == r["total"], r  # every parameter moved (it was 0 of 8 before)
