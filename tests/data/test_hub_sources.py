"""Rows from where fine-tuners keep them: a Hub dataset repo's folder by its configs and splits, and a Hub
dataset id read from the HF cache with the network off or unreachable; each failure one line."""

import pytest

from shardtrain.data import DataSpec, prepare
from shardtrain.data.sources import is_structured, load_rows
from tests.data.hub_fixture import cache_snapshot, dataset_repo, offline_cache
from tests.data.tokenizers_fixture import train_tokenizer

pytest.importorskip("datasets")


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """(repo folder, hub cache): the repo also cached as 'org/name', the network off."""
    rows = {
        split: [{"text": f"{split} {i}"} for i in range(n)] for split, n in (("train", 5), ("test", 3), ("other", 7))
    }
    parts = {"default": {"train": rows["train"], "test": rows["test"]}, "other": {"train": rows["other"]}}
    repo = dataset_repo(tmp_path / "repo", parts)
    cache = offline_cache(monkeypatch, tmp_path / "home")
    cache_snapshot(cache, kind="dataset", repo_id="org/name", folder=repo)
    return repo, cache


def _texts(source: str, tmp_path, **part) -> list[str]:
    return load_rows(source, cache_dir=str(tmp_path / "cache"), **part)["text"]


@pytest.mark.parametrize("by", ["folder", "id"])
def test_each_config_and_split_loads_alone(hub, tmp_path, by):
    source = str(hub[0]) if by == "folder" else "org/name"
    assert is_structured(source)
    assert _texts(source, tmp_path) == [f"train {i}" for i in range(5)]  # not the test or 'other' files too
    assert _texts(source, tmp_path, split="test") == [f"test {i}" for i in range(3)]
    assert _texts(source, tmp_path, config="other") == [f"other {i}" for i in range(7)]


def test_an_unreachable_hub_falls_back_to_the_cache(hub, tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens: connection refused
    assert _texts("org/name", tmp_path, config="other") == [f"other {i}" for i in range(7)]
    with pytest.raises(ValueError) as missing:
        _texts("org/missing", tmp_path)
    message = str(missing.value)
    assert "data.path='org/missing': not a local path; the Hub could not be reached (" in message
    assert f"not in the HF cache at {hub[1]}; check the network and download it once" in message
    assert "\n" not in message


def test_the_cache_keys_the_config_and_split(hub, tmp_path):
    tok = train_tokenizer([f"{w} {i}" for w in ("train", "test", "other") for i in range(9)], vocab_size=300)

    def rows(**part) -> int:
        spec = DataSpec(path="org/name", seq_len=16, train_on="all", **part)
        return prepare(spec, tokenizer=tok, cache_dir=str(tmp_path / "tok"), progress=False).stats.rows

    assert [rows(), rows(split="test"), rows(config="other"), rows()] == [5, 3, 7, 5]


def test_each_mistake_is_one_line_naming_it_and_the_fix(hub, tmp_path):
    repo, cache = hub
    single = repo / "default" / "train-00000-of-00001.jsonl"
    cases = [
        (
            dict(source="org/missing"),
            f"data.path='org/missing': not a local path; offline (HF_HUB_OFFLINE=1), so only the HF cache was "
            f"searched, and the dataset is not in the HF cache at {cache}; download it once with network "
            "(HF_HUB_OFFLINE unset), or pass a local file or folder",
        ),
        (dict(source="org/name", revision="v1"), "the dataset at revision 'v1' is not in the HF cache"),
        (dict(source=str(repo), config="nope"), "it has configs ['default', 'other']: pick them with --data.config"),
        (dict(source="org/name", split="nope"), "it has splits ['train', 'test'] (configs ['default', 'other'])"),
        (dict(source=str(repo), revision="v1"), "is a local path; drop --data.revision"),
        (dict(source=str(single), config="other"), "is a single file, read whole; drop --data.config"),
        (dict(source="rows.jsonl"), "data.path='rows.jsonl' does not exist; pass an existing file or folder, or a Hub"),
    ]
    for case, expected in cases:
        with pytest.raises(ValueError) as error:
            _texts(case.pop("source"), tmp_path, **case)
        assert expected in str(error.value) and "\n" not in str(error.value), str(error.value)
