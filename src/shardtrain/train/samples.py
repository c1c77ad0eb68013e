"""eval.samples: greedy decoding of held-out prompts on the sharded model, every rank in step.

A sharded model's forward is a collective (each unit is gathered from every rank), so all ranks decode
the same prompts for the same number of tokens, `max_new_tokens`, whatever each sequence's end; the
text is cut at the first EOS afterwards. The forward is the model's plain one over the whole sequence
(no cache): a handful of prompts at each evaluation, not a serving path.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .packed import forward_logits


@torch.no_grad()
def greedy_samples(model: nn.Module, prompts: list[dict], *, tokenizer, max_new_tokens: int, device) -> list[dict]:
    """[{"prompt", "completion", "reference"}] for `prompts` ({"prompt_ids", "reference"})."""
    was_training = model.training
    model.eval()
    stops = {tokenizer.eos_token_id} - {None}
    rows = []
    for prompt in prompts:
        ids = torch.tensor([prompt["prompt_ids"]], device=device)
        for _ in range(max_new_tokens):
            logits = forward_logits(model, ids, position_ids=None)
            if isinstance(logits, DTensor):  # engine.loss_parallel: split over the vocabulary on the tp ranks
                logits = logits.full_tensor()
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        new = ids[0, len(prompt["prompt_ids"]) :].tolist()
        end = next((i for i, t in enumerate(new) if t in stops), len(new))
        rows.append(
            {
                "prompt": tokenizer.decode(prompt["prompt_ids"]),
                "completion": tokenizer.decode(new[:end], skip_special_tokens=True),
                "reference": prompt["reference"],
            }
        )
    model.train(was_training)
    return rows
