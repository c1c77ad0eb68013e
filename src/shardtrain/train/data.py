"""Built-in data: byte-level tokens of a text corpus, cached once as a memory-mapped array.

Without a data path the corpus is the Python standard library's own `.py` sources, read from the
running interpreter: no download, present on every machine, tens of megabytes of real text.

Files are split into train and held-out by a stable hash of their path (so held-out text is never
seen in training, whatever the file order). A corpus of too few files for that (a single file, or
a handful that all hash to one side) is split by tokens instead: the last `val_fraction` of its
token stream is held out; `val_fraction` 0 holds out nothing. The token stream is cut into
non-overlapping windows of `seq_len + 1` tokens; each epoch visits them in an order drawn from the
seed. Sample `i` of the run is a pure function of (seed, i), and rank r of a micro-batch takes its
own contiguous slice of the global batch: ranks read disjoint data, and resuming at a step
reproduces exactly the same batches.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..data.batches import WindowOrder
from ..data.pack import IGNORE
from ..data.pipeline import cache_root

CACHE_VERSION = 1
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True, kw_only=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens: a vocabulary of 256, nothing to train or download."""

    vocab_size: int = 256

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, tokens) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every token id."""
    return np.dtype(np.uint8 if vocab_size <= 256 else np.uint16)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(path: str | None, pattern: str) -> tuple[Path, list[Path]]:
    """(root, files): the files of the corpus in a stable order. Raises ValueError with the fix."""
    if path is None:
        root = stdlib_root()
        files = [f for f in root.glob(pattern) if f.is_file() and not _SKIP_DIRS & set(f.relative_to(root).parts)]
    else:
        root = Path(path).expanduser()
        if not root.exists():
            raise ValueError(
                f"data.path={path!r} does not exist; pass an existing file or directory, "
                "or leave data.path unset to train on the Python standard library"
            )
        files = [root] if root.is_file() else [f for f in root.glob(pattern) if f.is_file()]
        root = root.parent if root.is_file() else root
    if not files:
        raise ValueError(
            f"no file under {str(root)!r} matches data.pattern={pattern!r}; "
            "set --data.pattern to a glob that matches your files (e.g. '**/*.txt')"
        )
    return root, sorted(files, key=lambda f: f.relative_to(root).as_posix())


def is_held_out(relpath: str, fraction: float) -> bool:
    """A stable, platform-independent choice of held-out files."""
    digest = int.from_bytes(hashlib.sha1(relpath.encode()).digest()[:8], "little")
    return digest / 2**64 < fraction


@dataclass(frozen=True, kw_only=True)
class TokenCache:
    """A tokenized corpus on disk: train tokens first, then held-out tokens."""

    tokens: np.ndarray  # memory-mapped, read-only
    num_train: int

    @property
    def train(self) -> np.ndarray:
        return self.tokens[: self.num_train]

    @property
    def held_out(self) -> np.ndarray:
        return self.tokens[self.num_train :]


def build_cache(
    *,
    root: Path,
    files: list[Path],
    val_fraction: float,
    cache_dir: str | None,
    tokenizer: ByteTokenizer,
    progress: bool,
) -> TokenCache:
    """Tokenize `files` (from `corpus_files`) into `cache_dir` unless an identical cache exists; return it
    memory-mapped.

    The cache key covers every file's path, size and modification time, the split and the
    tokenizer, so an edited corpus is re-tokenized. The file is written under a temporary name and
    renamed, so concurrent builders (one per node) never see a partial file.
    """
    rel = [f.relative_to(root).as_posix() for f in files]
    held = [is_held_out(r, val_fraction) for r in rel]
    by_tokens = val_fraction > 0 and (all(held) or not any(held))  # 0: every token trains
    if by_tokens:
        held = [False] * len(files)
    order = [i for i in range(len(files)) if not held[i]] + [i for i in range(len(files)) if held[i]]
    stats = [files[i].stat() for i in order]
    key = hashlib.sha256(
        json.dumps(
            [
                CACHE_VERSION,
                str(root),
                val_fraction,
                by_tokens,
                tokenizer.vocab_size,
                [(rel[i], s.st_size, s.st_mtime_ns) for i, s in zip(order, stats)],
            ]
        ).encode()
    )
    dtype = token_dtype(tokenizer.vocab_size)
    base = cache_root(cache_dir)
    target = base / f"tokens-{key.hexdigest()[:16]}.{dtype.name}"
    meta = target.with_suffix(".json")
    if not (target.exists() and meta.exists()):
        base.mkdir(parents=True, exist_ok=True)
        num_train = _write_tokens(
            target,
            [files[i] for i in order],
            held=[held[i] for i in order],
            tokenizer=tokenizer,
            dtype=dtype,
            total=sum(s.st_size for s in stats),
            progress=progress,
        )
        if by_tokens:
            num_train = _token_split(num_train, val_fraction, root=root, files=len(files))
        tmp_meta = meta.with_suffix(f".tmp{os.getpid()}")
        tmp_meta.write_text(json.dumps({"num_train": num_train, "root": str(root), "files": len(files)}))
        os.replace(tmp_meta, meta)
    num_train = json.loads(meta.read_text())["num_train"]
    return TokenCache(tokens=np.memmap(target, dtype=dtype, mode="r"), num_train=num_train)


def _token_split(total: int, val_fraction: float, *, root: Path, files: int) -> int:
    """Training tokens when the last `val_fraction` of `total` tokens is held out."""
    held = int(total * val_fraction)
    if held < 1:
        raise ValueError(
            f"data.val_fraction={val_fraction} of the {total} tokens in the {files} file(s) of "
            f"{str(root)!r} holds out no token; use more text or a larger --data.val_fraction"
        )
    return total - held


def _write_tokens(
    target: Path,
    files: list[Path],
    *,
    held: list[bool],
    tokenizer: ByteTokenizer,
    dtype: np.dtype,
    total: int,
    progress: bool,
) -> int:
    """Stream every file's tokens (each file ending with a newline) into `target`; return #train tokens."""
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    num_train = 0
    with (
        open(tmp, "wb") as out,
        tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not progress, leave=False) as bar,
    ):
        for f, is_held in zip(files, held):
            data = f.read_bytes()
            bar.update(len(data))
            if not data.endswith(b"\n"):
                data += b"\n"
            tokens = tokenizer.encode(data).astype(dtype, copy=False)
            out.write(tokens.tobytes())
            if not is_held:
                num_train += len(tokens)
    os.replace(tmp, target)
    return num_train


class TokenBatches(WindowOrder):
    """Batches drawn from a token array for one rank, as the dict every step reads (data/batches.py):
    input_ids, labels (the next tokens: every one trained) and position_ids (0..seq_len-1).

    `batch(index)` returns the rank's slice of global micro-batch `index`: global sample
    `index * global_batch + j` for j in this rank's range. Training windows are visited in a
    per-epoch permutation drawn from `seed`; evaluation (`shuffle=False`) reads windows in order, each
    once, a partial last batch filled with padding rows (labels -100).
    """

    all_trained = True  # every training label is a real next token: the step knows its token count

    def __init__(self, tokens: np.ndarray, *, seq_len: int, global_batch: int, **order) -> None:
        num_windows = max(0, len(tokens) - 1) // seq_len
        holds = f"{len(tokens):,} tokens hold only {num_windows} sequences of {seq_len + 1} tokens"
        super().__init__(num_windows, holds=holds, global_batch=global_batch, **order)
        self.tokens = tokens
        self.seq_len = seq_len

    def batch(self, index: int) -> dict[str, torch.Tensor]:
        picked = self.windows_of(index)
        rows = np.zeros((self.per_rank, self.seq_len + 1), dtype=np.int64)
        for b, w in enumerate(picked):
            if w is not None:
                rows[b] = self.tokens[w * self.seq_len : w * self.seq_len + self.seq_len + 1]
        padding = torch.tensor([w is None for w in picked])  # held out, past the last window: nothing trained
        # Each tensor is built dense and contiguous: the step pins batches on CUDA, and pinning an
        # expanded or strided view fails (or copies).
        return {
            "input_ids": torch.from_numpy(np.ascontiguousarray(rows[:, :-1])),
            "labels": torch.from_numpy(np.ascontiguousarray(rows[:, 1:])).masked_fill(padding[:, None], IGNORE),
            "position_ids": torch.arange(self.seq_len).repeat(len(rows), 1),
        }
