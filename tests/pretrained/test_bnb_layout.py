"""Folders quantised by bitsandbytes (transformers' load_in_4bit / load_in_8bit, saved on the CPU): read as
the weights bitsandbytes itself dequantises, bit for bit, into every kind of target; bad layouts refused."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardtrain.pretrained.bnb_layout import dequantize
from shardtrain.pretrained.files import resolve_weights
from shardtrain.pretrained.nf4 import scaler_block
from tests.pretrained import bnb_ranks, qlora_ranks
from tests.pretrained import load_export_ranks as ranks
from tests.pretrained.hf_models import BNB_MODES

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("transformers")


def _read(tensors):
    return lambda part, start, stop: tensors[part.key][start:stop]


@pytest.mark.parametrize("blocksize", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_4bit_dequantisation_equals_bitsandbytes_bit_for_bit(tmp_path, quant_type, nested, dtype, blocksize):
    """bitsandbytes quantises and serialises (its packed state dict, as Linear4bit saves it); we read that file."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    torch.manual_seed(0)
    weight = (torch.randn(96, 256) * 0.05).to(dtype)  # 384 blocks of 64: a partial group of 256 scales
    packed, state = quantize_4bit(weight, blocksize=blocksize, quant_type=quant_type, compress_statistics=nested)
    tensors = {"w.weight": packed} | {f"w.weight.{k}": v for k, v in state.as_dict(packed=True).items()}
    save_file(tensors, tmp_path / "w.safetensors")
    entry = resolve_weights(tmp_path / "w.safetensors").tensors
    assert list(entry) == ["w.weight"] and (entry["w.weight"].shape, entry["w.weight"].dtype) == ((96, 256), dtype)
    ours = dequantize(entry["w.weight"], _read(tensors))
    theirs = dequantize_4bit(packed, state)
    assert ours.dtype == theirs.dtype == dtype and torch.equal(ours, theirs)
    error = (ours.float() - weight.float()).abs().max().item()
    assert 0 < error < 0.2 * weight.abs().max().item()  # a 4-bit copy: within half a gap between levels
    for rows in [(0, 1), (5, 37), (40, 96)]:  # what one rank reads: the blocks holding its rows
        assert torch.equal(dequantize(entry["w.weight"], _read(tensors), rows=rows), ours[rows[0] : rows[1]])


@pytest.mark.parametrize("nested", [True, False])
def test_rows_that_split_blocks_read_as_the_whole_weight(tmp_path, nested):
    """Rows of 100 values over blocks of 64 (and groups of 256 scales): any range of rows, as the whole."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    torch.manual_seed(0)
    weight = torch.randn(333, 100, dtype=torch.bfloat16)
    packed, state = quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=nested)
    tensors = {"w.weight": packed} | {f"w.weight.{k}": v for k, v in state.as_dict(packed=True).items()}
    save_file(tensors, tmp_path / "w.safetensors")
    entry = resolve_weights(tmp_path / "w.safetensors").tensors["w.weight"]
    whole = dequantize(entry, _read(tensors))
    assert torch.equal(whole, dequantize_4bit(packed, state))
    for rows in [(0, 333), (0, 1), (1, 2), (3, 170), (163, 334 - 1), (332, 333), (7, 7)]:
        assert torch.equal(dequantize(entry, _read(tensors), rows=rows), whole[rows[0] : rows[1]]), rows


@pytest.mark.parametrize("mode", BNB_MODES)
def test_a_folder_saved_by_transformers_reads_as_bitsandbytes_dequantises_it(bnb_folders, mode):
    """One entry per weight, of the source's names and shapes; values equal to bitsandbytes' dequantisation
    from the same file (QuantState.from_dict, as transformers loads it; int8_vectorwise_dequant for LLM.int8)."""
    from bitsandbytes.functional import QuantState, dequantize_4bit, int8_vectorwise_dequant

    source = load_file(bnb_folders["source"] / "model.safetensors")
    tensors = load_file(bnb_folders[mode] / "model.safetensors")
    entries = resolve_weights(bnb_folders[mode]).tensors
    assert {k: e.shape for k, e in entries.items()} == {k: tuple(v.shape) for k, v in source.items()}
    packed = {k: e for k, e in entries.items() if e.packed is not None}
    assert len(packed) == 14 and all(".layers." in k and k.endswith("_proj.weight") for k in packed)
    for key, entry in packed.items():
        ours = dequantize(entry, _read(tensors))
        if mode == "int8":
            theirs = int8_vectorwise_dequant(tensors[key], tensors[key.removesuffix("weight") + "SCB"])
            # LLM.int8: each row of the weight (rounded to bf16, as loaded) in steps of its absolute maximum / 127
            weight = source[key].to(torch.bfloat16).float()
            step = weight.abs().amax(dim=1, keepdim=True) / 127
            assert ((ours - weight).abs() <= step * 0.501).all().item(), key
        else:
            parts = {k.removeprefix(key + "."): v for k, v in tensors.items() if k.startswith(key + ".")}
            theirs = dequantize_4bit(tensors[key], QuantState.from_dict(parts, device=torch.device("cpu")))
            if mode.startswith("nf4"):  # torchao quantises it again (base_bits=4) to the same codes
                nf4 = pytest.importorskip("torchao.quantization").to_nf4(ours, 64, scaler_block(ours.numel() // 64))
                assert torch.equal(nf4.quantized_data.flatten(), tensors[key].flatten()), key
        assert ours.dtype == theirs.dtype == (torch.float32 if mode == "int8" else torch.bfloat16), key
        assert torch.equal(ours, theirs), key


def _bnb_model(folder):
    """bitsandbytes' own model of `folder` (transformers' from_pretrained): its logits (its quantised
    forward, bf16), and the model transformers dequantises from it, in fp32 (from a second copy: on the
    CPU, bitsandbytes' forward repacks the weights in place, which transformers' dequantize does not undo)."""
    from transformers import AutoModelForCausalLM

    own = ranks.logits(AutoModelForCausalLM.from_pretrained(folder, device_map="cpu").eval()).float()
    model = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu")
    return own, model.dequantize(dtype=torch.float32).float().eval()


# bitsandbytes' forward computes in bf16 (and LLM.int8 quantises the activations too): relative to the logits' scale
OWN_TOLERANCE = {"nf4_dq": 0.02, "nf4": 0.02, "fp4": 0.02, "int8": 0.03}


@pytest.mark.parametrize("mode", BNB_MODES)
def test_full_and_lora_models_load_what_transformers_dequantises(pools, bnb_folders, mode):
    own, dequantised = _bnb_model(bnb_folders[mode])
    expected = ranks.logits(dequantised)
    full = pools(2).run(bnb_ranks.loaded, str(bnb_folders[mode]), 16, False)[0]
    reference = dequantised.state_dict()
    assert set(full["state"]) == set(reference)
    assert all(torch.equal(full["state"][k], reference[k]) for k in reference)
    assert (full["logits"] - expected).abs().max() <= 1e-5
    lora = pools(2).run(bnb_ranks.loaded, str(bnb_folders[mode]), 16, True)[0]  # LoRA over a 16-bit base
    assert (lora["logits"] - expected).abs().max() <= 1e-5  # B = 0: the base's logits
    assert (lora["logits"] - own).abs().max() <= OWN_TOLERANCE[mode] * own.abs().max()


@pytest.mark.parametrize("mode", ["nf4_dq", "fp4"])
def test_a_4bit_base_quantises_the_dequantised_weights_with_torchao(pools, bnb_folders, mode):
    """base_bits=4: each weight bitsandbytes dequantises, quantised again by torchao (NF4, linear 8-bit scales):
    the logits of the same model built without shardtrain; near bitsandbytes' own (NF4: the same codes)."""
    pytest.importorskip("torchao")
    pytest.importorskip("peft")
    own, dequantised = _bnb_model(bnb_folders[mode])
    linear = {n: m.weight.detach().clone() for n, m in dequantised.named_modules() if type(m) is torch.nn.Linear}
    reference = qlora_ranks.dequantized_base(dequantised)
    requantised = {n: m.weight for n, m in reference.named_modules() if n in linear}
    worst = max((requantised[n] - w).abs().max() / w.abs().max() for n, w in linear.items() if n != "lm_head")
    assert 0 < worst <= (0.01 if mode == "nf4_dq" else 0.1), worst  # relative to each weight's largest value
    r = pools(2).run(bnb_ranks.loaded, str(bnb_folders[mode]), 4, True)[0]
    assert (r["logits"] - ranks.logits(reference)).abs().max() <= 1e-5
    assert (r["logits"] - own).abs().max() <= (0.02 if mode == "nf4_dq" else 0.2) * own.abs().max()
    for held in pools(2).run(qlora_ranks.held_storage, str(bnb_folders[mode])):
        packed = [rows for name, rows in held["rows"].items() if name.endswith("weight_nf4")]
        assert len(packed) == 14 and all(0 < rows < whole for rows, whole in packed)  # each rank its rows


def _edit(folder, tmp_path, edit) -> str:
    out = tmp_path / folder.name
    shutil.copytree(folder, out)
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return str(out / "model.safetensors")


Q = "model.layers.0.self_attn.q_proj"
FIX = (
    "shardtrain reads bitsandbytes' 4-bit (nf4, fp4; uint8 storage) and 8-bit layouts as transformers saves them: "
    "load the model's 16-bit (unquantised) folder instead"
)


def _storage(t):  # bnb_4bit_quant_storage=torch.bfloat16, as bitsandbytes stores it
    t[f"{Q}.weight"] = t[f"{Q}.weight"].squeeze(1).view(torch.bfloat16).unsqueeze(1)


def _quant_type(t):
    t[f"{Q}.weight.quant_state.bitsandbytes__int4"] = t.pop(f"{Q}.weight.quant_state.bitsandbytes__nf4")


def _weight_format(t):
    t[f"{Q}.weight_format"] = torch.tensor(2, dtype=torch.uint8)


@pytest.mark.parametrize(
    "mode,edit,message",
    [
        (
            "nf4_dq",
            lambda t: t.pop(f"{Q}.weight.absmax"),
            f"bitsandbytes weight '{Q}.weight' lacks '{Q}.weight.absmax'; {FIX}",
        ),
        ("nf4_dq", _storage, f"'{Q}.weight' is stored as torch.bfloat16 [4096, 1] where its quant_state (nf4, shape"),
        ("nf4_dq", _quant_type, f"bitsandbytes weight '{Q}.weight' has quant_type 'int4'; {FIX}"),
        ("nf4", lambda t: t.pop(f"{Q}.weight.quant_state.bitsandbytes__nf4"), f"tensor '{Q}.weight.absmax' is part"),
        ("int8", lambda t: t.pop(f"{Q}.SCB"), f"tensor '{Q}.weight' is int8 without the {Q}.SCB scales"),
        ("int8", _weight_format, f"'{Q}.weight' is stored in weight_format 2 (a tiled GPU layout"),
    ],
    ids=["missing_absmax", "quant_storage", "quant_type", "no_quant_state", "int8_without_scb", "weight_format"],
)
def test_layouts_not_read_are_refused_naming_the_key_and_the_fix(bnb_folders, tmp_path, mode, edit, message):
    path = _edit(bnb_folders[mode], tmp_path, edit)
    with pytest.raises(ValueError, match="^" + path.replace(".", r"\.") + ": ") as raised:
        resolve_weights(path)
    assert message in str(raised.value) and str(raised.value).endswith(FIX.rpartition(": ")[2])


def test_another_quantization_method_is_refused(hf_folders, tmp_path):
    folder = tmp_path / "gptq"
    shutil.copytree(hf_folders["llama_untied"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(ValueError) as raised:
        resolve_weights(folder)
    assert str(raised.value) == (
        f"{folder / 'config.json'}: quantization_config.quant_method='gptq'; shardtrain reads 16- or 32-bit "
        "weights and bitsandbytes' 4- and 8-bit layouts, not gptq's: load the model's 16-bit (unquantised) "
        "folder instead"
    )


@pytest.mark.parametrize("mode", ["nf4_dq", "int8"])
def test_a_live_bitsandbytes_model_is_refused_by_shard_naming_the_weight_and_the_fix(bnb_folders, mode):
    """Sharding bitsandbytes' packed parameters crashed a training step (a segfault on 2 CPU ranks): st.shard,
    which the Engine and every trainer integration call, refuses them before anything is touched."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import shardtrain as st

    model = AutoModelForCausalLM.from_pretrained(bnb_folders[mode], device_map="cpu")
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    kind = "Int8Params" if mode == "int8" else "Params4bit"
    with pytest.raises(
        ValueError,
        match=rf"^base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.base_layer\.weight is a bitsandbytes {kind} .*load_in_4bit=True.*st\.load_pretrained",
    ):
        st.shard(model)
    assert not hasattr(model, "_shardtrain_runtime") and all(not p.is_meta for p in model.parameters())
