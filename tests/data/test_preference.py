"""Preference rows -> token pairs: TRL's layouts, one prompt shared by both answers, one line per bad row."""

import json

import pytest

from shardtrain.data.pipeline import DataSpec
from shardtrain.data.preference import PairEncoder, split_prompt
from tests.data.tokenizers_fixture import train_tokenizer

pytest.importorskip("datasets")

TEXTS = ["Q: What is 2+2?\nA: It is 4.", "Q: Name a colour.\nA: Blue is one.", "The answer is four. Four it is."]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXTS, vocab_size=300)


def test_explicit_and_implicit_prompts_split_as_trl_does():
    assert split_prompt({"prompt": "Q:", "chosen": " a", "rejected": " b"}) == ("Q:", " a", " b")
    # implicit prompt: the common start; the space before the answers stays with them
    assert split_prompt({"chosen": "Q: x? It is 4.", "rejected": "Q: x? Four."}) == ("Q: x?", " It is 4.", " Four.")
    user = {"role": "user", "content": "x?"}
    chosen, rejected = [user, {"role": "assistant", "content": "4"}], [user, {"role": "assistant", "content": "5"}]
    prompt, c, r = split_prompt({"chosen": chosen, "rejected": rejected})
    assert prompt == [user] and c == chosen[1:] and r == rejected[1:]


@pytest.mark.parametrize("chat", [False, True], ids=["text", "conversational"])
def test_both_answers_follow_the_same_prompt_tokens(tok, chat):
    from tests.train.facts import preference_rows

    row = preference_rows(chat=chat)[0]
    prompt, chosen, rejected = PairEncoder(tokenizer=tok, seq_len=64).encode(row)
    assert prompt and chosen and rejected and chosen != rejected
    if chat:  # the chat's whole rendering is the prompt's (with the generation prompt) and then the answer
        whole = tok.apply_chat_template(row["prompt"] + row["chosen"], tokenize=False)
        assert tok.decode(prompt + chosen) == whole
        assert tok.decode(prompt).endswith("<|assistant|>")
    else:
        assert chosen[-1] == tok.eos_token_id and tok.decode(chosen, skip_special_tokens=True) == row["chosen"]
        assert prompt[0] == tok.bos_token_id


def test_a_long_answer_is_cut_to_seq_len_after_the_prompt(tok):
    prompt, chosen, _ = PairEncoder(tokenizer=tok, seq_len=12).encode(
        {"prompt": "Q: x?", "chosen": " It is 4." * 6, "rejected": " no"}
    )
    assert len(prompt) + len(chosen) == 12


@pytest.mark.parametrize(
    "row, message",
    [
        ({"prompt": "Q", "chosen": " a", "rejected": None}, "preference row 1 has no rejected answer"),
        ({"prompt": "Q", "chosen": " a", "rejected": " a"}, "preference row 1 has the same chosen and rejected"),
        ({"prompt": "Q", "chosen": "", "rejected": " b"}, "preference row 1 has an empty chosen answer"),
        ({"prompt": "Q " * 40, "chosen": " a", "rejected": " b"}, "preference row 1 has a prompt of"),
    ],
    ids=["no_rejected", "same", "empty", "prompt_too_long"],
)
def test_a_bad_row_is_one_line_naming_it(tok, tmp_path, row, message):
    from shardtrain.data.preference_data import prepare_pairs

    good = {"prompt": "Q: x?", "chosen": " It is 4.", "rejected": " Four."}
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (good, row)))
    with pytest.raises(ValueError) as err:
        prepare_pairs(DataSpec(path=str(path), seq_len=32), tokenizer=tok, cache_dir=str(tmp_path / "cache"))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_rows_without_a_rejected_column_name_the_layout(tok, tmp_path):
    from shardtrain.data.preference_data import read_pairs

    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "Q", "completion": " a"}) + "\n")
    with pytest.raises(ValueError, match=r"no \['chosen', 'rejected'\]"):
        read_pairs(DataSpec(path=str(path), seq_len=32))


def test_a_batch_holds_the_chosen_rows_then_the_rejected_scoring_only_the_answers(tok, tmp_path):
    from shardtrain.data.preference_data import PairBatches, prepare_pairs

    rows = [{"prompt": f"Q: {i}?", "chosen": " It is 4.", "rejected": " Four."} for i in range(4)]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = prepare_pairs(DataSpec(path=str(path), seq_len=16), tokenizer=tok, cache_dir=str(tmp_path / "c")).train
    batches = PairBatches(pairs, seq_len=16, pad_id=0, global_batch=3, rank=0, world_size=1, seed=0, shuffle=False)
    last = batches.batch(1)  # pair 3, then two padding pairs
    assert last["pair"].tolist() == [3, -1, -1] and last["input_ids"].shape == (6, 16)
    assert (last["labels"][[1, 2, 4, 5]] == -100).all()
    first = batches.batch(0)
    for row, answer in ((0, pairs[0]["chosen_ids"]), (3, pairs[0]["rejected_ids"])):
        scored = first["labels"][row][first["labels"][row] != -100].tolist()
        assert scored == answer  # the answer's tokens, each predicted from the token before it
        start = len(pairs[0]["prompt_ids"])
        assert first["input_ids"][row, start : start + len(answer)].tolist() == answer
