"""Streamed windows: the cached path's in the same order mode, disjoint rank shares, exact resume, early first batch."""

import functools
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from shardtrain.data import DataSpec, prepare
from shardtrain.data.encode import Encoder, Overlong, TrainOn
from shardtrain.data.formats import Format
from shardtrain.data.pipeline import PACK_GROUP
from shardtrain.data.stream import StreamBatches, StreamSource, neediest, stream_rows, stream_windows
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


def _windows(path, tok, *, rank=0, world_size=1, buffer=PACK_GROUP, shuffle=False, start=None, columns=()):
    spec = DataSpec(path=str(path), seq_len=64, columns=columns)
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


def test_a_sources_column_renames_read_as_the_renamed_file_cached_and_streamed(tmp_path, tok):
    rows = _rows(300)
    plain = _jsonl(tmp_path / "plain.jsonl", rows)
    asked = _jsonl(tmp_path / "qa.jsonl", [{"question": r["prompt"], "answer": r["completion"]} for r in rows])
    renames = (("question", "prompt"), ("answer", "completion"))

    def cached(path, **columns):
        spec = DataSpec(path=str(path), seq_len=64, **columns)
        train = prepare(spec, tokenizer=tok, cache_dir=str(tmp_path / "c"), num_proc=1, progress=False).train
        return list(zip(train["input_ids"], train["labels"], train["position_ids"]))

    expected = cached(plain)
    assert cached(asked, columns=renames) == expected
    streamed = itertools.islice(_windows(asked, tok, columns=renames), len(expected))
    assert [w for w, _ in streamed] == expected


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
    source = StreamSource(
        open_rows=lambda: stream_rows(spec, tokenizer=tok, cache_dir=None, rank=0, world_size=1),
        encoder=_encoder(tok),
        where="test rows",
    )
    batches = _stream_batches([source], buffer=50, seed=1, state=state)
    got = [batches.batch(batches.next_index) for _ in range(count)]
    return got, batches


def _stream_batches(sources, *, buffer, seed, state, weights=None):
    """One rank's StreamBatches of `sources` in micro-batches of 4, from `state` (None: the start)."""
    batches = StreamBatches(
        sources, weights=weights, pad_id=0, global_batch=4, rank=0, world_size=1, packing=True, buffer=buffer, seed=seed
    )
    batches.start()  # reading from the start, as a run's batches do while its model is built
    if state is not None:
        batches.load_state_dict(state)
    return batches


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


def test_closing_ends_the_reading_threads_and_the_stream_goes_on_where_it_was(tmp_path, tok):
    """A run closes its stream at the end (a reader alive into interpreter shutdown can abort the
    process); a batch read after closing continues the stream exactly."""
    path = _jsonl(tmp_path / "rows.jsonl", _rows(300))
    whole, uninterrupted = _batches(path, tok, count=8)
    uninterrupted.close()
    head, batches = _batches(path, tok, count=3)
    readers = [t for t in threading.enumerate() if t.name.startswith("shardtrain-stream")]
    assert len(readers) >= 1
    batches.close()
    assert not any(t.is_alive() for t in readers)
    tail = [batches.batch(batches.next_index) for _ in range(5)]
    for a, b in zip(whole, head + tail):
        assert all(a[k].equal(b[k]) for k in ("input_ids", "labels", "position_ids"))
    batches.close()


_EXIT_SCRIPT = """
import atexit, sys, threading
from transformers import AutoTokenizer
from shardtrain.data import DataSpec
from shardtrain.data.stream import StreamSource, stream_rows
from tests.data.test_stream import _encoder, _stream_batches

def alive():  # registered before the stream's own hook, so it runs after it (atexit runs the last first)
    names = [t.name for t in threading.enumerate() if t.name.startswith("shardtrain-stream") and t.is_alive()]
    print("alive at exit:", names, flush=True)

atexit.register(alive)
tok, spec = AutoTokenizer.from_pretrained(sys.argv[1]), DataSpec(path=sys.argv[2], seq_len=64)
source = StreamSource(
    open_rows=lambda: stream_rows(spec, tokenizer=tok, cache_dir=None, rank=0, world_size=1),
    encoder=_encoder(tok),
    where="rows",
    name="rows",
)
batches = _stream_batches([source], buffer=50, seed=1, state=None)
batches.batch(0)
print("reading:", [t.name for t in threading.enumerate() if t.name.startswith("shardtrain-stream")], flush=True)
"""


def test_a_stream_left_open_is_closed_at_exit(tmp_path, tok):
    """A loop of one's own that never calls close(), or an error before the training loop: the exit hook
    closes the reading threads before the interpreter's shutdown."""
    tok.save_pretrained(tmp_path / "tok")
    path = _jsonl(tmp_path / "rows.jsonl", _rows(300))
    script = tmp_path / "left_open.py"
    script.write_text(_EXIT_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "src"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "tok"), str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reading: ['shardtrain-stream-rows']" in done.stdout and "alive at exit: []" in done.stdout, done.stdout


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


def _mixed(paths, tok, *, weights=(0.7, 0.3), seed=1, state=None):
    """StreamBatches of two sources: prompt/completion rows (completions trained) and text (all trained)."""
    specs = [DataSpec(path=str(paths[0]), seq_len=64), DataSpec(path=str(paths[1]), seq_len=64, train_on="all")]
    fmts = (Format.PROMPT_COMPLETION, Format.TEXT)
    sources = [
        StreamSource(
            open_rows=functools.partial(stream_rows, spec, tokenizer=tok, cache_dir=None, rank=0, world_size=1),
            encoder=Encoder(
                tokenizer=tok, format=fmt, train_on=TrainOn(spec.train_on), seq_len=64, overlong=Overlong.TRUNCATE
            ),
            where=spec.path,
            name=f"s{s}",
        )
        for s, (spec, fmt) in enumerate(zip(specs, fmts))
    ]
    return _stream_batches(sources, weights=list(weights), buffer=40, seed=seed, state=state)


def _two_sources(tmp_path):
    text = [{"text": f"note {i}: " + "the tea is warm " * (1 + i % 4)} for i in range(150)]
    return _jsonl(tmp_path / "task.jsonl", _rows(200)), _jsonl(tmp_path / "text.jsonl", text)


def test_two_streamed_sources_train_on_their_weights_shares_of_the_trained_tokens(tmp_path, tok):
    paths = _two_sources(tmp_path)
    mixed = _mixed(paths, tok)
    trained = [0, 0]
    for index in range(200):
        batch = mixed.batch(index)
        for row in range(4):  # a window holds rows of one source: its first token says which
            source = 0 if tok.decode(batch["input_ids"][row, :4], skip_special_tokens=True).startswith("Q") else 1
            trained[source] += int((batch["labels"][row] != -100).sum())
    share = trained[0] / sum(trained)
    assert abs(share - 0.7) <= 0.03, trained
    assert trained == mixed.served[:, 3].tolist()  # the summary's counts are these
    # the task's windows train fewer tokens each: more than 70% of the windows come from it
    assert mixed.served[0, 0] / mixed.served[:, 0].sum() > 0.75


def test_two_streamed_sources_give_the_same_batches_by_seed_and_after_a_resume(tmp_path, tok):
    paths = _two_sources(tmp_path)
    first = _mixed(paths, tok)
    whole = [first.batch(i) for i in range(40)]
    again = _mixed(paths, tok)
    assert all(again.batch(i)["input_ids"].equal(whole[i]["input_ids"]) for i in range(40))
    other = _mixed(paths, tok, seed=2)
    assert any(not other.batch(i)["input_ids"].equal(whole[i]["input_ids"]) for i in range(40))
    for cut in (7, 23):  # inside the sources' buffers, then past their first pass
        head = _mixed(paths, tok)
        for i in range(cut):
            head.batch(i)
        state = json.loads(json.dumps(head.state_dict()))  # plain values, as the checkpoint keeps them
        resumed = _mixed(paths, tok, state=state)
        for i in range(cut, 40):
            batch = resumed.batch(i)
            assert all(batch[k].equal(whole[i][k]) for k in ("input_ids", "labels", "position_ids")), (cut, i)
    with pytest.raises(ValueError, match=r"streamed the sources \['s0', 's1'\], this run streams \['s1', 's0'\]"):
        swapped = _mixed(paths[::-1], tok)
        swapped.sources = swapped.sources[::-1]
        swapped.load_state_dict(state)


def test_neediest_keeps_each_share_of_the_trained_tokens_within_a_window():
    weights, trained = [0.5, 0.3, 0.2], [0, 0, 0]
    sizes = [7, 3, 11]  # trained tokens per window of each source
    for _ in range(300):
        s = neediest(weights, trained)
        trained[s] += sizes[s]
        total = sum(trained)
        assert all(abs(t - w * total) <= 2 * max(sizes) for t, w in zip(trained, weights))
    assert neediest([0.3, 0.7], [0, 0]) == 1


def test_windows_packed_while_a_step_runs_are_taken_without_waiting(tmp_path, tok):
    """What each train record's data_load_s measures: during a step the reading thread packs the next
    read_ahead micro-batches, across buffer ends, so taking them waits on no reading or tokenizing."""
    path = _jsonl(tmp_path / "rows.jsonl", _rows(3000))
    spec = DataSpec(path=str(path), seq_len=64)
    source = StreamSource(
        open_rows=lambda: stream_rows(spec, tokenizer=tok, cache_dir=None, rank=0, world_size=1),
        encoder=_encoder(tok),
        where="test rows",
    )
    batches = _stream_batches([source], buffer=50, seed=1, state=None)  # 8 micro-batches of 4 read ahead
    ahead = batches._queues[0]
    batches.batch(0)
    taken = []
    for step in range(6):  # 6 x 32 windows: past several 50-document buffers
        deadline = time.perf_counter() + 30
        while not ahead.full() and time.perf_counter() < deadline:  # the device's step
            time.sleep(0.01)
        assert ahead.full(), step
        documents, start = int(batches.served[0, 1]), time.perf_counter()
        for _ in range(8):
            batches.batch(batches.next_index)
        taken.append(time.perf_counter() - start)
    documents = int(batches.served[0, 1]) - documents  # those of the last step's 8 micro-batches
    rows = _rows(documents)
    start = time.perf_counter()
    _encoder(tok)({k: [r[k] for r in rows] for k in ("prompt", "completion")}, list(range(documents)))
    encoding = time.perf_counter() - start
    assert sorted(taken)[len(taken) // 2] < encoding / 4, (taken, encoding)
