"""TrainingArguments -> st.shard options (in process; no process group)."""

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")  # tests/integrations/hf_run.py builds its datasets

from shardtrain.integrations.hf_args import trainer_sharding  # noqa: E402
from tests.integrations.hf_run import model  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    return model()


def _args(tmp_path, **kwargs):
    return transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kwargs)


def test_both_spellings_give_the_same_options(tmp_path, llama):
    documents = _args(
        tmp_path,
        fsdp="full_shard auto_wrap offload",
        fsdp_config={"transformer_layer_cls_to_wrap": "LlamaDecoderLayer"},
    )
    five = _args(
        tmp_path,
        fsdp=True,
        fsdp_config={
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "reshard_after_forward": True,
            "cpu_offload": True,
        },
    )
    a, b = trainer_sharding(documents, llama), trainer_sharding(five, llama)
    assert a == b
    assert a.shard["strategy"] == "full_shard" and a.shard["cpu_offload"] is True
    assert {c.__name__ for c in a.shard["wrap"]} == {"LlamaDecoderLayer"}


def test_defaults_wrap_the_models_layers_and_read_the_rest(tmp_path, llama):
    s = trainer_sharding(_args(tmp_path, bf16=True, activation_checkpointing=True), llama)
    assert {c.__name__ for c in s.shard["wrap"]} == {"LlamaDecoderLayer"}
    assert s.shard["activation_checkpointing"] == s.shard["wrap"]
    assert s.shard["mixed_precision"] == "bf16"
    grad_op = trainer_sharding(_args(tmp_path, fsdp="shard_grad_op auto_wrap"), llama)
    assert grad_op.shard["strategy"] == "shard_grad_op"
    assert grad_op.checkpoint_format == "sharded"
    full = trainer_sharding(_args(tmp_path, fsdp=True, fsdp_config={"state_dict_type": "FULL_STATE_DICT"}), llama)
    assert full.checkpoint_format == "full"
    sized = {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 1000}
    assert trainer_sharding(_args(tmp_path, fsdp=True, fsdp_config=sized), llama).shard["wrap"].min_params == 1000


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fp16": True}, r"fp16=True"),
        ({"torch_compile": True}, r"torch_compile=True"),
        ({"fsdp": True, "fsdp_config": {"forward_prefetch": True}}, r"fsdp_config\['forward_prefetch'\]"),
        ({"fsdp": True, "fsdp_config": {"transformer_layer_cls_to_wrap": ["NoSuchLayer"]}}, r"NoSuchLayer"),
        (
            {"fsdp": True, "fsdp_config": {"auto_wrap_policy": "NO_WRAP", "activation_checkpointing": True}},
            r"layer classes",
        ),
        (
            {"load_best_model_at_end": True, "save_only_model": True, "eval_strategy": "steps"},
            r"load_best_model_at_end=True, save_only_model=True.*drop save_only_model",
        ),
    ],
)
def test_what_shardtrain_cannot_run_is_named(tmp_path, llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        trainer_sharding(_args(tmp_path, **kwargs), llama)
