"""QLoRA on 2 CPU ranks: LoRA over a 4-bit (NF4) base sharded like any frozen parameter, against a
single-process reference of the same quantised model built without shardtrain; no rank holds a whole
packed weight; exact resume; the merged export reloads with from_pretrained."""

import pytest
import torch

from tests.pretrained import load_export_ranks as ranks
from tests.pretrained import qlora_ranks

pytest.importorskip("peft")
pytest.importorskip("torchao")


@pytest.mark.parametrize("targets", [("q_proj", "v_proj"), ("all-linear",)])
def test_adapters_gradients_and_losses_equal_the_single_process_quantised_model(pools, hf_folders, targets):
    results = pools(2).run(qlora_ranks.against_reference, str(hf_folders["llama_untied"]), 4, targets)
    r = results[0]
    assert r["adapters"] == (8 if targets == ("q_proj", "v_proj") else 28)
    assert r["grad_scale"] > 1e-4  # the adapters do get gradients (B starts at zero, A does not)
    assert r["grad_diff"] <= 1e-5 * max(1.0, r["grad_scale"])
    assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) <= 1e-5
    assert r["losses"][-1] < r["losses"][0]  # it trains
    assert r["param_diff"] <= 1e-5
    assert results[1]["losses"] == r["losses"]


def test_no_rank_holds_a_whole_packed_weight(pools, hf_folders):
    for r in pools(2).run(qlora_ranks.held_storage, str(hf_folders["llama_untied"])):
        assert r["rows"] and all(held <= -(-whole // 2) for held, whole in r["rows"].values())
        packed = [rows for name, rows in r["rows"].items() if name.endswith("weight_nf4")]
        assert len(packed) == 14 and all(0 < held < whole for held, whole in packed)
        assert r["held_bytes"] <= r["whole_bytes"] // 2 + 64  # half, up to a padding row per tensor
        assert r["gathered_bytes"] == 0


def test_adapter_only_checkpoint_resumes_bit_for_bit(pools, hf_folders, tmp_path):
    checkpoint = tmp_path / "step_3"
    results = pools(2).run(ranks.lora_resume, str(hf_folders["llama_untied"]), str(checkpoint), "full_shard", 4)
    for rank, r in enumerate(results):
        assert r["exact"], rank
        assert r["resumed"] == r["straight"], rank


def test_merged_export_reloads_with_from_pretrained_and_matches_the_adapted_models_logits(pools, hf_folders, tmp_path):
    from transformers import AutoModelForCausalLM

    folder, out = hf_folders["llama_untied"], tmp_path / "merged"
    adapted = pools(2).run(qlora_ranks.merged_export, str(folder), str(out))[0]["logits"]
    merged = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(folder)
    assert set(merged.state_dict()) == set(base.state_dict())  # plain names, no peft or NF4 components
    assert (ranks.logits(merged) - adapted).abs().max().item() <= 1e-5
    assert (ranks.logits(base) - adapted).abs().max().item() > 1e-3  # quantised and trained: not the base


def test_every_frozen_linear_but_the_head_is_quantised_and_the_adapters_are_not():
    from shardtrain.pretrained.lora import apply_lora
    from shardtrain.pretrained.nf4 import NF4Linear
    from shardtrain.pretrained.qlora import quantize_base
    from tests.pretrained.hf_models import config

    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        plain = AutoModelForCausalLM.from_config(config("llama_untied"))
    with pytest.raises(ValueError, match="found no frozen nn.Linear to quantise; apply LoRA first"):
        quantize_base(plain)
    model = apply_lora(plain, rank=4, alpha=8.0, targets=("q_proj",), dropout=0.0)
    assert callable(quantize_base(model))  # the param_init_fn for st.shard
    names = {n for n, m in model.named_modules() if isinstance(m, NF4Linear)}
    assert len(names) == 14  # 7 projections x 2 layers
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer" in names
    assert "base_model.model.model.layers.1.mlp.down_proj" in names
    assert isinstance(model.base_model.model.lm_head, torch.nn.Linear)
    assert all(p.requires_grad == (".lora_" in n) for n, p in model.named_parameters() if ".lora_" in n)
    with pytest.raises(ValueError, match="base_bits=8: use 4"):
        quantize_base(model, bits=8)


def test_quantize_base_returns_the_init_that_draws_the_base_quantised_and_the_adapters_as_peft(pools, hf_folders):
    for r in pools(2).run(qlora_ranks.random_init, str(hf_folders["llama_untied"])):
        assert r["b_zero"] and r["a_drawn"] and r["finite"]
        assert r["codes"] == 14 and r["distinct_codes"] > 100  # packed pairs of 16 levels: drawn, not left empty


def test_a_materialised_model_is_quantised_from_its_own_weights():
    """What a trainer integration shards: a model already holding weights keeps them, quantised."""
    from peft import LoraConfig, get_peft_model
    from torchao.quantization import to_nf4
    from transformers import AutoModelForCausalLM

    from shardtrain.pretrained.qlora import quantize_base
    from tests.pretrained.hf_models import config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config("llama_untied"))
    weight = model.model.layers[1].mlp.down_proj.weight.detach().clone()
    inputs = torch.randint(0, 259, (1, 9))
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
    quantize_base(model)
    layer = model.base_model.model.model.layers[1].mlp.down_proj
    assert torch.equal(layer.dequantized(), to_nf4(weight, 64, 32).get_original_weight())
    assert torch.isfinite(model(inputs).logits).all()


def test_a_whole_checkpoint_holds_the_packed_base_and_loads_it_back(pools, hf_folders, tmp_path):
    for r in pools(2).run(qlora_ranks.whole_checkpoint, str(hf_folders["llama_untied"]), str(tmp_path / "ck")):
        assert r["differed"] and r["exact"]
