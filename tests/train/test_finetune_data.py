"""`shardtrain train --model.pretrained DIR --data.path rows`: the issue's acceptance case through the CLI
(slow tier), and the data errors a user can make, each one line on every rank."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tests.train.checks import prepare_error
from tests.train.facts import accuracy, chat_rows, llama_folder, prompt_completion_rows, write_jsonl
from tests.train.test_cli import _train_on

pytest.importorskip("datasets")
ROOT = Path(__file__).resolve().parents[2]
STEPS = 200


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return llama_folder(tmp_path_factory.mktemp("base") / "llama")


def _train(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardtrain", "train", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def _args(folder: Path, data: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--model.pretrained",
        str(folder),
        "--data.path",
        str(data),
        "--data.seq_len",
        "64",
        "--train.batch_size",
        "16",
        "--train.eval_batches",
        "1",
        "--optim.warmup_steps",
        "10",
        "--optim.weight_decay",
        "0",
        "--run.progress",
        "false",
        "--data.cache_dir",
        str(tmp_path / "cache"),
        "--run.out_dir",
        str(tmp_path / "runs"),
        "--run.name",
        "ft",
        *extra,
    ]


@pytest.mark.slow  # one 2-rank run of 200 steps and 144 generations, about 50 s
@pytest.mark.parametrize("kind", ["messages", "prompt_completion"])
def test_the_exported_model_answers_the_facts_it_was_tuned_on(pools, folder, tmp_path, kind):
    rows = chat_rows() if kind == "messages" else prompt_completion_rows()
    data = write_jsonl(rows, tmp_path / "rows.jsonl")
    args = [
        *_args(folder, data, tmp_path),
        "--data.eval_path",
        str(data),  # every fact is trained; the held-out loss is the training rows'
        "--train.steps",
        str(STEPS),
        "--train.eval_every",
        "100",
        "--eval.samples",
        "2",
        "--run.export_hf",
        "true",
        "--data.show",
        "1",
    ]
    if kind == "messages":  # launched as a user does
        run = _train(*args)
        assert run.returncode == 0, run.stderr
        out = run.stdout
    else:  # the same command through cli.main on the pool: the launch's seconds are paid once
        out = _train_on(pools(2), args)
    assert "[[" in out and "144 rows (144 held out)" in " ".join(out.split())
    exported = tmp_path / "runs" / "ft" / "hf"
    assert (exported / "tokenizer.json").exists()
    samples = [json.loads(line) for line in (tmp_path / "runs" / "ft" / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 0, 100, 100, 200, 200]
    right = accuracy(exported, chat=kind == "messages")
    print(f"{kind}: {right:.1%} right after {STEPS} steps")
    assert right >= 0.85


def test_data_mistakes_are_one_line_on_every_rank_before_any_communication(pools, folder, tmp_path):
    unknown = write_jsonl([{"question": "q", "answer": "a"}] * 8, tmp_path / "qa.jsonl")
    rows = write_jsonl(chat_rows(), tmp_path / "chat.jsonl")
    tiny = ["--model.name", "llama-tiny", "--data.seq_len", "64", "--data.path", str(rows)]
    cases = [
        (_args(folder, unknown, tmp_path), "columns ['question', 'answer'], which match no known layout"),
        (_args(folder, tmp_path / "nope.jsonl", tmp_path), f"data.path='{tmp_path / 'nope.jsonl'}' does not exist"),
        ([*tiny, "--data.tokenizer", str(folder)], "has 481 tokens but the model's embedding has 256 rows"),
        (tiny, "holds rows, which need a tokenizer; the byte tokenizer reads only plain text: pass --data.tokenizer"),
        (
            [*_args(folder, rows, tmp_path), "--eval.samples", "2"],
            "eval.samples=2 decodes held-out prompts, but every row trains (data.val_fraction 0, no data.eval_path)",
        ),
    ]
    for overrides, message in cases:
        for error in pools(2).run(prepare_error, *overrides):
            assert message in error and "\n" not in error, error


def test_a_chat_template_file_trains_and_is_exported_with_the_model(pools, folder, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(
        "{%- for m in messages -%}### {{ m['role'] }}:{% if m['role'] == 'assistant' %}{% generation %}"
        "{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}"
        "{%- endfor -%}{%- if add_generation_prompt %}### assistant:{% endif -%}"
    )
    data = write_jsonl(chat_rows()[:16], tmp_path / "chat.jsonl")
    args = _args(folder, data, tmp_path, "--data.chat_template", str(template), "--train.steps", "2",
                 "--train.batch_size", "4", "--data.show", "1", "--run.export_hf", "true")  # fmt: skip
    out = _train_on(pools(2), args)
    shown = out.split("--- window 0, document 0 ---\n")[1].split("\n")[:2]
    # the file's rendering, only the answer trained
    assert re.fullmatch(r"### user:[^#\[\]]+\?", shown[0]), shown
    assert re.fullmatch(r"### assistant:\[\[[^#\[\]]+</s>\]\]", shown[1]), shown
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "runs" / "ft" / "hf"))
    assert exported.chat_template == template.read_text()
