"""Parity on models nobody here wrote: Hugging Face Mixtral (3-D expert weights, top-2 routing), T5
(an embedding shared by encoder, decoder and head), BERT (a tied decoder with its own bias), and torch's
FSDP test transformer (nn.Transformer, BatchNorm, a long buffer). Each wrapped by its own block
classes, against one process at fp32 tolerance (tests/core/parity.py)."""

import pytest

from tests.core import checks
from tests.core.parity import Case, run_cases

pytest.importorskip("transformers")
pytest.importorskip("expecttest")  # torch.testing._internal needs it

CASES = [
    Case(strategy="full_shard", optim="adamw", steps=4),
    Case(strategy="shard_grad_op", optim="sgd", ac=True, accum="no_sync", steps=4),
    Case(strategy="no_shard", optim="adamw_fused", accum="plain", clip=0.05, steps=4),
]


@pytest.mark.parametrize("kind", ["hf_mixtral", "hf_t5", "hf_bert", "fsdp_transformer"])
def test_models_we_did_not_write_train_like_one_process(pools, kind):
    assert pools(2).run(run_cases, kind, CASES) == [len(CASES)] * 2


def test_a_checkpointed_hf_model_trains_without_its_cache_and_evaluates_with_it(pools):
    assert pools(1).run(checks.hf_cache_only_off_while_training) == [
        {"train_cache": False, "eval_cache": True, "config_kept": True}
    ]
