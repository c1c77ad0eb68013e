"""What a save may replace, what a load may follow, and what a crash while replacing a checkpoint
leaves behind. One process, no process group: the commit runs on rank 0 alone either way."""

import json
import os
from pathlib import Path

import pytest
import torch

import shardtrain as st
from shardtrain.checkpoint import commit
from shardtrain.checkpoint.tensorfile import FileRecord


class Counter:
    """A plain object with a state dict: what the commit bookkeeping needs, without a model."""

    def __init__(self, value: float = 0.0) -> None:
        self.value = torch.tensor([value])

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def save(path, step: int, **kwargs) -> Path:
    return st.save_checkpoint(path, {"counter": Counter(step), "step": step}, **kwargs)


def load(path) -> int:
    counter = Counter()
    step = st.load_checkpoint(path, {"counter": counter})["step"]
    assert counter.value.item() == step
    return step


def listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# ------------------------------------------------------------------------------------ what a save replaces
def test_a_folder_that_is_not_a_checkpoint_is_refused_and_kept(tmp_path):
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "notes.txt").write_text("do not lose me")
    with pytest.raises(
        ValueError,
        match=f"cannot save the checkpoint at {run}: it is an existing directory that "
        "is not a shardtrain checkpoint .* pass a new path",
    ):
        save(run, 1)
    assert listing(tmp_path) == ["run"] and listing(run) == ["logs", "notes.txt"]
    assert (run / "notes.txt").read_text() == "do not lose me"


def test_a_file_is_refused_and_kept(tmp_path):
    file = tmp_path / "ckpt"
    file.write_text("a file")
    with pytest.raises(ValueError, match=f"cannot save the checkpoint at {file}: it is an existing file"):
        save(file, 1)
    assert listing(tmp_path) == ["ckpt"] and file.read_text() == "a file"
    with pytest.raises(ValueError, match=f"cannot save the checkpoint {file / 'sub'}: {file} is a file"):
        save(file / "sub", 1)
    assert listing(tmp_path) == ["ckpt"]


def test_an_empty_folder_and_an_older_checkpoint_are_replaced(tmp_path):
    (tmp_path / "empty").mkdir()
    save(tmp_path / "empty", 1)
    save(tmp_path / "empty", 2)
    assert load(tmp_path / "empty") == 2 and listing(tmp_path) == ["empty", "latest"]


# ------------------------------------------------------------------------------------ a crash while replacing
class Crash(BaseException):
    """Stands for the process dying: no `except Exception` or cleanup on the way sees it."""


@pytest.mark.parametrize("point, survivor", [("aside", 1), ("renamed", 2), ("cleaned", 2)])
def test_a_crash_while_replacing_leaves_exactly_one_checkpoint(tmp_path, monkeypatch, point, survivor):
    run = tmp_path / "run"
    save(run / "last", 1)

    def crash(reached: str) -> None:
        if reached == point:
            raise Crash(point)

    monkeypatch.setattr(commit, "commit_hook", crash)
    with pytest.raises(Crash):
        save(run / "last", 2)
    monkeypatch.setattr(commit, "commit_hook", None)
    # The one complete checkpoint answers both to the folder (through `latest`) and to its own path.
    assert load(run) == load(run / "last") == survivor
    # The next save finishes or undoes the interrupted one, then commits; nothing else is left behind.
    save(run / "other", 3)
    assert listing(run) == ["last", "latest", "other"]
    assert load(run / "last") == survivor and load(run) == 3
    save(run / "last", 4)
    assert listing(run) == ["last", "latest", "other"] and load(run) == 4


def test_a_crash_before_the_pointer_moves_keeps_the_old_latest(tmp_path, monkeypatch):
    run = tmp_path / "run"
    save(run / "step2", 2)
    save(run / "step1", 1)
    save(run / "step2", 22)  # latest -> step2

    def crash(reached: str) -> None:
        if reached == "cleaned":
            raise Crash(reached)

    monkeypatch.setattr(commit, "commit_hook", crash)
    with pytest.raises(Crash):
        save(run / "step1", 11)  # re-saving an earlier step after resuming
    assert (run / "latest").read_text().strip() == "step2"
    assert load(run) == 22 and load(run / "step1") == 11


# ------------------------------------------------------------------------------------ what a load follows
@pytest.mark.parametrize("pointer", ["../..", "..", "/etc", "sub/step1", "", "escape"])
def test_latest_must_name_a_checkpoint_inside_the_folder(tmp_path, pointer):
    run = tmp_path / "run"
    save(tmp_path / "outside", 7)
    save(run / "step1", 1)
    (run / "sub").mkdir()
    save(run / "sub" / "step1", 5)
    (run / "escape").symlink_to(tmp_path / "outside")
    (run / "latest").write_text(pointer + "\n")
    with pytest.raises(
        ValueError,
        match=f"{run / 'latest'} names {pointer!r}, which is not a directory inside "
        f"{run}; .* fix the file or pass the checkpoint directory itself",
    ):
        load(run)
    assert load(run / "step1") == 1


def test_a_pickle_in_a_rank_file_is_refused_as_untrusted(tmp_path):
    path = save(tmp_path / "ckpt", 1)
    rank_file = path / "rank-00000.pt"
    torch.save({"objects": {"counter": {"value": Counter()}}, "rng": {}}, rank_file)  # a pickled class instance
    metadata = json.loads((path / "metadata.json").read_text())
    record = FileRecord.of(rank_file)
    metadata["files"]["rank-00000.pt"] = {"bytes": record.bytes, "sha256": record.sha256}
    (path / "metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(ValueError) as info:
        load(path)
    message = str(info.value)
    assert message == (
        f"{rank_file} holds a pickled {__name__}.Counter, where a checkpoint holds only tensors and "
        "primitives: the file is untrusted and cannot be loaded safely; load a checkpoint written by "
        "st.save_checkpoint"
    )
    assert "weights_only=False" not in message and "\n" not in message
    assert os.path.exists(rank_file)
