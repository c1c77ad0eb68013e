"""Hugging Face Hub ids -> local snapshot folders: downloaded where there is a network, else the HF cache.

`--data.path org/name` and `--model.pretrained org/name` name a Hub repository when they are not a
local path. huggingface_hub's `snapshot_download` fetches the repository (a model: only its config,
tokenizer and safetensors weights) into the HF cache (~/.cache/huggingface/hub, or HF_HUB_CACHE /
HF_HOME) and returns its snapshot folder, so the rest of shardtrain keeps reading a folder. Offline
(HF_HUB_OFFLINE=1) or where the Hub cannot be reached, it answers from that cache alone. Every failure
is one ValueError line naming the id, what was tried (the network, the cache) and the fix.
"""

from __future__ import annotations

from pathlib import Path

from .deps import first_line, require

# What a model needs to be built, tokenized and loaded: no pickled .bin weights, no other formats.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab*",
    "merges.txt",
    "chat_template*",
)
# A name ending in one of these is a (missing) local file, never a Hub id.
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv", ".txt", ".safetensors")


def is_hub_id(spec: str | None) -> bool:
    """Whether `spec` names a Hub repository ('org/name'): not a local path, one '/', a valid repo id,
    and not named like a data or weights file."""
    if spec is None or Path(spec).expanduser().exists() or spec.count("/") != 1:
        return False
    if spec.startswith((".", "/", "~")) or spec.lower().endswith(_FILE_SUFFIXES):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def hub_snapshot(
    repo_id: str,
    *,
    kind: str,
    key: str,
    revision: str | None = None,
    allow_patterns: tuple[str, ...] | None = None,
    local: str,
) -> Path:
    """The local snapshot folder of Hub repository `repo_id` (`kind`: 'dataset' or 'model'), downloaded
    or found in the HF cache; ValueError naming `key`, what was tried and the fix (`local`: what local
    path the user may pass instead)."""
    hub = require("huggingface_hub", why=f"{key}={repo_id!r} (a Hub {kind} id)")
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{key}={repo_id!r}: not a local path"
    cache = constants.HF_HUB_CACHE
    instead = f"or pass a local {local}"
    try:
        return Path(
            hub.snapshot_download(
                repo_id,
                repo_type=kind,
                revision=revision,
                allow_patterns=None if allow_patterns is None else list(allow_patterns),
            )
        )
    except GatedRepoError:
        raise ValueError(
            f"{where}; the Hub {kind} {repo_id} is gated: accept its terms on its Hub page and log in "
            f"(hf auth login), {instead}"
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"{where}; the Hub has no {kind} by that id (or it is private: log in with hf auth login); check "
            f"the id, {instead}"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(
            f"{where}; the Hub {kind} has no revision {revision!r}; pass an existing branch, tag or commit {instead}"
        ) from None
    except HfHubHTTPError as exc:
        raise ValueError(
            f"{where}; the Hub refused it ({first_line(exc)}); log in with hf auth login, {instead}"
        ) from None
    except IncompleteSnapshotError as exc:
        raise ValueError(
            f"{where}; the Hub could not be reached and its snapshot in the HF cache at {cache} is incomplete "
            f"({first_line(exc)}); download it again with network, {instead}"
        ) from None
    except LocalEntryNotFoundError as exc:
        cause = exc.__cause__
        if constants.HF_HUB_OFFLINE or isinstance(cause, OfflineModeIsEnabled):
            tried = "offline (HF_HUB_OFFLINE=1), so only the HF cache was searched"
            fix = "download it once with network (HF_HUB_OFFLINE unset)"
        else:
            tried = f"the Hub could not be reached ({first_line(cause or exc)})"
            fix = "check the network and download it once"
        revision_part = f" at revision {revision!r}" if revision else ""
        raise ValueError(
            f"{where}; {tried}, and the {kind}{revision_part} is not in the HF cache at {cache}; {fix}, {instead}"
        ) from None


def resolve_model_source(spec: str, *, key: str = "model.pretrained") -> Path:
    """The local folder of `spec`: a local path as given, a Hub model id its snapshot (the files of
    MODEL_FILES only); ValueError naming the id, what was tried and the fix."""
    if not is_hub_id(spec):
        return Path(spec).expanduser()
    return hub_snapshot(spec, kind="model", key=key, allow_patterns=MODEL_FILES, local="model folder")
