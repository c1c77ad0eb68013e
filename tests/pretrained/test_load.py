"""st.load_pretrained against transformers' from_pretrained: same weights, same logits, rows read per rank."""

import pytest

from tests.pretrained import load_export_ranks
from tests.pretrained.hf_models import MODELS

pytest.importorskip("transformers")

STRATEGIES = ["full_shard", "shard_grad_op", "no_shard", "optimizer_only"]


@pytest.mark.parametrize("world", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("kind", MODELS)
def test_loads_what_from_pretrained_loads(pools, hf_folders, kind, world):
    results = pools(world).run(load_export_ranks.compare_with_from_pretrained, str(hf_folders[kind]), STRATEGIES)
    for rank, per_strategy in enumerate(results):
        for strategy, r in per_strategy.items():
            assert r["diff"] <= 1e-6, (rank, strategy, r["diff"])
            assert r["same"], (rank, strategy)
            # Each rank read exactly the rows it holds (no_shard: every row), of every tensor it holds.
            assert r["read"] == r["held"], (rank, strategy)
    if world == 3:
        embed = "transformer.wte.weight" if kind == "gpt2" else "model.embed_tokens.weight"
        rows = [results[r]["full_shard"]["read"][embed] for r in range(3)]
        assert rows == [(0, 87), (87, 174), (174, 259)]
        assert all(results[r]["no_shard"]["read"][embed] == (0, 259) for r in range(3))


@pytest.mark.parametrize("kind", ["llama_untied", "gpt2"])
def test_loads_into_an_embedding_that_looks_rows_up_where_they_are_held(pools, hf_folders, kind):
    results = pools(2).run(
        load_export_ranks.compare_with_from_pretrained, str(hf_folders[kind]), ["full_shard"], embedding_unit=True
    )
    assert all(r["full_shard"]["diff"] <= 1e-6 and r["full_shard"]["same"] for r in results)
    assert all(r["full_shard"]["read"] == r["full_shard"]["held"] for r in results)


@pytest.mark.slow  # a world of 4
def test_hybrid_shard_reads_rows_per_shard_group(pools, hf_folders):
    results = pools(4).run(
        load_export_ranks.compare_with_from_pretrained, str(hf_folders["llama_untied"]), ["hybrid_shard"], mesh=(2, 2)
    )
    embed = [r["hybrid_shard"]["read"]["model.embed_tokens.weight"] for r in results]
    assert embed == [(0, 130), (130, 259), (0, 130), (130, 259)]
    assert all(r["hybrid_shard"]["diff"] <= 1e-6 and r["hybrid_shard"]["same"] for r in results)
