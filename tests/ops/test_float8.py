"""float8 training (ops/float8.py): which Linears convert on the built-in Llama, a transformers Llama and
a peft LoRA model around one; the refusals of the Engine and the CLI; a float8 run's checkpoint holds
plain fp32 weights and resumes without float8 and back. (The float8 matmul on CUDA and the loss against
bf16: tests/gpu/test_float8_gpu.py.)"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("torchao.float8")

from torchao.float8.float8_linear import Float8Linear

from shardtrain.float8_rule import float8_linear_names
from shardtrain.models.llama import Llama, llama_config
from shardtrain.ops.float8 import convert_to_float8


def _meta_llama(size: str, **overrides) -> Llama:
    with torch.device("meta"):
        return Llama(llama_config(size, n_layers=2, **overrides))


BLOCK_LINEARS = ("attn.wq", "attn.wo", "ffn.w1", "ffn.w3", "ffn.w2")  # wk, wv stay (torchao's small-matmul threshold)


@pytest.mark.parametrize("size", ["1.5b", "8b"])  # wk, wv: 2048 -> 1024 and 4096 -> 1024
def test_built_in_llama_converts_the_large_block_linears(size):
    model = _meta_llama(size)
    expected = [f"layers.{i}.{part}" for i in range(2) for part in BLOCK_LINEARS]
    params = dict(model.named_parameters())
    assert convert_to_float8(model) == expected
    assert [n for n, m in model.named_modules() if isinstance(m, Float8Linear)] == expected
    assert not isinstance(model.head, Float8Linear)
    # the same Parameter objects under the same names: an optimizer built before keeps them
    assert all(p is params[name] for name, p in model.named_parameters())


def test_a_model_without_large_linears_is_refused():
    model = _meta_llama("125m")  # dim 768 < 1024
    assert float8_linear_names(model) == []
    with pytest.raises(ValueError, match="float8: no Linear of Llama qualifies .* train this model without float8"):
        convert_to_float8(model)


def test_the_head_stays_even_where_its_shape_qualifies():
    model = _meta_llama("1.5b", vocab_size=4096)  # 2048 -> 4096: the head alone is what keeps it in bf16
    assert "head" not in float8_linear_names(model)


def _hf_llama(**overrides):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=32768,
        tie_word_embeddings=False,
        **overrides,
    )
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


HF_EXPECTED = [
    f"model.layers.{i}.{part}"
    for i in range(2)
    for part in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
]


def test_transformers_llama_converts_all_but_lm_head_and_kv():
    model = _hf_llama()
    assert convert_to_float8(model) == HF_EXPECTED  # lm_head 2048 -> 32768 qualifies by shape, stays
    assert isinstance(model.model.layers[0].mlp.up_proj, Float8Linear)
    assert not isinstance(model.lm_head, Float8Linear)


def test_peft_lora_converts_the_frozen_base_not_the_adapters():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_hf_llama(), peft.LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    names = convert_to_float8(model)
    prefix = "base_model.model.model.layers"
    assert names == [
        f"{prefix}.{i}.{part}"
        for i in range(2)
        for part in (
            "self_attn.q_proj.base_layer",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q.base_layer, Float8Linear) and not isinstance(q.lora_B["default"], Float8Linear)


def test_a_4_bit_base_is_refused_naming_qlora_and_the_fix():
    peft = pytest.importorskip("peft")
    from shardtrain.pretrained import quantize_base

    model = peft.get_peft_model(_hf_llama(), peft.LoraConfig(r=16, target_modules=["q_proj", "v_proj"]))
    quantize_base(model, bits=4)
    assert float8_linear_names(model) == []  # NF4 base, adapters below the size rule
    with pytest.raises(ValueError, match=r"Engine\(float8=True\) with a 4-bit base .* QLoRA with float8=False"):
        convert_to_float8(model)
    assert not any(isinstance(m, Float8Linear) for m in model.modules())


def test_converting_twice_converts_nothing_more():
    model = _meta_llama("1.5b")
    convert_to_float8(model)
    with pytest.raises(ValueError, match="no Linear of Llama qualifies"):
        convert_to_float8(model)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(float8=True), ValueError, r"Engine\(float8=True\) needs compile=True"),
        (dict(float8=True, compile=True, tp=2), ValueError, r"with tp=2: .* pass tp=1 or float8=False"),
        (dict(float8="yes", compile=True), TypeError, r"Engine\(float8='yes'\): use True or False"),
    ],
)
def test_engine_refuses(kwargs, error, match):
    import shardtrain as st

    with pytest.raises(error, match=match):
        st.Engine(devices=1, accelerator="cpu", **kwargs)


def test_cli_float8_reaches_the_engine_and_is_refused_without_compile():
    from shardtrain.cli.train import engine_options
    from shardtrain.train.config import load_config
    from shardtrain.train.section_fields import ConfigError

    on = load_config(None, ["--train.float8", "true", "--train.compile", "true"])
    assert engine_options(on)["float8"] is True and engine_options(load_config(None, []))["float8"] is False
    with pytest.raises(ConfigError, match=r"train.float8=True is invalid: .* --train.compile true"):
        load_config(None, ["--train.float8", "true"])
    with pytest.raises(ConfigError, match=r"engine.tp=2 ranks .* --engine.tp 1"):
        load_config(None, ["--train.float8", "true", "--train.compile", "true", "--engine.tp", "2"])
    for four_bit in (["--lora.base_bits", "4"], ["--lora.load_in_4bit", "true"]):
        with pytest.raises(
            ConfigError, match=r"lora.base_bits=4 \(QLoRA\) .* --train.float8 false, or --lora.base_bits 16"
        ):
            load_config(None, ["--train.float8", "true", "--train.compile", "true", "--lora.rank", "8", *four_bit])


def test_float8_checkpoint_holds_plain_weights_and_resumes_both_ways(pools, tmp_path):
    from tests.ops.float8_ranks import round_trip

    results = pools(2).run(round_trip, str(tmp_path))
    for r in results:
        assert r["converted"] == ["layers.0.ffn.w1", "layers.0.ffn.w3"]
        assert r["into_plain"] and r["into_float8"], r
        assert r["float8_types"] == ["Float8Linear"]  # the model loaded into is still float8
        assert not any(d.startswith("F8") for d in r["dtypes"]) and "F32" in r["dtypes"], r["dtypes"]
        assert math.isfinite(r["loss_after"])
    assert results[0]["loss_after"] == results[1]["loss_after"]


def test_engine_setup_converts_before_sharding(pools):
    from tests.ops.float8_ranks import through_the_engine

    results = pools(2).run(through_the_engine)
    assert [r["float8"] for r in results] == [["layers.0.ffn.w1", "layers.0.ffn.w3"]] * 2
    assert results[0]["printed"] == "float8: 2 Linears train in float8 (float8_rule.py's rule)\n"
    assert results[1]["printed"] == "" and results[0]["rebound"] == 12  # every parameter of the model
