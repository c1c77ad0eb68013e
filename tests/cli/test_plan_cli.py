"""`shardtrain plan`: plan + audit + estimate of a train config on the meta device, --auto, and the
strategy='auto' wiring of `shardtrain train`."""

import pytest
import torch

from shardtrain import cli
from shardtrain.cli import train as cli_train
from shardtrain.train.config import ConfigError, load_config
from shardtrain.train.planned_config import choice_overrides, planned_setup, resolve_auto_config

TINY = ["--model.name", "llama-tiny", "--data.seq_len", "64", "--train.batch_size", "8", "--engine.devices", "2"]
EIGHT_B = [
    "--model.name",
    "llama-8b",
    "--engine.accelerator",
    "cuda",
    "--engine.devices",
    "2",
    "--data.seq_len",
    "4096",
    "--train.batch_size",
    "4",
]


def _plan(args: list[str], capsys) -> tuple[int, str, str]:
    code = cli.main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines()]


def test_plan_prints_the_wrap_plan_the_precision_audit_and_the_estimate(capsys):
    code, out, err = _plan([*TINY, "--engine.precision", "bf16-mixed", "--device-memory", "8GiB"], capsys)
    assert code == 0, err
    assert out.startswith("shardtrain plan: Llama tiny (0.13M params, 2 layers, dim 64)\n2 x ")
    assert ", full_shard, bf16-mixed, micro-batch 4 x 1 accumulation step, seq 64, activation checkpointing none" in out
    sections = ["== wrap plan ==", "== precision audit ==", "== memory estimate per device =="]
    assert [out.index(s) for s in sections] == sorted(out.index(s) for s in sections)
    rows = _rows(out)
    # st.plan: 46,208 trainable fp32 / 2 ranks, their gradients and AdamW's two moments; bf16 unsharded
    assert ["layers.1", "46,208", "46,208", "0.09", "0.26", "0.09"] in rows
    # tiny's table (16,384) is smaller than a block: embedding and head stay in the root unit
    assert ["<root>", "32,832", "fp32", "bf16", "bf16", "fp32", "fp32", "fp32", "fp32"] in rows  # the audit
    assert ["layers.0", "46,208", "fp32", "bf16", "bf16", "fp32", "fp32", "fp32", "-"] in rows
    assert "2 ranks, bf16 params / fp32 reduce, adamw, micro-batch 4 x seq 64" in out
    assert "fits in 8.00 GiB: yes" in out and "device memory: 8.00 GiB (given)" in out


def test_plan_follows_the_train_configs_checkpointing_offload_and_accumulation(capsys, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(
        '[model]\nname = "llama-7m"\nactivation_checkpointing = 2\n'
        "[train]\nbatch_size = 8\ngrad_accum = 2\n[engine]\ndevices = 2\ncpu_offload = true\n"
        'strategy = "shard_grad_op"\nprecision = "32-true"\n'
    )
    code, out, err = _plan([str(config), "--data.seq_len", "128", "--device-memory", "4GiB"], capsys)
    assert code == 0, err
    assert (
        "shard_grad_op, 32-true, micro-batch 2 x 2 accumulation steps, seq 128, activation checkpointing "
        "1 block in 2, CPU offload"
    ) in out
    assert "activation checkpointing: 1 block in 2, CPU offload of params+grads and optimizer" in out
    assert "placement: host (CPU offload)" in out
    assert "with 2 micro-batches, no_sync holds the unsharded gradients between them" in out


def test_plan_auto_for_8b_on_two_h200(capsys):
    code, out, err = _plan([*EIGHT_B, "--auto", "--device-memory", "141GB"], capsys)
    assert code == 0, err
    assert (
        "2 x cuda, shard_grad_op, bf16-mixed, micro-batch 2 x 1 accumulation step, seq 4096, activation "
        "checkpointing none" in out
    )
    assert "== automatic plan ==\nautomatic plan: shard_grad_op, activation checkpointing none" in out
    assert "- vs full_shard with every block checkpointed at the same batch split: predicted 1.26x" in out
    assert "shardtrain plan: Llama, shard_grad_op, world size 2, 35 units" in out
    assert ["layers.31", "218,112,000", "fp32", "bf16", "bf16", "fp32", "fp32", "fp32", "-"] in _rows(out)
    assert "total (peak allocated)       114.00" in out and "fits in 131.32 GiB: yes" in out
    # the loss in chunks: 3.30 GiB of "logits & loss" where the full logits take 11.74
    code, out, err = _plan([*EIGHT_B, "--auto", "--device-memory", "141GB", "--train.chunked_loss", "auto"], capsys)
    assert code == 0, err
    assert "total (peak allocated)       105.56" in out and "fits in 131.32 GiB: yes" in out


def test_plan_errors_are_one_line_with_the_fix(capsys):
    code, _, err = _plan([*TINY, "--train.batch_size", "7"], capsys)
    assert code == 2 and err.count("\n") == 1 and "use --train.batch_size 6" in err
    code, _, err = _plan(["--engine.stratgy", "auto"], capsys)
    assert code == 2 and "did you mean 'engine.strategy'" in err
    code, _, err = _plan([*TINY, "--engine.strategy", "zero4"], capsys)
    assert code == 2 and "unknown sharding strategy 'zero4'" in err
    if not torch.cuda.is_available():
        code, _, err = _plan([*EIGHT_B, "--auto"], capsys)
        assert code == 2 and "needs the device memory" in err and "--device-memory 141GB" in err
    code, _, err = _plan([*EIGHT_B, "--auto", "--device-memory", "16GB"], capsys)
    assert code == 2 and "nothing fits in 14.90 GiB per device" in err and "use at least 4 devices" in err
    code, _, err = _plan([*TINY, "--auto", "--engine.tp", "2", "--device-memory", "8GB"], capsys)
    assert code == 2 and "engine.tp=2: the automatic plan does not plan tensor parallelism" in err


def test_strategy_auto_resolves_the_train_config_and_keeps_the_global_batch(capsys):
    cfg = load_config(None, [*EIGHT_B, "--engine.strategy", "auto", "--train.batch_size", "16"])
    assert planned_setup(cfg).micro_batch == 8
    resolved, choice = resolve_auto_config(cfg, device_memory=int(141e9))
    assert resolved.engine.strategy == choice.strategy.value and resolved.engine.cpu_offload == choice.cpu_offload
    assert resolved.model.activation_checkpointing == choice.activation_checkpointing
    assert resolved.train.grad_accum == choice.grad_accum and choice.micro_batch * choice.grad_accum == 8
    assert resolved.train.batch_size == 16 and resolved.data == cfg.data and resolved.optim == cfg.optim
    setup = planned_setup(resolved)
    assert (setup.micro_batch, setup.grad_accum) == (choice.micro_batch, choice.grad_accum)
    asked = [*TINY, "--engine.devices", "1", "--engine.strategy", "auto"]
    printed, overrides = cli_train._resolve_auto(load_config(None, asked))
    assert printed.engine.strategy != "auto" and capsys.readouterr().out.startswith("automatic plan: ")
    # the ranks a launcher starts re-run the command with these overrides: the same config, no planning
    assert load_config(None, [*asked, *overrides]) == printed
    offloaded = resolve_auto_config(cfg, device_memory=int(80e9))[0]  # a share offloaded, 1 block in k
    assert 0 < offloaded.engine.cpu_offload < 1 and offloaded.model.activation_checkpointing > 1
    assert (
        load_config(
            None, [*EIGHT_B, "--engine.strategy", "auto", "--train.batch_size", "16", *choice_overrides(offloaded)]
        )
        == offloaded
    )


def test_strategy_auto_needs_block_classes():
    cfg = load_config(
        None,
        [
            "--model.name",
            "torch.nn:Linear",
            "--model.kwargs",
            "{in_features: 4, out_features: 4}",
            "--engine.devices",
            "2",
            "--engine.strategy",
            "auto",
        ],
    )
    with pytest.raises(ConfigError, match="needs the model's block classes.*--model.wrap"):
        resolve_auto_config(cfg, device_memory=1 << 30)


def test_plan_auto_of_a_lora_fine_tune(capsys, tmp_path):
    pytest.importorskip("peft")
    # a Hugging Face folder: the plan builds the model from config.json on meta and never reads the weights
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 704, '
        '"vocab_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": false, '
        '"max_position_embeddings": 1024}'
    )
    (tmp_path / "model.safetensors.index.json").write_text('{"metadata": {}, "weight_map": {}}')
    lora = ["--model.pretrained", str(tmp_path), "--lora.rank", "8", "--engine.accelerator", "cuda"]
    lora += ["--engine.devices", "1", "--data.seq_len", "1024", "--train.batch_size", "2"]
    code, out, err = _plan([*lora, "--auto", "--device-memory", "141GB"], capsys)
    assert code == 0, err
    assert ", LoRA r=8 on q_proj,v_proj: 0.01M trainable\n1 x cuda, full_shard, bf16-mixed" in out
    assert "automatic plan: full_shard, activation checkpointing none" in out
    assert "note: 1,737,984 of 1,752,320 parameters are frozen (1 of 3 units wholly)" in out
    assert "parameters (fp32 master + frozen)" in out and "(2 B each as stored)" in out
    cfg = load_config(None, [*lora, "--engine.strategy", "auto"])
    resolved, choice = resolve_auto_config(cfg, device_memory=int(141e9))
    assert resolved.model.activation_checkpointing is False and choice.estimate.inputs.model.trainable_params == (
        2 * 8 * ((256 + 256) + (256 + 128))
    )


def test_plan_counts_the_disk_tier(capsys, tmp_path):
    """--engine.offload_dir: the estimate shows the optimizer state on disk, out of host memory."""
    offload = ["--engine.cpu_offload", "true", "--device-memory", "140GiB"]
    code, host_out, err = _plan([*EIGHT_B, *offload], capsys)
    assert code == 0, err
    code, disk_out, err = _plan([*EIGHT_B, *offload, "--engine.offload_dir", str(tmp_path)], capsys)
    assert code == 0, err
    host = {r[-2]: float(r[-1]) for r in _rows(host_out) if r[:2] == ["host", "memory"]}
    disk = {r[-2]: float(r[-1]) for r in _rows(disk_out) if r[:2] in (["host", "memory"], ["disk", "(offloaded"])}
    assert "disk (offloaded state)" in disk_out and "disk (offloaded state)" not in host_out
    assert ", CPU offload, optimizer state on disk" in disk_out.splitlines()[1]  # the header says so too
    assert sum(disk.values()) == pytest.approx(sum(host.values()), abs=0.02)
    # the predicted step: the host step and copies, then 32.1 GB per process read and written at the
    # tier's 1.77 / 2.54 GB/s (planning/cost/offload_time.py), which the step waits for
    seconds = 29.92 * 2**30 / 1.77e9 + 29.92 * 2**30 / 2.54e9
    assert f"takes {seconds:.1f} s per step at 1.77 / 2.54 GB/s" in disk_out
    (host_time,) = [line for line in host_out.splitlines() if line.startswith("predicted step time with CPU")]
    (disk_time,) = [line for line in disk_out.splitlines() if line.startswith("predicted step time with CPU")]
    assert "disk tier" not in host_time and float(host_time.split()[-2]) < 2
    assert ", disk tier " in disk_time and float(disk_time.split()[-2]) == pytest.approx(seconds, rel=1e-3)
