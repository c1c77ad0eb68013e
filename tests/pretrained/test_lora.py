"""LoRA through peft on a meta-built model: peft's initialisation, adapter-only training, exact resume,
and the export (adapters in peft's format, or merged as merge_and_unload merges them)."""

import json

import pytest
import torch

from tests.pretrained import load_export_ranks

pytest.importorskip("peft")


@pytest.mark.parametrize("strategy", ["full_shard", "no_shard"])
def test_adapters_start_as_peft_initialises_them_and_only_they_train(pools, hf_folders, strategy):
    for r in pools(2).run(load_export_ranks.lora_initial, str(hf_folders["llama_tied"]), strategy):
        assert r["a_count"] == 4 and r["b_zero"] and r["a_within"]  # A Kaiming-uniform, B zeros
        assert r["diff"] <= 1e-6  # so the adapted model starts equal to its base
        assert r["optimizer"] == r["trainable"] == 8 and r["frozen_with_grad"] == []
        assert r["grad_storage"] == r["trainable_rows"]  # the frozen base has no gradient storage


@pytest.mark.parametrize(
    "world,strategy",
    [
        (2, "full_shard"),
        (2, "no_shard"),
        pytest.param(3, "full_shard", marks=pytest.mark.slow),
        pytest.param(3, "shard_grad_op", marks=pytest.mark.slow),
    ],
)
def test_adapter_only_checkpoint_resumes_bit_for_bit_on_every_rank(pools, hf_folders, tmp_path, world, strategy):
    checkpoint = tmp_path / "step_3"
    results = pools(world).run(
        load_export_ranks.lora_resume, str(hf_folders["llama_untied"]), str(checkpoint), strategy
    )
    for rank, r in enumerate(results):
        assert r["exact"], rank
        assert r["resumed"] == r["straight"], rank
        # Loading it as a whole model is refused, naming the fix.
        assert r["refused"] == (
            "the checkpoint holds only the trainable parameters of state['model'] (saved with "
            "params='trainable'); load the others first (e.g. st.load_pretrained from the "
            "pretrained folder) and pass params='trainable' to load_checkpoint"
        )
    if strategy != "no_shard":  # every rank holds rows of every adapter matrix, so each rank's rows were kept
        assert all(all(shape[0] > 0 for shape in r["rows"].values()) for r in results)
    metadata = json.loads((checkpoint / "metadata.json").read_text())
    saved = [p["fqn"] for p in metadata["modules"]["model"]["params"]]
    assert metadata["modules"]["model"]["saved"] == "trainable" and len(saved) == 8
    assert all(".lora_A." in name or ".lora_B." in name for name in saved)


@pytest.mark.parametrize(
    "kind,targets,adapted",
    [
        ("llama_tied", ("q_proj", "v_proj"), "model.layers.{i}.self_attn.{t}.weight"),
        ("gpt2", ("c_attn",), "transformer.h.{i}.attn.{t}.weight"),  # Conv1D: fan_in_fan_out, B @ A transposed
    ],
)
def test_merged_export_equals_merge_and_unload_and_adapter_export_loads_in_peft(
    pools, hf_folders, tmp_path, kind, targets, adapted
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder = hf_folders[kind]
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    state = pools(2).run(load_export_ranks.lora_export, str(folder), str(merged), str(adapter), "full_shard", targets)[
        0
    ]
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), adapter)
    trained = {k: v for k, v in state.items() if ".lora_" in k}
    loaded = {k: v for k, v in peft_model.state_dict().items() if ".lora_" in k}
    assert set(loaded) == set(trained) and all(torch.equal(loaded[k], trained[k]) for k in trained)
    expected = peft_model.merge_and_unload().state_dict()
    got = AutoModelForCausalLM.from_pretrained(merged).state_dict()
    assert set(got) == set(expected)
    assert max((got[k] - expected[k]).abs().max().item() for k in got) <= 1e-6
    base = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert {k for k in base if not torch.equal(got[k], base[k])} == {
        adapted.format(i=i, t=t) for i in range(2) for t in targets
    }
