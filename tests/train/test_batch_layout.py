"""Every batch a data source yields is dense and contiguous: the step pins batches on CUDA
(`Job.to_device`), and pinning an expanded view fails ("more than one element of the written-to tensor
refers to a single memory location"). Checked through `build_data`, the loop's own entry point, for the
byte corpus and for packed and unpacked rows, training and held-out batches alike."""

from types import SimpleNamespace

import pytest
import torch

from shardtrain.train.config import load_config
from shardtrain.train.inputs import build_data, plan_data
from tests.train.facts import chat_rows, llama_folder, write_jsonl

ENGINE = SimpleNamespace(
    data_parallel_rank=0, data_parallel_size=1, local_rank=0, rank_zero_first=lambda **_: _Nothing()
)


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _assert_dense(batch: dict[str, torch.Tensor]) -> None:
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    for name, t in batch.items():
        assert t.is_contiguous(), name
        assert t.stride() == (t.size(1), 1), (name, t.stride())
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name  # owns exactly its elements


def _check(cfg, module=None) -> None:
    plan = plan_data(cfg, module if module is not None else torch.nn.Identity())
    data = build_data(cfg, ENGINE, plan, micro_batch=2)
    for source in (data.train, data.held_out):
        for index in range(2):
            _assert_dense(source.batch(index))


def test_byte_corpus_batches_are_dense(tmp_path):
    corpus = tmp_path / "text"
    corpus.mkdir()
    for i in range(8):
        (corpus / f"f{i}.py").write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    cfg = load_config(
        None,
        [
            "--data.path",
            str(corpus),
            "--data.seq_len",
            "32",
            "--data.cache_dir",
            str(tmp_path / "c"),
            "--data.val_fraction",
            "0.25",
        ],
    )
    _check(cfg)


@pytest.mark.parametrize("packing", ["true", "false"])
def test_row_batches_are_dense(tmp_path, packing):
    pytest.importorskip("datasets")
    folder = llama_folder(tmp_path / "llama")
    rows = write_jsonl(chat_rows(), tmp_path / "chat.jsonl")
    cfg = load_config(
        None,
        [
            "--model.pretrained",
            str(folder),
            "--data.path",
            str(rows),
            "--data.seq_len",
            "64",
            "--data.packing",
            packing,
            "--data.cache_dir",
            str(tmp_path / "c"),
            "--data.val_fraction",
            "0.1",
        ],
    )
    _check(cfg)
