"""The automatic plan and the disk tier: weighed only when nothing fits with device and host memory.

Invented machines for Llama-3-8B on 2 devices, batch 1 x 4096, full_shard: the device alone needs
66.64 GiB per device at the least; everything offloaded needs 9.07 GiB on the device and 59.83 GiB
of host memory per process, 29.92 GiB of it the AdamW state that the disk tier moves to files.
"""

from dataclasses import replace

import pytest
import torch

import shardtrain as st
from shardtrain.models.llama import Block, Llama, llama_config
from shardtrain.planning.cost import machine
from shardtrain.planning.cost.auto import choose_plan
from shardtrain.planning.cost.candidates import predicted_time
from shardtrain.planning.cost.shard_auto import resolve_auto
from shardtrain.train.config import load_config
from shardtrain.train.planned_config import choice_overrides, resolve_auto_config

GiB = 1 << 30
EIGHT_B = [
    *("--model.name", "llama-8b", "--engine.accelerator", "cuda", "--engine.devices", "2"),
    *("--data.seq_len", "4096", "--train.batch_size", "2", "--engine.strategy", "auto"),
]


def _plan(device: str, host: str, disk_dir):
    return choose_plan(
        "8b",
        world_size=2,
        device_memory=device,
        host_memory=host,
        disk_dir=disk_dir,
        seq_len=4096,
        micro_batch=1,
        split_batch=False,
        strategies=("full_shard",),
    )


def test_fits_on_the_device_no_offload(tmp_path):
    choice = _plan("141GB", "40GiB", str(tmp_path))
    assert (choice.cpu_offload, choice.disk_dir) == (0.0, None)
    assert choice.shard_kwargs(None, wrap=None)["cpu_offload"] is False


def test_fits_with_host_offload_no_disk(tmp_path):
    choice = _plan("10GiB", "100GiB", str(tmp_path))
    assert (choice.cpu_offload, choice.disk_dir) == (1.0, None)
    assert choice.estimate.disk == 0 and choice.estimate.host <= 95 * GiB
    assert not any(r.startswith("disk tier") for r in choice.reasons)


def test_fits_only_with_the_disk_tier(tmp_path):
    choice = _plan("10GiB", "40GiB", str(tmp_path))
    assert (choice.cpu_offload, choice.disk_dir) == (1.0, str(tmp_path))
    assert choice.predicted_bytes <= choice.usable_memory
    # the optimizer state (8 of the 16 host bytes per parameter) is on disk; the host keeps the rest
    assert choice.estimate.disk == pytest.approx(29.92 * GiB, rel=1e-3)
    assert choice.estimate.host == pytest.approx(29.92 * GiB, rel=1e-3)
    (why,) = [r for r in choice.reasons if r.startswith("disk tier")]
    assert "nothing fits with device and host memory" in why and "59.83 GiB per process, 38.00 GiB usable" in why
    assert "optimizer state on disk" in str(choice).splitlines()[0]
    # its step: the state read and written once (29.92 GiB at 1.77 / 2.54 GB/s), longer than the rest
    disk_s = choice.estimate.disk / 1.77e9 + choice.estimate.disk / 2.54e9
    assert choice.step_time.disk_s == pytest.approx(disk_s) and choice.step_time.seconds == pytest.approx(disk_s)
    assert f"takes {disk_s:.1f} s per step" in why and choice.step_time.disk > 0
    offload = replace(choice, recompute_every=0).shard_kwargs(None, wrap=None)["cpu_offload"]  # (no blocks here)
    assert offload == st.CPUOffload(disk_dir=str(tmp_path))


def test_fits_nowhere_names_what_was_weighed(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"nothing fits in 10\.00 GiB per device \(9\.50 GiB usable with the 5% safety margin; weighed: "
        r"the device alone, CPU offload to the host, CPU offload with the optimizer state on disk in " + str(tmp_path),
    ):
        _plan("10GiB", "20GiB", str(tmp_path))
    # without a directory, the disk tier is one of the remedies
    with pytest.raises(ValueError, match=r"a disk directory for the offloaded optimizer state \(disk_dir="):
        _plan("10GiB", "40GiB", None)


def test_disk_tier_step_against_the_measured_row(tmp_path):
    """BENCHMARKS.md, 'Disk tier': 1.5B on one H200, batch 1 x 4096, every block checkpointed, all
    offloaded with 12.26 GB of AdamW state in files: the step measured 11.82 s."""
    policy = st.CPUOffload(disk_dir=str(tmp_path))
    estimate = st.estimate_memory("1.5b", world_size=1, seq_len=4096, activation_checkpointing=True, cpu_offload=policy)
    time = predicted_time(estimate, grad_accum=1)
    assert estimate.disk == pytest.approx(12.26e9, rel=1e-3)
    assert time.seconds == pytest.approx(11.82, rel=0.02) and time.disk_s == pytest.approx(time.seconds)


def test_shard_auto_takes_the_disk_directory_from_its_policy(tmp_path):
    """st.AutoPolicy(disk_dir=..., host_memory=...) as st.shard_auto passes it: st.shard gets the disk tier."""
    with torch.device("meta"):
        model = Llama(llama_config("8b", n_layers=16, vocab_size=8192))  # host: 26.5 GiB all offloaded
    policy = st.AutoPolicy(
        micro_batch=1, seq_len=4096, device_memory="10GiB", host_memory="24GiB", disk_dir=str(tmp_path)
    )
    choice = resolve_auto(
        model,
        world_size=2,
        micro_batch=policy.micro_batch,
        seq_len=policy.seq_len,
        wrap={Block},
        device_memory=policy.device_memory,
        host_memory=policy.host_memory,
        disk_dir=policy.disk_dir,
    )
    assert choice.shard_kwargs(model, wrap={Block})["cpu_offload"] == st.CPUOffload(disk_dir=str(tmp_path))


def test_train_config_keeps_offload_dir_only_for_the_disk_tier(tmp_path, monkeypatch):
    """--engine.strategy auto with --engine.offload_dir: the directory stays only when the plan needs the
    disk tier (host memory: this machine's share, here an invented 40 GiB); the ranks' overrides repeat it."""
    monkeypatch.setattr(machine, "local_device_memory", lambda **_: (40 * GiB, "an invented host"))
    asked = [*EIGHT_B, "--engine.offload_dir", str(tmp_path)]
    for device, expected in [(10 * GiB, str(tmp_path)), (int(141e9), None)]:
        resolved, choice = resolve_auto_config(load_config(None, asked), device_memory=device)
        assert resolved.engine.offload_dir == choice.disk_dir == expected
        assert bool(resolved.engine.cpu_offload) == (expected is not None)
        assert load_config(None, [*asked, *choice_overrides(resolved)]) == resolved
