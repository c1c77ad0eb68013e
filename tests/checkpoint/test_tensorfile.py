"""The streaming writer produces files the safetensors library reads; readers catch damage."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from shardtrain.checkpoint.tensorfile import CheckpointFiles, FileRecord, SafetensorsWriter, TensorSpec, read_flat

TENSORS = {
    "w": torch.randn(5, 3),
    "half": torch.randn(7).to(torch.bfloat16),
    "mask": torch.tensor([True, False, True]),
    "step": torch.tensor(3.0),
    "empty": torch.zeros(0, 4),
    "ids": torch.arange(10, dtype=torch.int64).view(2, 5),
    # a gathered one-row parameter: a one-element view of stride 29, which `contiguous()` keeps as is
    "strided": torch.arange(58.0).view(2, 29)[:, 3:4].reshape(2)[:1],
    "column": torch.arange(12.0).view(4, 3)[:, 1],
}


def _write(path):
    specs = [TensorSpec(name=n, dtype=t.dtype, shape=tuple(t.shape)) for n, t in TENSORS.items()]
    writer = SafetensorsWriter(path, specs)
    for name, tensor in TENSORS.items():
        writer.write(name, tensor)
    return writer.close()


def test_written_file_is_standard_safetensors(tmp_path):
    record = _write(tmp_path / "x.safetensors")
    assert record == FileRecord.of(tmp_path / "x.safetensors")
    loaded = load_file(tmp_path / "x.safetensors")
    assert loaded.keys() == TENSORS.keys()
    for name, tensor in TENSORS.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        for start, numel in [(0, 15), (4, 7), (14, 1), (6, 0)]:
            assert torch.equal(read_flat(f, "w", start, numel), TENSORS["w"].reshape(-1)[start : start + numel])
        assert torch.equal(read_flat(f, "step", 0, 1), TENSORS["step"].reshape(-1))


def test_writer_refuses_tensors_out_of_order(tmp_path):
    writer = SafetensorsWriter(tmp_path / "x.safetensors", [TensorSpec(name="a", dtype=torch.float32, shape=(2,))])
    with pytest.raises(RuntimeError, match="expected tensor 'a'"):
        writer.write("b", torch.zeros(2))


def test_files_are_checked_before_use(tmp_path):
    record = _write(tmp_path / "x.safetensors")
    records = {"x.safetensors": {"bytes": record.bytes, "sha256": record.sha256}}
    with CheckpointFiles(tmp_path, records) as files:
        assert torch.equal(files.tensors("x.safetensors").get_tensor("w"), TENSORS["w"])
        with pytest.raises(ValueError, match="does not list y.safetensors"):
            files.tensors("y.safetensors")
    (tmp_path / "x.safetensors").write_bytes(b"\0" * record.bytes)
    with CheckpointFiles(tmp_path, records) as files, pytest.raises(ValueError, match="is corrupt: sha256"):
        files.tensors("x.safetensors")
