"""`shardtrain train --model.pretrained`: the acceptance round trip, LoRA with adapter-only checkpoints,
resume and merged export, and the option checks."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardtrain import cli
from shardtrain.train.config import load_config
from shardtrain.train.finetune import check_finetune_config
from shardtrain.train.model_builder import build_model
from tests.train.test_cli import _train_on

pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]


def _shardtrain(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [sys.executable, "-m", "shardtrain", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr
    return run


def _common(tmp_path: Path, folder: Path) -> list[str]:
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(2000)))
    return [
        "train",
        "--model.pretrained",
        str(folder),
        "--data.path",
        str(text),
        "--data.seq_len",
        "32",
        "--train.batch_size",
        "4",
        "--train.eval_batches",
        "1",
        "--run.progress",
        "false",
        "--data.cache_dir",
        str(tmp_path / "cache"),
        "--run.out_dir",
        str(tmp_path / "runs"),
    ]


@pytest.mark.slow  # one 2-rank run (on the pool, through cli.main: the LoRA runs below launch) and a conversion
def test_one_step_at_lr_0_then_convert_gives_back_the_pretrained_weights(pools, tmp_path, hf_folders):
    folder = hf_folders["llama_tied"]
    train = [*_common(tmp_path, folder)[1:], "--train.steps", "1", "--optim.lr", "0", "--run.checkpoint_every", "1"]
    out = _train_on(pools(2), [*train, "--run.name", "acc"])
    assert f"loaded 20 tensors from {folder}" in out and "LlamaForCausalLM" in out
    # In this process (as tests/checkpoint/test_full.py converts): a fresh one would import torch again.
    convert = ["convert", str(tmp_path / "runs" / "acc" / "checkpoints"), str(tmp_path / "out"), "--hf-config"]
    assert cli.main([*convert, str(folder)]) == 0
    original, converted = load_file(folder / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert all(torch.equal(converted[k], v) for k, v in original.items())
    assert set(converted) - set(original) == {"lm_head.weight"}  # convert writes tied weights under every name


def _records(run_dir: Path) -> list[dict]:
    keys = ("kind", "step", "loss", "lr", "grad_norm", "eval_loss")
    return [
        {k: r.get(k) for k in keys}
        for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if r["kind"] in ("train", "eval")
    ]


@pytest.mark.slow  # a 2-process run and its resume on the pool
def test_lora_trains_adapters_only_resumes_exactly_and_exports_merged(pools, tmp_path, hf_folders):
    from transformers import AutoModelForCausalLM

    folder = hf_folders["llama_untied"]
    lora = [
        *_common(tmp_path, folder),
        "--lora.rank",
        "8",
        "--lora.alpha",
        "16",
        "--lora.targets",
        "q_proj,v_proj",
        "--lora.dropout",
        "0.1",
        "--train.steps",
        "4",
        "--run.checkpoint_every",
        "2",
        "--train.log_every",
        "1",
        "--train.eval_every",
        "2",
        "--optim.lr",
        "1e-2",
        "--optim.warmup_steps",
        "1",
    ]
    run = _shardtrain(*lora, "--run.name", "lora", "--run.export_hf", "true", "--lora.merge_on_export", "true")
    run_dir = tmp_path / "runs" / "lora"
    assert "8 adapter parameters keep peft's initialisation" in run.stdout and f"{run_dir / 'hf'}" in run.stdout
    metadata = json.loads((run_dir / "checkpoints" / "step_000002" / "metadata.json").read_text())
    assert metadata["modules"]["model"]["saved"] == "trainable" and len(metadata["modules"]["model"]["params"]) == 8
    saved = {p["fqn"] for p in metadata["modules"]["model"]["params"]}
    assert set(metadata["optimizers"]["optimizer"]["state"]) == saved  # the optimizer holds the adapters only

    # The resume on the pool through cli.main (the first run above is the launch).
    _train_on(pools(2), [*lora[1:], "--run.name", "resumed", "--resume", str(run_dir / "checkpoints" / "step_000002")])
    replay = _records(tmp_path / "runs" / "resumed")
    original = [
        r
        for r in _records(run_dir)
        if (r["kind"] == "train" and r["step"] > 2) or (r["kind"] == "eval" and r["step"] >= 2)
    ]
    assert replay == original and len(replay) == 4  # eval at 2, train 3 and 4, eval at 4

    merged = AutoModelForCausalLM.from_pretrained(run_dir / "hf").state_dict()
    base = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert set(merged) == set(base)
    changed = {k for k in base if not torch.equal(merged[k], base[k])}
    assert changed == {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qv"}


def test_hf_config_beside_weights_says_it_trains_from_random_initialisation(hf_folders):
    folder = hf_folders["llama_tied"]
    built = build_model(
        load_config(None, ["--model.name", "hf", "--model.hf_config", str(folder)]).model, init_context=None
    )
    assert built.notice == (
        f"model.hf_config {folder} sits beside weights (model.safetensors); training starts from "
        f"random initialisation, as model.hf_config asks: pass --model.pretrained {folder} to "
        "fine-tune from them"
    )


def test_pretrained_builds_on_meta_and_names_bad_folders(hf_folders, tmp_path):
    built = build_model(load_config(None, ["--model.pretrained", str(hf_folders["gpt2"])]).model, init_context=None)
    assert all(p.is_meta for p in built.module.parameters()) and "GPT2LMHeadModel" in built.description
    (tmp_path / "config.json").write_text((hf_folders["gpt2"] / "config.json").read_text())
    with pytest.raises(
        ValueError,
        match=f"^model.pretrained='{tmp_path}' does not build: {tmp_path} holds a config.json but no model.safetensors",
    ):
        build_model(load_config(None, ["--model.pretrained", str(tmp_path)]).model, init_context=None)
    weights_only = tmp_path / "weights_only"
    weights_only.mkdir()
    (weights_only / "model.safetensors").write_bytes((hf_folders["gpt2"] / "model.safetensors").read_bytes())
    with pytest.raises(
        ValueError,
        match=f"^model.pretrained='{weights_only}' does not build: {weights_only} is not a "
        "Hugging Face model folder with a config.json",
    ):
        build_model(load_config(None, ["--model.pretrained", str(weights_only)]).model, init_context=None)
    with pytest.raises(ValueError, match=r"does not build: it is a Hub model id, .* \(hf download org/name\)"):
        build_model(load_config(None, ["--model.pretrained", "org/name"]).model, init_context=None)  # shardtrain plan
    with pytest.raises(ValueError, match="drop --model.name llama-tiny"):
        build_model(
            load_config(None, ["--model.pretrained", str(hf_folders["gpt2"]), "--model.name", "llama-tiny"]).model,
            init_context=None,
        )


@pytest.mark.parametrize(
    "args,message",
    [
        (["--lora.rank", "8"], "lora.rank=8 trains adapters over pretrained weights; pass --model.pretrained DIR"),
        (["--model.pretrained", "x", "--lora.merge_on_export", "true"], "lora.merge_on_export=true merges LoRA"),
        (["--run.export_hf", "true"], "run.export_hf=true writes a Hugging Face folder, but model.name='llama-2m'"),
        (["--model.pretrained", "x", "--lora.load_in_4bit", "true"], "lora.base_bits=4 quantises the frozen base"),
        (
            ["--model.pretrained", "x", "--lora.rank", "8", "--engine.tp", "2"],
            "lora.rank=8 with engine.tp=2: tensor parallelism does not split LoRA adapters",
        ),
    ],
)
def test_option_combinations_that_cannot_work(args, message):
    with pytest.raises(ValueError, match=message):
        check_finetune_config(load_config(None, args))


def test_qlora_trains_over_a_4bit_base_and_exports_merged(pools, tmp_path, hf_folders):
    """--lora.base_bits 4 on 2 ranks through cli.main: the adapters train over the NF4 base and the merged
    export is a plain folder of the model's own names, every adapted projection changed."""
    from transformers import AutoModelForCausalLM

    folder = hf_folders["llama_untied"]
    merged = AutoModelForCausalLM.from_pretrained(_qlora_merged_export(pools, tmp_path, folder)).state_dict()
    base = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    assert set(merged) == set(base) and merged["model.layers.0.mlp.up_proj.weight"].dtype == torch.float32
    quantised = {k for k in base if not torch.equal(merged[k], base[k])}
    linear = {f"model.layers.{i}.{p}.weight" for i in range(2) for p in _PROJECTIONS}
    assert quantised == linear  # the quantised projections (dequantised), not the head, norms or embedding


_PROJECTIONS = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]


def _qlora_merged_export(pools, tmp_path: Path, folder: Path) -> Path:
    """2 QLoRA steps (rank 8, base_bits 4) over `folder` on 2 ranks through cli.main; the merged export's folder."""
    pytest.importorskip("torchao")
    args = [*_common(tmp_path, folder)[1:], "--lora.rank", "8", "--lora.base_bits", "4", "--train.steps", "2"]
    args += ["--optim.lr", "1e-2", "--run.export_hf", "true", "--lora.merge_on_export", "true", "--run.name", "q"]
    out = _train_on(pools(2), args)
    assert "a 4-bit (NF4)" in out and f"loaded 21 tensors from {folder}" in out, out
    return tmp_path / "runs" / "q" / "hf"


def test_qlora_over_a_folder_quantised_by_bitsandbytes_exports_a_plain_folder(pools, tmp_path, bnb_folders):
    """--model.pretrained of a bitsandbytes NF4 folder (as the Hub's *-bnb-4bit): QLoRA trains over its
    weights (dequantised, quantised again by torchao) and the merged export has no quantization_config: it
    reloads with from_pretrained as a plain model of the source's names, the unquantised tensors unchanged."""
    from transformers import AutoModelForCausalLM

    folder = bnb_folders["nf4_dq"]
    exported = _qlora_merged_export(pools, tmp_path, folder)
    assert "quantization_config" in json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in json.loads((exported / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(exported)
    assert all(type(m) is torch.nn.Linear for n, m in merged.named_modules() if n.endswith(("_proj", "lm_head")))
    state, bnb = merged.state_dict(), load_file(folder / "model.safetensors")
    assert set(state) == set(load_file(bnb_folders["source"] / "model.safetensors"))
    assert all(torch.equal(state[k], bnb[k].float()) for k in state if not k.endswith("_proj.weight"))


@pytest.mark.slow  # one 2-rank run on the pool, through cli.main, and a conversion in this process
def test_tensor_parallel_fine_tune_reads_each_ranks_block(pools, tmp_path, hf_folders):
    """--engine.tp 2 over pretrained weights: each rank loads its (dp, tp) block; one step at lr 0 then
    `convert` gives back the pretrained weights bit for bit (the model is untied: TP refuses tied ones)."""
    folder = hf_folders["llama_untied"]
    train = [*_common(tmp_path, folder)[1:], "--train.steps", "1", "--optim.lr", "0", "--run.checkpoint_every", "1"]
    out = _train_on(pools(2), [*train, "--run.name", "tp", "--engine.devices", "2", "--engine.tp", "2"])
    assert f"loaded 21 tensors from {folder}" in out and "tp 2" in out, out
    converted_dir = tmp_path / "out"
    convert = ["convert", str(tmp_path / "runs" / "tp" / "checkpoints"), str(converted_dir), "--hf-config"]
    assert cli.main([*convert, str(folder)]) == 0
    original, converted = load_file(folder / "model.safetensors"), load_file(converted_dir / "model.safetensors")
    assert set(converted) == set(original)
    assert all(torch.equal(converted[k], v) for k, v in original.items())
