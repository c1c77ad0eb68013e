import numpy as np
import pytest
import torch

from shardtrain.data.pack import IGNORE
from shardtrain.train.data import ByteTokenizer, TokenBatches, build_cache, corpus_files, is_held_out, stdlib_root


def _batches(tokens, *, rank=0, world_size=1, seed=0, global_batch=8, seq_len=16, shuffle=True):
    return TokenBatches(
        tokens, seq_len=seq_len, global_batch=global_batch, rank=rank, world_size=world_size, seed=seed, shuffle=shuffle
    )


def _rows(batches, index):
    batch = batches.batch(index)
    inputs, targets = batch["input_ids"], batch["labels"]
    return [tuple(r) for r in inputs.tolist()], inputs, targets


def test_ranks_read_disjoint_parts_of_the_global_batch():
    tokens = np.arange(10_000, dtype=np.uint16)  # every window distinct
    single = _batches(tokens, world_size=1)
    parts = [_batches(tokens, rank=r, world_size=4) for r in range(4)]
    for index in range(5):
        per_rank = [_rows(b, index)[0] for b in parts]
        flat = [row for rows in per_rank for row in rows]
        assert len(set(flat)) == len(flat), "ranks overlap"
        assert flat == _rows(single, index)[0], "ranks together must read exactly the global batch"
    seen = [row for index in range(5) for b in parts for row in _rows(b, index)[0]]
    assert len(set(seen)) == len(seen), "no window is read twice within an epoch"


def test_targets_are_inputs_shifted_by_one():
    tokens = np.arange(1000, dtype=np.uint16)
    _, inputs, targets = _rows(_batches(tokens), 3)
    assert inputs.dtype == torch.int64 and inputs.shape == (8, 16)
    assert (targets[:, :-1] == inputs[:, 1:]).all()


def test_order_is_deterministic_by_seed():
    tokens = np.arange(50_000, dtype=np.uint16)
    a, b, c = _batches(tokens, seed=1), _batches(tokens, seed=1), _batches(tokens, seed=2)
    assert all(_rows(a, i)[0] == _rows(b, i)[0] for i in range(4))
    assert any(_rows(a, i)[0] != _rows(c, i)[0] for i in range(4))
    # Random access (as after a resume) gives the same batch as reading in order.
    assert _rows(_batches(tokens, seed=1), 3)[0] == _rows(a, 3)[0]


def test_new_epoch_is_a_new_permutation():
    tokens = np.arange(16 * 16 + 1, dtype=np.uint16)  # exactly 16 windows = 2 batches per epoch
    b = _batches(tokens)
    epoch0 = sorted(_rows(b, 0)[0] + _rows(b, 1)[0])
    epoch1 = sorted(_rows(b, 2)[0] + _rows(b, 3)[0])
    assert epoch0 == epoch1 and len(set(epoch0)) == 16


def test_eval_reads_in_order():
    tokens = np.arange(1000, dtype=np.uint16)
    _, inputs, _ = _rows(_batches(tokens, shuffle=False), 0)
    assert inputs[0, 0] == 0 and inputs[1, 0] == 16


def test_batch_must_split_over_ranks_and_fit_the_data():
    with pytest.raises(ValueError, match="multiple of the world size"):
        _batches(np.zeros(1000, np.uint8), world_size=3)
    with pytest.raises(ValueError, match="fewer than one batch"):
        _batches(np.zeros(100, np.uint8))
    with pytest.raises(ValueError, match="held-out data .*none to evaluate; .* or --data.val_fraction 0"):
        _batches(np.zeros(16, np.uint8), shuffle=False)


@pytest.mark.parametrize("world_size", [1, 2])
def test_held_out_windows_are_read_once_and_a_partial_batch_is_padded(world_size):
    """5 held-out windows in batches of 4: two batches on every rank, the second with 1 real row; the
    padding rows train nothing, so every rank runs the same forwards and no window counts twice."""
    tokens = np.arange(5 * 16 + 1, dtype=np.uint16)
    parts = [_batches(tokens, rank=r, world_size=world_size, global_batch=4, shuffle=False) for r in range(world_size)]
    assert [b.held_out_batches(0) for b in parts] == [2] * world_size
    assert [b.held_out_batches(1) for b in parts] == [1] * world_size
    real = []
    for index in range(2):
        for b in parts:
            batch = b.batch(index)
            assert batch["input_ids"].shape == (4 // world_size, 16)
            for inputs, labels in zip(batch["input_ids"], batch["labels"]):
                if (labels == IGNORE).all():
                    continue
                assert (labels[:-1] == inputs[1:]).all()
                real.append(int(inputs[0]))
    assert real == [0, 16, 32, 48, 64]  # each window once, in order


def _corpus(tmp_path, n=40):
    root = tmp_path / "corpus"
    (root / "pkg").mkdir(parents=True)
    for i in range(n):
        (root / "pkg" / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i}\n" * 20)
    (root / "notes.txt").write_text("not python")
    return root


def test_cache_split_and_reuse(tmp_path):
    root, files = corpus_files(str(_corpus(tmp_path)), "**/*.py")
    assert len(files) == 40 and all(f.suffix == ".py" for f in files)
    kwargs = dict(
        root=root,
        files=files,
        val_fraction=0.2,
        cache_dir=str(tmp_path / "cache"),
        tokenizer=ByteTokenizer(),
        progress=False,
    )
    cache = build_cache(**kwargs)
    assert cache.tokens.dtype == np.uint8
    total = sum(f.stat().st_size for f in files)
    held = [f for f in files if is_held_out(f.relative_to(root).as_posix(), 0.2)]
    assert len(cache.tokens) == total and len(cache.held_out) == sum(f.stat().st_size for f in held) > 0
    text = ByteTokenizer().decode(cache.train[:40])
    assert text.startswith("def f")
    stamp = next((tmp_path / "cache").glob("*.uint8")).stat().st_mtime_ns
    again = build_cache(**kwargs)  # same corpus: read from the cache, not rewritten
    assert next((tmp_path / "cache").glob("*.uint8")).stat().st_mtime_ns == stamp
    assert np.array_equal(again.tokens, cache.tokens)
    (root / "pkg" / "m0.py").write_text("changed\n")  # an edited corpus is tokenized anew
    assert len(list((tmp_path / "cache").glob("*.uint8"))) == 1
    build_cache(**{**kwargs, "files": corpus_files(str(root), "**/*.py")[1]})
    assert len(list((tmp_path / "cache").glob("*.uint8"))) == 2


def _byte_cache(root, files, tmp_path, *, val_fraction):
    return build_cache(
        root=root,
        files=files,
        val_fraction=val_fraction,
        cache_dir=str(tmp_path / "cache"),
        tokenizer=ByteTokenizer(),
        progress=False,
    )


@pytest.mark.parametrize("names", [["one.txt"], ["a.txt", "b.txt"]])
def test_too_few_files_split_by_tokens(tmp_path, names):
    """A single file (or files that all hash to one side) holds out the last val_fraction of its tokens."""
    texts = [(f"line {i} of {name}\n" * 50) for i, name in enumerate(names)]
    for name, text in zip(names, texts):
        (tmp_path / name).write_text(text)
    path = tmp_path / names[0] if len(names) == 1 else tmp_path
    root, files = corpus_files(str(path), "*.txt")
    assert all(is_held_out(f.relative_to(root).as_posix(), 0.1) is False for f in files)
    cache = _byte_cache(root, files, tmp_path, val_fraction=0.1)
    stream = "".join(texts).encode()
    assert len(cache.tokens) == len(stream) and len(cache.held_out) == int(len(stream) * 0.1)
    assert bytes(cache.train) + bytes(cache.held_out) == stream


def test_a_split_that_holds_out_nothing_names_the_fix(tmp_path):
    (tmp_path / "tiny.txt").write_text("short\n")
    root, files = corpus_files(str(tmp_path / "tiny.txt"), "*")
    with pytest.raises(
        ValueError,
        match=r"data.val_fraction=0.1 of the 6 tokens in the 1 file\(s\) of .* holds out "
        "no token; use more text or a larger --data.val_fraction",
    ):
        _byte_cache(root, files, tmp_path, val_fraction=0.1)


def test_val_fraction_0_holds_out_nothing(tmp_path):
    """Even a single file (split by tokens otherwise): every token trains."""
    (tmp_path / "one.txt").write_text("a line of text\n" * 50)
    root, files = corpus_files(str(tmp_path / "one.txt"), "*")
    cache = _byte_cache(root, files, tmp_path, val_fraction=0)
    assert len(cache.held_out) == 0 and bytes(cache.train) == b"a line of text\n" * 50


def test_corpus_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="does not exist.*leave data.path unset"):
        corpus_files(str(tmp_path / "missing"), "**/*.py")
    with pytest.raises(ValueError, match="--data.pattern"):
        corpus_files(str(_corpus(tmp_path)), "**/*.rs")


def test_default_corpus_is_the_stdlib_without_site_packages():
    root, files = corpus_files(None, "**/*.py")
    assert root == stdlib_root() and len(files) > 500
    names = {f.relative_to(root).as_posix() for f in files}
    assert "os.py" in names and not any("site-packages" in n for n in names)
