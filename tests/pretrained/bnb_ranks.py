"""Rank-side code of the tests that load folders quantised by bitsandbytes (run on every rank of a
`pools(n)` process group)."""

from __future__ import annotations

import shardtrain as st
from tests.pretrained import load_export_ranks as ranks
from tests.pretrained.qlora_ranks import LORA


def loaded(folder: str, base_bits: int, lora: bool) -> dict:
    """`folder` loaded into a sharded model (LoRA adapters over a `base_bits` base when `lora`, else the
    plain model a full fine-tune trains): its logits, and without LoRA its full state (on rank 0)."""
    model = ranks.sharded(folder, "full_shard", lora=LORA if lora else None, base_bits=base_bits).eval()
    return {"logits": ranks.logits(model), "state": None if lora else st.full_state_dict(model)}
