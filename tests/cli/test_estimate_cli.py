"""`shardtrain estimate` shows the model-state arithmetic behind its bill, one line per strategy."""

import argparse

from shardtrain.cli import estimate as cli_estimate


def _estimate(argv: list[str], capsys) -> list[str]:
    parser = argparse.ArgumentParser(prog="shardtrain")
    cli_estimate.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["estimate", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out.splitlines()


def _arithmetic(lines: list[str]) -> list[str]:
    start = next(i for i, line in enumerate(lines) if line.startswith("model states per device"))
    return lines[start:-1]


def test_model_states_are_16_bytes_per_param_over_the_shard(capsys):
    # 7B on 4 GPUs: 16 x 7e9 / 4 B = 26.08 GiB where a shard spans all 4, x4 for no_shard, x2 for groups of 2.
    lines = _arithmetic(_estimate(["--params", "7B", "--gpus", "4"], capsys))
    assert lines == [
        "model states per device = (4 B fp32 param + 4 B fp32 grad + 8 B adamw state = 16 B/param) x params / "
        "ranks per shard:",
        "  full_shard       16 B x 7B / 4 = 26.08 GiB",
        "  shard_grad_op    16 B x 7B / 4 = 26.08 GiB",
        "  optimizer_only   16 B x 7B / 4 = 26.08 GiB",
        "  no_shard         16 B x 7B / 1 = 104.31 GiB",
        "  hybrid_shard(2)  16 B x 7B / 2 = 52.15 GiB",
    ]
    assert 16 * 7e9 / 4 / 2**30 == 26.077032089233398 and 16 * 7e9 / 2**30 == 104.30812835693359


def test_other_optimizers_change_the_bytes_per_param(capsys):
    lines = _arithmetic(
        _estimate(["--model", "8b", "--gpus", "8", "--strategy", "full_shard", "--optimizer", "sgd"], capsys)
    )
    assert lines[0].startswith(
        "model states per device = (4 B fp32 param + 4 B fp32 grad + 4 B sgd state = 12 B/param)"
    )
    assert lines[1:] == [f"  full_shard  12 B x 8.03B / 8 = {12 * 8_030_261_248 / 8 / 2**30:.2f} GiB"]


def test_lora_on_a_hugging_face_folder(capsys, tmp_path):
    # Llama-3-8B's config.json: the bf16 base as stored (2 B/param, no gradient, no optimizer state) and
    # 16 B for each of the 3.41M adapter parameters
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, '
        '"vocab_size": 128256, "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": false}'
    )
    argv = ["--model", str(tmp_path), "--gpus", "1", "--strategy", "full_shard", "--lora-rank", "8"]
    lines = _estimate([*argv, "--device-memory", "141GB"], capsys)
    assert lines[0] == "llama 8.03B, LoRA r=8 on q_proj,v_proj: 8.03B parameters (dim 4096, 32 layers, 32 heads " + (
        "(8 kv), ffn 14336, vocab 128256)"
    )
    assert ["parameters", "(fp32", "master", "+", "frozen)", "14.97"] in [line.split() for line in lines]
    assert _arithmetic(lines) == [
        "model states per device = (4 B fp32 param + 4 B fp32 grad + 8 B adamw state = 16 B/param) x trainable "
        "params + 2 B x frozen params, / ranks per shard:",
        "  full_shard  (16 B x 3.41M + 2 B x 8.03B) / 1 = 15.01 GiB",
    ]
    assert "fits in 131.32 GiB: yes; largest micro-batch: 4" in lines


def test_the_disk_tier_shows_its_bytes_and_its_time_per_step(capsys, tmp_path):
    """--offload --offload-dir: 8 B of AdamW state per parameter and process in files (29.92 GiB at 8B over
    2 GPUs, twice that for no_shard), read and written once a step at 1.77 / 2.54 GB/s."""
    lines = _estimate(["--model", "8b", "--gpus", "2", "--offload", "--offload-dir", str(tmp_path)], capsys)
    (row,) = [line.split() for line in lines if line.startswith("disk tier, s per step (1.77 / 2.54 GB/s)")]
    seconds = 8 * 8_030_261_248 / 2 * (1 / 1.77e9 + 1 / 2.54e9)
    assert [float(x) for x in row[-4:]] == [round(seconds, 1)] * 3 + [round(2 * seconds, 1)]
    parser = argparse.ArgumentParser(prog="shardtrain")
    cli_estimate.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["estimate", "--model", "8b", "--gpus", "2", "--offload-dir", str(tmp_path)])
    assert args.func(args) == 2
    assert "without --offload: the disk tier holds offloaded optimizer state; add --offload" in capsys.readouterr().err
