"""Rows -> tokens and trained flags, against transformers' own `apply_chat_template(...,
return_assistant_tokens_mask=True)` and the plain prompt + completion concatenation."""

import pytest

from shardtrain.data.encode import Encoder, Overlong, TrainOn, chat_tokens
from shardtrain.data.formats import Format, detect_format, messages_of
from shardtrain.data.pack import IGNORE, best_fit, doc_labels, windows
from tests.data.tokenizers_fixture import MARKED, UNMARKED, train_tokenizer

CORPUS = [
    "You are terse. What is the capital of Zorbia? Quelmar, of course. And of Vekland? Drazor is the city.",
    "Q: how many legs has a spider?\nA: eight legs, always eight",
] * 20
CHATS = [
    [{"role": "user", "content": "What is the capital of Zorbia?"}, {"role": "assistant", "content": "Quelmar."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of Zorbia?"},
        {"role": "assistant", "content": "Quelmar, of course."},
        {"role": "user", "content": "And of Vekland?"},
        {"role": "assistant", "content": "Drazor is the city."},
    ],
]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS)


def _encoder(tok, fmt, *, train_on=TrainOn.COMPLETION, seq_len=256, overlong=Overlong.TRUNCATE):
    return Encoder(tokenizer=tok, format=fmt, train_on=train_on, seq_len=seq_len, overlong=overlong)


@pytest.mark.parametrize("chat", CHATS)
def test_chat_rows_and_masks_are_transformers_own(tok, chat):
    expected = tok.apply_chat_template(chat, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, trained = _encoder(tok, Format.MESSAGES).encode({"messages": chat})
    assert ids == list(expected["input_ids"]) and trained == list(expected["assistant_masks"])
    assert sum(trained) > 0 and ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    # Every assistant turn's trained span ends with the EOS the template closes it with.
    ends = [i for i in range(len(ids)) if trained[i] and (i + 1 == len(ids) or not trained[i + 1])]
    assert [ids[i] for i in ends] == [tok.eos_token_id] * sum(m["role"] == "assistant" for m in chat)


@pytest.mark.parametrize("chat", CHATS)
def test_a_template_without_generation_marks_is_masked_by_prefixes_alike(tok, chat):
    unmarked = train_tokenizer(CORPUS, template=UNMARKED)
    assert chat_tokens(unmarked, chat) == chat_tokens(tok, chat)
    assert unmarked.chat_template != MARKED


def test_prompt_completion_is_their_concatenation_plus_eos_with_the_completion_trained(tok):
    row = {"prompt": "Q: how many legs has a spider?\nA:", "completion": " eight legs"}
    ids, trained = _encoder(tok, Format.PROMPT_COMPLETION).encode(row)
    prompt = tok(row["prompt"])["input_ids"]
    assert ids == tok(row["prompt"] + row["completion"])["input_ids"] + [tok.eos_token_id]
    assert trained == [0] * len(prompt) + [1] * (len(ids) - len(prompt))
    assert ids.count(tok.bos_token_id) == 1
    every = _encoder(tok, Format.PROMPT_COMPLETION, train_on=TrainOn.ALL).encode(row)
    assert every == (ids, [1] * len(ids))


def test_text_is_all_trained_and_cut_into_documents(tok):
    text = CORPUS[0] * 3
    ids, trained = _encoder(tok, Format.TEXT).encode({"text": text})
    assert ids == tok(text)["input_ids"] + [tok.eos_token_id] and trained == [1] * len(ids)
    out = _encoder(tok, Format.TEXT, seq_len=16)({"text": [text]}, [7])
    assert [x for piece in out["input_ids"] for x in piece] == ids and all(len(p) <= 16 for p in out["input_ids"])
    assert set(out["row"]) == {7} and not any(out["truncated"])


def test_overlong_rows_are_truncated_or_dropped_and_counted(tok):
    row = {"prompt": ["Q: how many legs has a spider?\nA:"], "completion": [" eight legs, always eight"]}
    cut = _encoder(tok, Format.PROMPT_COMPLETION, seq_len=8)(row, [0])
    assert len(cut["input_ids"][0]) == 8 and cut["truncated"] == [True] and cut["kept"] == [True]
    dropped = _encoder(tok, Format.PROMPT_COMPLETION, seq_len=8, overlong=Overlong.DROP)(row, [0])
    assert dropped["kept"] == [False]


def test_sharegpt_conversations_become_messages():
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    assert messages_of(row) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert detect_format(["conversations", "id"], forced="auto", where="x") is Format.MESSAGES


def test_unknown_columns_are_one_line_naming_found_and_expected():
    with pytest.raises(ValueError) as err:
        detect_format(["question", "answer"], forced="auto", where="data.path='qa.jsonl'")
    message = str(err.value)
    assert "\n" not in message and "['question', 'answer']" in message and "'prompt' + 'completion'" in message
    with pytest.raises(ValueError, match="data.format='messages' needs the column"):
        detect_format(["text"], forced="messages", where="data.path='t.jsonl'")


def test_labels_are_shifted_and_packing_restarts_positions():
    assert doc_labels([5, 6, 7, 8], [0, 0, 1, 1]) == [IGNORE, 7, 8, IGNORE]
    docs = {
        "input_ids": [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11]],
        "trained": [[1, 1, 1], [0, 0, 1, 1, 1], [1, 1], [1]],
        "kept": [True, True, True, False],
    }
    out = windows(docs, seq_len=8, packing=True)
    assert sorted(len(w) for w in out["input_ids"]) == [2, 8]  # best fit: 5 + 3 fill a window, 2 starts one
    for ids, labels, positions in zip(out["input_ids"], out["labels"], out["position_ids"]):
        starts = [t for t, p in enumerate(positions) if p == 0] + [len(ids)]
        for a, b in zip(starts, starts[1:]):
            doc = docs["input_ids"].index(ids[a:b])
            assert labels[a:b] == doc_labels(docs["input_ids"][doc], docs["trained"][doc])
            assert positions[a:b] == list(range(b - a))
    padded = windows(docs, seq_len=8, packing=False)
    assert padded["input_ids"] == docs["input_ids"][:3]


def test_best_fit_never_overfills():
    lengths = [7, 5, 5, 4, 3, 3, 2, 1, 1, 8]
    bins = best_fit(lengths, 8)
    assert sorted(i for b in bins for i in b) == list(range(10))
    assert all(sum(lengths[i] for i in b) <= 8 for b in bins) and len(bins) == 5


def test_conversational_prompt_completion_trains_as_its_chat(tok):
    chat = CHATS[0]
    row = {"prompt": chat[:1], "completion": chat[1:]}
    assert _encoder(tok, Format.PROMPT_COMPLETION).encode(row) == chat_tokens(tok, chat)
    ids, trained = _encoder(tok, Format.MESSAGES, train_on=TrainOn.ALL).encode({"messages": chat})
    assert ids == chat_tokens(tok, chat)[0] and trained == [1] * len(ids)
