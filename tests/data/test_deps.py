"""The default install trains the built-in model without datasets; a run that needs it says what to install."""

import subprocess
import sys

import pytest

from shardtrain.data.deps import require
from shardtrain.data.sources import load_rows


def test_the_training_loop_imports_neither_datasets_nor_transformers():
    code = "import sys, shardtrain.train.loop, shardtrain.data; print(sorted({'datasets', 'transformers'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"


def test_a_missing_datasets_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets now raises ModuleNotFoundError
    (tmp_path / "rows.jsonl").write_text('{"text": "hi"}\n')
    with pytest.raises(
        ValueError, match=r"^data.path='.*rows.jsonl' needs the datasets package: pip install 'shardtrain\[hf\]'$"
    ):
        load_rows(str(tmp_path / "rows.jsonl"))
    with pytest.raises(ValueError, match="needs the transformers package"):
        monkeypatch.setitem(sys.modules, "transformers", None)
        require("transformers", why="data.tokenizer='t'")
