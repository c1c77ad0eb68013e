"""The full format's weights, and `shardtrain convert` of a sharded checkpoint, load into the plain
unsharded model with strict `load_state_dict(safetensors.torch.load_file(...))` and give the sharded
model's outputs."""

import json

import pytest
import torch
from safetensors.torch import load_file

from shardtrain.cli import main
from tests.checkpoint.train_save_ranks import save_full_and_forward
from tests.models import tiny_llama

TOKENS = torch.arange(32).remainder(256).view(2, 16)


def _plain_model_from(weights) -> torch.nn.Module:
    model = tiny_llama()
    model.load_state_dict(load_file(weights))  # strict: every name, tied head.weight included
    return model


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_full_weights_load_into_the_plain_model(pools, tmp_path, world):
    full, logits = pools(world).run(save_full_and_forward, str(tmp_path / "ckpt"), "full")[0]
    weights = tmp_path / "ckpt" / "model.safetensors"
    plain = _plain_model_from(weights)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, full[name]), name
    assert plain.head.weight is plain.embed.weight
    with torch.no_grad():
        torch.testing.assert_close(plain(TOKENS), logits, rtol=1.3e-6, atol=1e-5)
    metadata = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())
    assert metadata["kind"] == "full" and sorted(metadata["files"]) == [
        "model.safetensors",
        "optimizer.safetensors",
        *[f"rank-{r:05d}.pt" for r in range(world)],
    ]


def test_convert_sharded_checkpoint_to_one_file(pools, tmp_path, capsys):
    full, logits = pools(3).run(save_full_and_forward, str(tmp_path / "run" / "step2"), "sharded")[0]
    out = tmp_path / "model.safetensors"
    assert main(["convert", str(tmp_path / "run"), str(out)]) == 0  # through the `latest` pointer
    assert "wrote" in capsys.readouterr().out
    plain = _plain_model_from(out)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, full[name]), name
    with torch.no_grad():
        torch.testing.assert_close(plain(TOKENS), logits, rtol=1.3e-6, atol=1e-5)


def test_convert_reports_bad_input(pools, tmp_path, capsys):
    assert main(["convert", str(tmp_path), str(tmp_path / "x.safetensors")]) == 2
    assert "is not a checkpoint" in capsys.readouterr().err
    pools(2).run(save_full_and_forward, str(tmp_path / "ckpt"), "sharded")
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "folder")]) == 2
    assert "does not end in .safetensors" in capsys.readouterr().err


def test_convert_hf_model_to_a_from_pretrained_folder(pools, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.checkpoint.train_save_ranks import save_hf_model

    full = pools(2).run(save_hf_model, str(tmp_path / "ckpt"))[0]
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0  # config recorded at save
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, full[name]), name
    # A config of a model read from a bitsandbytes folder keeps its quantization_config; the weights written are
    # not quantised, so the converted folder's config drops it (from_pretrained would quantise them again).
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    quantized = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    (tmp_path / "bnb.json").write_text(json.dumps(config | {"quantization_config": quantized}))
    assert (
        main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf2"), "--hf-config", str(tmp_path / "bnb.json")]) == 0
    )
    assert json.loads((tmp_path / "hf2" / "config.json").read_text()) == config
