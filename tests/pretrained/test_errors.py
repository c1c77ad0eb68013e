"""Bad pretrained inputs: one line, on every rank, naming the file and the key (or what is missing)."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.pretrained import load_export_ranks

pytest.importorskip("transformers")


def _messages(pools, path, folder, strict=True) -> str:
    messages = pools(2).run(load_export_ranks.load_message, str(path), str(folder), strict)
    assert messages[0] == messages[1]  # every rank reports the same mistake, none hangs
    assert messages[0] is None or "\n" not in messages[0]
    return messages[0]


@pytest.fixture
def llama(hf_folders, tmp_path):
    """A writable copy of the untied Llama folder."""
    return shutil.copytree(hf_folders["llama_untied"], tmp_path / "llama")


def _rewrite(folder, change):
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_missing_path_and_folders_without_weights(pools, llama, tmp_path):
    assert _messages(pools, tmp_path / "nowhere", llama) == (
        f"{tmp_path / 'nowhere'} does not exist; pass a .safetensors file or a Hugging Face model folder holding "
        "model.safetensors or model.safetensors.index.json"
    )
    (tmp_path / "config_only").mkdir()
    shutil.copy(llama / "config.json", tmp_path / "config_only")
    assert _messages(pools, tmp_path / "config_only", llama) == (
        f"{tmp_path / 'config_only'} holds no model.safetensors or model.safetensors.index.json (it holds "
        "config.json); pass a Hugging Face model folder written by save_pretrained, or a .safetensors file"
    )
    (tmp_path / "empty").mkdir()
    assert "holds no model.safetensors or model.safetensors.index.json (it holds nothing)" in _messages(
        pools, tmp_path / "empty", llama
    )
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"x")
    assert "holds only pickled PyTorch weights (pytorch_model.bin); shardtrain reads safetensors only" in _messages(
        pools, tmp_path / "pickled", llama
    )


def test_missing_key_names_it_and_strict_false_keeps_the_initial_value(pools, llama):
    _rewrite(llama, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    assert _messages(pools, llama, llama) == (
        f"{llama}: no tensor for the model's 'model.layers.1.mlp.up_proj.weight' (1 missing: "
        "[model.layers.1.mlp.up_proj.weight]); load weights of this model, or pass strict=False to keep the "
        "initial values of what is missing"
    )
    assert _messages(pools, llama, llama, strict=False) is None


def test_unexpected_key_names_the_file_and_the_key(pools, llama):
    _rewrite(llama, lambda t: t.update({"model.layers.9.extra.weight": torch.zeros(3)}))
    assert _messages(pools, llama, llama) == (
        f"{llama / 'model.safetensors'}: tensor 'model.layers.9.extra.weight' matches no parameter or buffer of the "
        "model (1 unexpected: [model.layers.9.extra.weight]); load weights of this model, or pass strict=False to "
        "ignore them"
    )
    assert _messages(pools, llama, llama, strict=False) is None


def test_shape_mismatch_names_the_file_the_key_and_both_shapes(pools, llama):
    _rewrite(llama, lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    assert _messages(pools, llama, llama, strict=False) == (
        f"{llama / 'model.safetensors'}: tensor 'model.norm.weight' has shape (65,), the model's 'model.norm.weight' "
        "has (64,); the weights belong to another configuration: build the model from the config.json saved with them"
    )


def test_corrupt_and_truncated_files(pools, llama):
    data = (llama / "model.safetensors").read_bytes()
    (llama / "model.safetensors").write_bytes(data[:1000])
    message = _messages(pools, llama, llama)
    assert message.startswith(f"{llama / 'model.safetensors'} is not a readable safetensors file (")
    assert message.endswith("); the file is damaged or truncated: copy it again")
    (llama / "model.safetensors").write_bytes(b"\xff" * 64)
    assert _messages(pools, llama, llama).startswith(f"{llama / 'model.safetensors'} is not a readable safetensors")


def test_index_errors(pools, hf_folders, tmp_path):
    split = shutil.copytree(hf_folders["llama_split"], tmp_path / "split")
    index = json.loads((split / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    (split / files[-1]).unlink()
    assert _messages(pools, split, split) == (
        f"{split / 'model.safetensors.index.json'} lists {files[-1]}, which is missing from {split}; copy the whole "
        "model folder"
    )
    shutil.copy(hf_folders["llama_split"] / files[-1], split)
    index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
    (split / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "names file '../elsewhere.safetensors', which is not a plain file name in its folder" in _messages(
        pools, split, split
    )
    (split / "model.safetensors.index.json").write_text("{not json")
    assert _messages(pools, split, split).startswith(
        f"{split / 'model.safetensors.index.json'} is not a readable JSON index ("
    )


def test_loads_from_a_single_file_and_from_an_index_file(pools, hf_folders):
    split = hf_folders["llama_split"]
    assert _messages(pools, split / "model.safetensors.index.json", split) is None
    assert _messages(pools, hf_folders["llama_tied"] / "model.safetensors", hf_folders["llama_tied"]) is None
