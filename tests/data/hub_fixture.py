"""Hub repositories built in the test, nothing downloaded: a dataset repo's folder (README.md with
`configs:` front matter, data files under data/ and other/), a model or dataset placed in the HF hub
cache's layout (blobs, snapshots/<sha> of links to them, refs/main), and the offline environment
that makes huggingface_hub read only that cache."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

CARD = """---
configs:
- config_name: default
  default: true
  data_files:
  - split: train
    path: data/train-*.jsonl
  - split: test
    path: data/test-*.jsonl
- config_name: other
  data_files:
  - split: train
    path: other/train-*.jsonl
---
# A dataset made in the test
"""
ROWS = {
    "data/train-00000-of-00001.jsonl": 5,
    "data/test-00000-of-00001.jsonl": 3,
    "other/train-00000-of-00001.jsonl": 7,
}


def dataset_repo(root: Path) -> Path:
    """A Hub dataset repo's folder: config 'default' (train 5 rows 'train i', test 3 rows 'test i') and
    config 'other' (train 7 rows 'other i')."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "README.md").write_text(CARD)
    for name, n in ROWS.items():
        file = root / name
        file.parent.mkdir(parents=True, exist_ok=True)
        tag = name.split("/")[0].replace("data", name.split("/")[1].split("-")[0])
        file.write_text("".join(json.dumps({"text": f"{tag} {i}"}) + "\n" for i in range(n)))
    return root


def offline_cache(monkeypatch, home: Path) -> Path:
    """HF_HOME at `home`, the network off (HF_HUB_OFFLINE=1), in this process and its children; the hub cache."""
    import huggingface_hub.constants as constants

    cache = home / "hub"
    cache.mkdir(parents=True, exist_ok=True)
    for name, value in (("HF_HOME", home), ("HF_HUB_CACHE", cache), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def cache_snapshot(cache: Path, *, kind: str, repo_id: str, folder: Path) -> Path:
    """Copy `folder` into the hub cache as huggingface_hub lays a download out; the snapshot folder."""
    repo = cache / f"{kind}s--{repo_id.replace('/', '--')}"
    files = sorted(f for f in folder.rglob("*") if f.is_file())
    sha = hashlib.sha1("".join(str(f.relative_to(folder)) for f in files).encode()).hexdigest()
    snapshot = repo / "snapshots" / sha
    for file in files:
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, blob)
        link = snapshot / file.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, link.parent), link)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(sha)
    return snapshot
