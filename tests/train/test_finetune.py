"""The main job's LoRA options as peft reads them."""

import pytest
import torch
from torch import nn

from tests.train.facts import llama_folder, prompt_completion_rows, write_jsonl
from tests.train.lora_ranks import lora_step

pytest.importorskip("peft")
pytest.importorskip("datasets")


def test_all_linear_reaches_peft_as_its_shorthand_and_trains_every_linear_layer(pools, tmp_path):
    from transformers import AutoModelForCausalLM

    folder = llama_folder(tmp_path / "model", hidden=32)
    data = write_jsonl(prompt_completion_rows()[:16], tmp_path / "rows.jsonl")
    base = AutoModelForCausalLM.from_pretrained(folder)
    linear = sorted(n for n, m in base.named_modules() if isinstance(m, nn.Linear) and n != "lm_head")
    assert len(linear) == 2 * 7  # q, k, v, o, gate, up, down in each of the 2 layers
    for r in pools(2).run(lora_step, str(folder), str(data), str(tmp_path / "cache"), "--lora.targets", "all-linear"):
        # peft expanded its shorthand (given "all-linear" in a list, it looks for layers of that name)
        assert r["target_modules"] == set(linear)
        assert r["adapted"] == linear  # every linear layer but the output head
        assert all(".lora_A." in n or ".lora_B." in n for n in r["before"])  # only the adapters train
        moved = {n for n in r["before"] if not torch.equal(r["before"][n], r["after"][n])}
        assert moved == set(r["before"]) and len(moved) == 2 * len(linear)  # A and B of each one trained
