"""Rows from every file kind -> the same cached windows; held-out split; batches; one-line errors."""

import json

import pytest
import torch

from shardtrain.data import DataSpec, WindowBatches, prepare, show
from shardtrain.data.encode import Encoder
from shardtrain.data.pack import IGNORE
from shardtrain.data.sources import load_rows
from shardtrain.data.tokenizer import check_vocab
from tests.data.tokenizers_fixture import train_tokenizer
from tests.train.facts import chat_rows, prompt_completion_rows, questions

datasets = pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer([q + " " + a for q, a in questions()], vocab_size=300)


def _prepare(path, tok, tmp_path, **spec):
    spec = {"seq_len": 64, "val_fraction": 0.1, **spec}
    return prepare(DataSpec(path=str(path), **spec), tokenizer=tok, cache_dir=str(tmp_path / "cache"), progress=False)


def _jsonl(tmp_path, rows, name="rows.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_file_kind_gives_the_same_windows(tmp_path, tok):
    rows = prompt_completion_rows()
    reference = _prepare(_jsonl(tmp_path, rows), tok, tmp_path)
    table = datasets.Dataset.from_list(rows)
    (tmp_path / "pq").mkdir()
    table.to_parquet(str(tmp_path / "pq" / "part-0.parquet"))
    table.to_csv(str(tmp_path / "rows.csv"), index=False)
    table.save_to_disk(str(tmp_path / "saved"))
    for path in (tmp_path / "pq", tmp_path / "rows.csv", tmp_path / "saved"):
        got = _prepare(path, tok, tmp_path)
        assert list(got.train["input_ids"]) == list(reference.train["input_ids"]), path
        assert list(got.held_out["labels"]) == list(reference.held_out["labels"]), path
    assert reference.format.value == "prompt_completion"
    stats = reference.stats
    assert stats.rows == 144 and stats.held_out_rows == 14 and stats.truncated_rows == 0
    assert stats.supervised_tokens == sum(sum(t != IGNORE for t in w) for w in list(reference.train["labels"]))
    assert stats.tokens == sum(len(w) for w in list(reference.train["input_ids"]))
    assert stats.packing_efficiency == stats.tokens / (stats.windows * 64) and stats.windows < stats.documents


def test_plain_text_files_are_one_document_each(tmp_path, tok):
    (tmp_path / "txt").mkdir()
    texts = [" ".join(q for q, _ in questions()[i::4]) for i in range(4)]
    for i, text in enumerate(texts):
        (tmp_path / "txt" / f"{i}.txt").write_text(text)
    prepared = _prepare(tmp_path / "txt", tok, tmp_path, pattern="*.txt", val_fraction=0.25)
    assert prepared.format.value == "text" and prepared.stats.rows == 4 and prepared.stats.held_out_rows == 1
    tokens = sorted(t for w in list(prepared.train["input_ids"]) + list(prepared.held_out["input_ids"]) for t in w)
    assert tokens == sorted(t for text in texts for t in tok(text)["input_ids"] + [tok.eos_token_id])


def test_the_cache_is_reused_and_keyed_by_seq_len(tmp_path, tok, monkeypatch):
    path = _jsonl(tmp_path, chat_rows())
    first = _prepare(path, tok, tmp_path)
    calls = []
    original = Encoder.__call__
    monkeypatch.setattr(Encoder, "__call__", lambda self, *a: calls.append(1) or original(self, *a))
    again = _prepare(path, tok, tmp_path)
    assert calls == [] and list(again.train["input_ids"]) == list(first.train["input_ids"])
    other = _prepare(path, tok, tmp_path, seq_len=32)
    assert calls and max(len(w) for w in list(other.train["input_ids"])) <= 32


def test_sharegpt_rows_train_as_their_messages(tmp_path, tok):
    chats = chat_rows()
    shared = [
        {
            "conversations": [
                {"from": {"user": "human"}.get(m["role"], "gpt"), "value": m["content"]} for m in r["messages"]
            ]
        }
        for r in chats
    ]
    a = _prepare(_jsonl(tmp_path, chats, "a.jsonl"), tok, tmp_path)
    b = _prepare(_jsonl(tmp_path, shared, "b.jsonl"), tok, tmp_path)
    assert list(a.train["labels"]) == list(b.train["labels"]) and list(a.train["input_ids"]) == list(
        b.train["input_ids"]
    )


def test_worker_processes_give_the_same_windows(tmp_path, tok):
    path = _jsonl(tmp_path, chat_rows())
    serial = prepare(DataSpec(path=str(path), seq_len=64), tokenizer=tok, cache_dir=str(tmp_path / "a"), progress=False)
    parallel = prepare(
        DataSpec(path=str(path), seq_len=64), tokenizer=tok, cache_dir=str(tmp_path / "b"), num_proc=2, progress=False
    )
    assert list(parallel.train["input_ids"]) == list(serial.train["input_ids"]) and parallel.stats == serial.stats


def test_by_default_every_row_trains(tmp_path, tok):
    """As TRL and axolotl: no held-out split unless asked (val_fraction, eval_path)."""
    rows = prompt_completion_rows()
    spec = DataSpec(path=str(_jsonl(tmp_path, rows)), seq_len=64)
    prepared = prepare(spec, tokenizer=tok, cache_dir=str(tmp_path / "cache"), progress=False)
    assert prepared.held_out is None and prepared.stats.held_out_rows == 0
    starts = sum(int((torch.tensor(p) == 0).sum()) for p in prepared.train["position_ids"])
    assert starts == prepared.stats.documents == len(rows)  # every row is a document of the training windows


def test_show_marks_exactly_the_assistant_answers(tmp_path, tok):
    prepared = _prepare(_jsonl(tmp_path, chat_rows()), tok, tmp_path, packing=False)
    text = show(prepared.train, tok, count=3)
    answers = [line.split("[[")[1].split("]]")[0] for line in text.splitlines() if "[[" in line]
    assert len(answers) == 3 and all(a.endswith("</s>") and a[:-4] in dict(questions()).values() for a in answers)


def test_batches_pad_by_length_and_restart_positions(tmp_path):
    nopad = train_tokenizer([q + " " + a for q, a in questions()], vocab_size=300, pad=False)
    prepared = _prepare(_jsonl(tmp_path, chat_rows()), nopad, tmp_path, packing=False)
    eos = nopad.eos_token_id
    batch = WindowBatches(
        prepared.train, seq_len=64, pad_id=eos, global_batch=4, rank=0, world_size=1, seed=0, shuffle=True
    ).batch(0)
    for b in range(4):
        ids, labels, pos = (batch[k][b] for k in ("input_ids", "labels", "position_ids"))
        n = int((pos[1:] == 0).nonzero()[0]) + 1  # the padding run starts at 0
        assert (ids[n:] == eos).all() and (labels[n:] == IGNORE).all() and pos[n:].tolist() == list(range(64 - n))
        assert labels[n - 2] == eos, "the answer's EOS is trained although EOS is also the padding"
    ranks = [
        WindowBatches(
            prepared.train, seq_len=64, pad_id=eos, global_batch=4, rank=r, world_size=2, seed=0, shuffle=True
        )
        for r in (0, 1)
    ]
    assert torch.equal(torch.cat([r.batch(0)["input_ids"] for r in ranks]), batch["input_ids"])
    few = len(prepared.held_out)  # fewer than one batch: evaluated as they are, the rest padding rows
    held = WindowBatches(
        prepared.held_out, seq_len=64, pad_id=eos, global_batch=few + 3, rank=0, world_size=1, seed=0, shuffle=False
    )
    batch = held.batch(0)
    assert held.held_out_batches(0) == 1 and batch["labels"].shape == (few + 3, 64)
    assert [list(r[r != IGNORE]) for r in batch["labels"][:few]] == [
        [t for t in w if t != IGNORE] for w in prepared.held_out["labels"]
    ]
    assert (batch["labels"][few:] == IGNORE).all() and (batch["input_ids"][few:] == eos).all()


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"question": "q", "answer": "a"}], "have the columns ['question', 'answer'], which match no known layout"),
        ([{"prompt": "Q: what is the capital of Zorbia? " * 30, "completion": " Quelmar"}], "row 0 of data.path="),
        ([{"messages": [{"role": "user", "content": "hi"}]}], "has no trained token (nothing in it is a completion"),
    ],
)
def test_bad_rows_are_one_line(tmp_path, tok, rows, message):
    with pytest.raises(ValueError) as err:
        _prepare(_jsonl(tmp_path, rows * 20), tok, tmp_path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_zero_trained_row_names_the_row_and_the_fix(tmp_path, tok):
    rows = prompt_completion_rows()[:10]
    rows[3] = {"prompt": "Q: what is the capital of Zorbia? " * 30, "completion": " Quelmar"}
    with pytest.raises(
        ValueError, match=r"^row 3 of data.path=.* has no trained token after its cut to data.seq_len=64"
    ):
        _prepare(_jsonl(tmp_path, rows), tok, tmp_path, eval_path=str(_jsonl(tmp_path, rows[:2], "eval.jsonl")))


def test_missing_and_corrupt_files_are_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^data.path='/no/such.jsonl' does not exist; pass an existing file"):
        load_rows("/no/such.jsonl")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ValueError) as err:
        load_rows(str(bad), cache_dir=str(tmp_path))
    assert str(err.value).startswith(f"data.path={str(bad)!r}: cannot read it as parquet (") and "\n" not in str(
        err.value
    )


def test_a_tokenizer_larger_than_the_embedding_is_refused(tok):
    with pytest.raises(ValueError, match=f"has {len(tok)} tokens but the model's embedding has 100 rows"):
        check_vocab(tok, embedding_rows=100, where="model.pretrained='m'")
