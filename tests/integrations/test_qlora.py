"""A 4-bit base (QLoRA) through the integrations' option: `ShardtrainStrategy(load_in_4bit=True)`,
`ShardtrainTrainer(load_in_4bit=True)`."""

import pytest

pytest.importorskip("peft")
pytest.importorskip("torchao")

from tests.integrations.runs import run_script


@pytest.mark.slow  # end to end in fresh processes, as the other integrations' parity runs
def test_fabric_load_in_4bit_matches_one_process_over_torchaos_nf4(tmp_path):
    """A peft Llama set up by Fabric on 2 CPU ranks with load_in_4bit=True: 3 steps' losses equal those of
    the same model in one process whose frozen linears are torchao's dequantised NF4 (without the option
    they differ by ~1e-3)."""
    pytest.importorskip("lightning")
    r = run_script("fabric_qlora_run.py", str(tmp_path))
    assert r["nf4_layers"] == 14  # 2 layers x 7 linears; the head stays
    assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-5)
    assert r["losses"][-1] < r["losses"][0]  # the adapters trained


@pytest.mark.slow
def test_trainer_load_in_4bit_matches_ddp_over_torchaos_nf4(tmp_path):
    """ShardtrainTrainer(load_in_4bit=True) on a peft Llama, 2 ranks under torchrun: 3 steps' logged losses
    equal transformers.Trainer's (DDP) on the same model over torchao's dequantised NF4 base."""
    pytest.importorskip("datasets")
    r = run_script("hf_qlora_run.py", str(tmp_path), torchrun=True)
    assert r["nf4_layers"] == 14
    assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-5)
    assert r["losses"][-1] < r["losses"][0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"base_bits": 8}, r"base_bits=8.*use 4"),
        ({"load_in_4bit": "yes"}, r"load_in_4bit='yes'"),
    ],
)
def test_bad_bits_fail_when_the_strategy_is_built(kwargs, message):
    pytest.importorskip("lightning")
    from shardtrain.integrations.fabric import ShardtrainStrategy

    with pytest.raises(ValueError, match=message):
        ShardtrainStrategy(**kwargs)


def test_a_model_without_peft_is_refused_in_one_line():
    pytest.importorskip("lightning")
    import torch

    from shardtrain.integrations.lightning import ShardtrainStrategy

    strategy = ShardtrainStrategy(base_bits=4)
    with pytest.raises(ValueError, match=r"ShardtrainStrategy\(base_bits=4\).*Linear holds none.*get_peft_model"):
        strategy._shard_options.for_model(torch.nn.Linear(4, 4))


def test_the_trainer_refuses_a_model_without_peft_and_bad_bits(tmp_path):
    from transformers import LlamaForCausalLM, TrainingArguments

    from shardtrain.integrations.transformers import ShardtrainTrainer
    from tests.pretrained.hf_models import config

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    model = LlamaForCausalLM(config("llama_untied"))
    with pytest.raises(ValueError, match=r"ShardtrainTrainer\(base_bits=4\).*LlamaForCausalLM holds none"):
        ShardtrainTrainer(model=model, args=args, load_in_4bit=True)
    with pytest.raises(ValueError, match=r"ShardtrainTrainer\(base_bits=3\)"):
        ShardtrainTrainer(model=model, args=args, base_bits=3)
