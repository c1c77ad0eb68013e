"""Bad input fails with a ValueError naming the offending value and the remedy, on every rank."""

import re

import pytest

import shardtrain as st
from tests.checkpoint.train_save_ranks import bad_inputs


def test_bad_inputs_are_reported(pools, tmp_path):
    messages = pools(2).run(bad_inputs, str(tmp_path))
    assert len(messages[0]) == len(messages[1]) == 14
    assert "rank 1 failed" in messages[0][6] and "rank 1 failed" not in messages[1][6]


def test_a_file_path_names_the_directory_to_pass(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "metadata.json").write_text("{}")  # its content is not read: the path is a file
    (tmp_path / "latest").write_text("ckpt\n")
    for file, what in (("metadata.json", "the metadata.json of a checkpoint"), ("latest", "a 'latest' pointer")):
        parent = directory if file == "metadata.json" else tmp_path
        path = parent / file
        expected = f"checkpoint path {path} is a file, {what}; pass its directory {parent}"
        with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
            st.load_checkpoint(path, {})
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="notes.txt is a file; pass a directory written by st.save_checkpoint"):
        st.load_checkpoint(tmp_path / "notes.txt", {})
