"""QLoRA on 2 CPU ranks: LoRA over a 4-bit (NF4) base sharded like any frozen parameter, against a
single-process reference of the same quantised model built without shardtrain; no rank holds a whole
packed weight; exact resume; the merged export reloads with from_pretrained."""

import pytest

from tests.pretrained import qlora_ranks, ranks

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
