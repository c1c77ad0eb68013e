"""st.save_pretrained after training: from_pretrained opens the folder and finds st.full_state_dict's values."""

import json

import pytest
import torch

from tests.pretrained import load_export_ranks

pytest.importorskip("transformers")


def _opened(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.parametrize(
    "kind,world,max_shard_size",
    [("llama_tied", 2, "5GB"), ("gpt2", 2, "5GB"), pytest.param("llama_untied", 3, "60KB", marks=pytest.mark.slow)],
)
def test_export_round_trip_equals_full_state_dict(pools, hf_folders, tmp_path, kind, world, max_shard_size):
    out = str(tmp_path / "hf")
    result = pools(world).run(
        load_export_ranks.export_after_training, str(hf_folders[kind]), out, "full_shard", max_shard_size
    )[0]
    state = result["state"]
    for folder in (out, out + "-method"):
        opened = _opened(folder).state_dict()
        assert set(opened) == set(state)
        assert all(torch.equal(opened[k], state[k]) for k in state), folder
    assert not torch.equal(state["lm_head.weight"], _opened(hf_folders[kind]).state_dict()["lm_head.weight"])
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    if max_shard_size == "60KB":
        # Split as save_pretrained splits: files of at most 60 kB of tensors (a larger tensor alone), an index.
        index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(state) and "model.safetensors" not in files
        sizes: dict[str, list[int]] = {}
        for name, file in index["weight_map"].items():
            sizes.setdefault(file, []).append(state[name].numel() * 4)
        assert len(sizes) >= 3 and sorted(sizes) == [f for f in files if f.startswith("model-")]
        assert all(sum(s) <= 60_000 or len(s) == 1 for s in sizes.values())
        assert index["metadata"]["total_size"] == sum(map(sum, sizes.values()))
    else:
        assert files == ["config.json", "generation_config.json", "model.safetensors"]
        from safetensors import safe_open

        with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        # Tied weights are written once, under the embedding's name, as save_pretrained writes them.
        assert keys == set(state) - {"lm_head.weight"}
    bf16 = _opened(out + "-bf16")
    assert (
        bf16.config.dtype == torch.bfloat16
        and json.loads((tmp_path / "hf-bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    )
    assert all(torch.equal(v, state[k].to(torch.bfloat16)) for k, v in bf16.state_dict().items())
    assert result["refused"].startswith("save_pretrained(push_to_hub=...) is not supported on a sharded model")


def test_rank0_writer_keeps_its_first_error_for_finish(tmp_path):
    """An I/O error stops rank 0's writing but not the loop over units (the other ranks gather on): finish raises it."""
    from shardtrain.checkpoint.tensorfile import TensorSpec
    from shardtrain.pretrained.export import ExportPlan, FilePlan, _Item, _Rank0Writer

    specs = tuple(TensorSpec(name=n, dtype=torch.float32, shape=(2,)) for n in ("a", "b"))
    items = tuple(_Item(spec=s, unit=0, index=i) for i, s in enumerate(specs))
    plan = ExportPlan(adapter=False, items=items, files=(FilePlan(name="model.safetensors", specs=specs),))
    writer = _Rank0Writer(tmp_path / "missing", plan)  # no such directory: the first write fails
    for item in items:
        writer.write(item, torch.zeros(2))  # the second write is skipped, not raised
    with pytest.raises(OSError):
        writer.finish(torch.nn.Linear(1, 1))
