"""Hub repositories built in the test, nothing downloaded: a dataset repo's folder (README.md with
`configs:` front matter, a data file per config and split), a model or dataset placed in the HF hub
cache's layout (blobs, snapshots/<sha> of links to them, refs/main), and the offline environment
that makes huggingface_hub read only that cache."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import yaml


def dataset_repo(root: Path, parts: dict[str, dict[str, list[dict]]]) -> Path:
    """A Hub dataset repo's folder: `parts` is {config: {split: rows}}, each split one file
    <config>/<split>-00000-of-00001.jsonl, listed in README.md's `configs:` front matter (the first
    config the default)."""
    configs = []
    for n, (config, splits) in enumerate(parts.items()):
        files = [{"split": split, "path": f"{config}/{split}-*.jsonl"} for split in splits]
        configs.append({"config_name": config, **({"default": True} if n == 0 else {}), "data_files": files})
        (root / config).mkdir(parents=True, exist_ok=True)
        for split, rows in splits.items():
            text = "".join(json.dumps(row) + "\n" for row in rows)
            (root / config / f"{split}-00000-of-00001.jsonl").write_text(text)
    (root / "README.md").write_text(f"---\n{yaml.safe_dump({'configs': configs})}---\n# Made in the test\n")
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
