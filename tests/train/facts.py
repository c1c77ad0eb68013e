"""The fine-tuning acceptance case: 48 invented facts, a small Llama folder with its own tokenizer, a judge.

`facts()` gives (country, capital) pairs of invented names, `chat_rows` / `prompt_completion_rows` ask
each in 3 phrasings, `llama_folder` writes a randomly initialised `LlamaForCausalLM` with a BPE
tokenizer trained on those rows and a chat template (a "pretrained" folder, nothing downloaded), and
`accuracy` asks the exported folder every question through its own tokenizer, chat template and
`generate()`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tests.data.tokenizers_fixture import MARKED, train_tokenizer

PHRASINGS = (
    "What is the capital of {}?",
    "Name the capital city of {}.",
    "Which city is the capital of {}?",
)
_SYLLABLES = [
    "zor",
    "bel",
    "qua",
    "mir",
    "tan",
    "vek",
    "lo",
    "dra",
    "sin",
    "ru",
    "pex",
    "hal",
    "nor",
    "gi",
    "ost",
    "ba",
]


def facts(n: int = 48, *, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    names: set[str] = set()
    while len(names) < 2 * n:
        names.add("".join(rng.sample(_SYLLABLES, rng.choice((2, 3)))).capitalize())
    names = sorted(names)
    rng.shuffle(names)
    return list(zip(names[:n], names[n:]))


def questions() -> list[tuple[str, str]]:
    """(question, answer) for every fact and phrasing."""
    return [(p.format(country), capital) for country, capital in facts() for p in PHRASINGS]


def chat_rows() -> list[dict]:
    return [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in questions()]


def prompt_completion_rows() -> list[dict]:
    return [{"prompt": f"Q: {q}\nA:", "completion": f" {a}"} for q, a in questions()]


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def llama_folder(
    path: Path, *, hidden: int = 64, layers: int = 2, init_range: float = 0.02, extra_texts: tuple[str, ...] = ()
) -> Path:
    """A randomly initialised LlamaForCausalLM + its tokenizer (with chat template, learned from the facts'
    rows and `extra_texts`), as save_pretrained writes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    texts = [q + " " + a for q, a in questions()] + [r["prompt"] + r["completion"] for r in prompt_completion_rows()]
    texts += extra_texts
    tokenizer = train_tokenizer(texts, vocab_size=512, template=MARKED)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=init_range,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def accuracy(folder: Path, *, chat: bool, within: bool = False) -> float:
    """Share of the questions the folder's model answers right, greedily, through its own tokenizer
    (`within`: the answer appears in what it says, e.g. after preference tuning towards a longer phrasing).

    The questions of one token length go to `generate()` together (no padding, so each row is generated
    as it would be alone; a finished row gets pad tokens, which decode drops): a dozen calls instead of
    144, whose fixed cost dominated the judge (~60 s on 2 cores).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    asked = questions()
    if chat:  # one call renders every conversation (the template is compiled once, not 144 times)
        conversations = [[{"role": "user", "content": question}] for question, _ in asked]
        prompts = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, return_dict=True)
    else:
        prompts = tokenizer([f"Q: {question}\nA:" for question, _ in asked])
    by_length: dict[int, list[tuple[list[int], str]]] = {}
    for ids, (_, answer) in zip(prompts["input_ids"], asked):
        by_length.setdefault(len(ids), []).append((ids, answer))
    right = 0
    for length, group in by_length.items():
        ids = torch.tensor([row for row, _ in group])
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=12,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        answers = tokenizer.batch_decode(out[:, length:], skip_special_tokens=True)
        right += sum(
            answer in said.split() or answer + "." in said.split() if within else said.strip() == answer
            for said, (_, answer) in zip(answers, group)
        )
    return right / len(questions())


def preference_rows(*, chat: bool = True) -> list[dict]:
    """Pairs preferring each fact's answer in one phrasing ("The capital is X.") over another ("X is the
    capital."): TRL's conversational layout (`chat`), or plain prompt / chosen / rejected strings."""
    rows = []
    for question, answer in questions():
        chosen, rejected = f"The capital is {answer}.", f"{answer} is the capital."
        if chat:
            rows.append(
                {
                    "prompt": [{"role": "user", "content": question}],
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}],
                }
            )
        else:
            rows.append({"prompt": f"Q: {question}\nA:", "chosen": f" {chosen}", "rejected": f" {rejected}"})
    return rows
