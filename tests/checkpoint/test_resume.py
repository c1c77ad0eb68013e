"""Resume exactness: 12 steps straight vs 6 + save + load into fresh objects + 6, bit for bit in fp32
(AdamW, warm-up + cosine LambdaLR, two micro-batches per step with st.no_sync)."""

import pytest

from tests.checkpoint.train_save_ranks import resume_exactly


@pytest.mark.parametrize("strategy", ["full_shard", "shard_grad_op", "no_shard"])
def test_resume_is_bit_exact(pools, tmp_path, strategy):
    losses = pools(2).run(resume_exactly, strategy, str(tmp_path))
    assert len(losses) == 2 and all(len(per_rank) == 6 for per_rank in losses)
