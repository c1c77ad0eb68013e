"""Streamed windows: the cached path's in the same order mode, disjoint rank shares, exact resume, early first batch."""

import itertools
import json
import time

import pytest

from shardtrain.data import DataSpec, prepare
from shardtrain.data.encode import Encoder, Overlong, TrainOn
from shardtrain.data.formats import Format
from shardtrain.data.pipeline import PACK_GROUP
from shardtrain.data.stream import StreamBatches, stream_rows, stream_windows
from tests.data.tokenizers_fixture import train_tokenizer
from tests.train.facts import prompt_completion_rows, questions, write_jsonl

datasets = pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([q + " " + a for q, a in questions()], vocab_size=300)


def _jsonl(path, rows):
    return write_jsonl(rows, path)


def _rows(count: int) -> list[dict]:
    """`count` prompt/completion rows of varied lengths (every one shorter than a window)."""
    base = prompt_completion_rows()
    return [
        {**base[i % len(base)], "completion": base[i % len(base)]["completion"] + " x" * (i % 7)} for i in range(count)
    ]


def _encoder(tok, fmt=Format.PROMPT_COMPLETION, seq_len=64):
    return Encoder(tokenizer=tok, format=fmt, train_on=TrainOn.COMPLETION, seq_len=seq_len, overlong=Overlong.TRUNCATE)


def _windows(path, tok, *, rank=0, world_size=1, buffer=PACK_GROUP, shuffle=False, start=None):
    spec = DataSpec(path=str(path), seq_len=64)
    return stream_windows(
        lambda: stream_rows(spec, tokenizer=tok, cache_dir=None, rank=rank, world_size=world_size),
        encoder=_encoder(tok),
        buffer=buffer,
        packing=True,
        seed=3,
        shuffle=shuffle,
        where="test rows",
        start=start,
    )


def test_streamed_windows_are_the_cached_windows_in_the_same_order_mode(tmp_path, tok):
    path = _jsonl(tmp_path / "rows.jsonl", _rows(2 * PACK_GROUP + 300))  # three packing groups
    cached = prepare(
        DataSpec(path=str(path), seq_len=64), tokenizer=tok, cache_dir=str(tmp_path / "c"), num_proc=1, progress=False
    ).train
    streamed = list(itertools.islice(_windows(path, tok), len(cached) + 1))
    expected = list(zip(cached["input_ids"], cached["labels"], cached["position_ids"]))
    assert [w for w, _ in streamed[: len(cached)]] == expected
    assert streamed[-1][0] == expected[0]  # the second pass starts over
    assert streamed[len(cached) - 1][1].buffer == 2 and streamed[-1][1].passes == 1


def test_two_ranks_read_disjoint_rows_whose_union_is_every_row(tmp_path, tok):
    rows = [{"text": f"row number {i} " + "word " * (i % 5)} for i in range(101)]
    path = _jsonl(tmp_path / "text.jsonl", rows)
    spec = DataSpec(path=str(path), seq_len=64)
    shares = [
        [r["text"] for r in stream_rows(spec, tokenizer=tok, cache_dir=None, rank=r, world_size=2)] for r in (0, 1)
    ]
    assert not set(shares[0]) & set(shares[1])
    assert sorted(shares[0] + shares[1]) == sorted(r["text"] for r in rows)
    assert abs(len(shares[0]) - len(shares[1])) <= 1


def test_a_resumed_stream_serves_the_windows_the_uninterrupted_one_did(tmp_path, tok):
    path = _jsonl(tmp_path / "rows.jsonl", _rows(700))
    whole = list(itertools.islice(_windows(path, tok, buffer=100, shuffle=True), 400))
    for cut in (1, 57, 123, 299):  # inside buffers, and in the second pass
        position = whole[cut - 1][1]
        assert json.loads(json.dumps(position.rows)) == position.rows  # plain values, for the checkpoint
        resumed = list(itertools.islice(_windows(path, tok, buffer=100, shuffle=True, start=position), 400 - cut))
        assert [w for w, _ in resumed] == [w for w, _ in whole[cut:]], cut


def _batches(path, tok, *, state=None, count):
    spec = DataSpec(path=str(path), seq_len=64)
    batches = StreamBatches(
        lambda: stream_rows(spec, tokenizer=tok, cache_dir=None, rank=0, world_size=1),
        encoder=_encoder(tok),
        pad_id=0,
        global_batch=4,
        rank=0,
        world_size=1,
        packing=True,
        buffer=50,
        seed=1,
        where="test rows",
    )
    if state is not None:
        batches.load_state_dict(state)
    got = [batches.batch(batches.next_index) for _ in range(count)]
    return got, batches


def test_stream_batches_resume_from_their_state_dict_and_refuse_going_back(tmp_path, tok):
    path = _jsonl(tmp_path / "rows.jsonl", _rows(300))
    whole, _ = _batches(path, tok, count=12)
    head, first = _batches(path, tok, count=5)
    state = first.state_dict()
    assert state["next_index"] == 5
    with pytest.raises(ValueError, match="batch 2 was asked for, the stream is at batch 5"):
        first.batch(2)
    tail, _ = _batches(path, tok, state=state, count=7)
    for a, b in zip(whole, head + tail):
        assert all(a[k].equal(b[k]) and b[k].is_contiguous() for k in ("input_ids", "labels", "position_ids"))
    assert whole[0]["input_ids"].shape == (4, 64)


def test_the_first_batch_comes_before_the_corpus_is_tokenized(tmp_path, tok):
    count = 40 * PACK_GROUP
    path = _jsonl(tmp_path / "big.jsonl", _rows(count))
    start = time.perf_counter()
    windows = _windows(path, tok)
    next(windows)
    first = time.perf_counter() - start
    encoder, rows = _encoder(tok), datasets.load_dataset("json", data_files=str(path), split="train")
    start = time.perf_counter()
    encoder(rows[:], list(range(count)))
    everything = time.perf_counter() - start
    assert first < everything / 5, (first, everything)


def test_a_row_that_fails_in_the_reading_thread_fails_the_batch_in_one_line(tmp_path, tok):
    rows = _rows(30)
    rows[7] = {"prompt": "Q: what is the capital of Zorbia? " * 30, "completion": " Quelmar"}  # cut before it
    path = _jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(ValueError, match=r"^row 7 of test rows has no trained token after its cut to data.seq_len=64"):
        _batches(path, tok, count=1)
