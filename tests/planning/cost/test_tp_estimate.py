"""The memory estimate under tensor parallelism: what one tp rank holds, its activations, the collectives."""

import pytest

from shardtrain import cli
from shardtrain.models.llama_config import llama_config
from shardtrain.planning.cost.estimate import estimate_memory

TINY = llama_config("tiny")  # dim 64, 2 layers, 4 heads (2 kv), ffn 176, vocab 256, untied
NORMS = TINY.n_layers * 2 * TINY.dim + TINY.dim  # RMSNorm weights: replicated on every tp rank


def _estimate(*, world: int, tp: int = 1, **kwargs):
    return estimate_memory(TINY, world_size=world, tp=tp, precision="32-true", micro_batch=2, seq_len=64, **kwargs)


def test_one_tp_rank_holds_half_the_split_weights_and_every_norm():
    whole, split = _estimate(world=1), _estimate(world=2, tp=2)
    params = TINY.num_params()
    assert whole.parameters == 4 * params
    assert split.parameters == 4 * ((params - NORMS) // 2 + NORMS)  # ~ half, plus the norms' other half
    assert split.optimizer_state == 8 * ((params - NORMS) // 2 + NORMS)
    # over (dp 2, tp 2) the TP-local tensors are sharded once more over dp
    assert _estimate(world=4, tp=2).parameters == pytest.approx(split.parameters / 2, abs=4)
    assert split.inputs.shard_size == 1 and "tp 2" in split.inputs.label


def test_activations_split_over_tp_and_further_under_sequence_parallelism():
    whole, split = _estimate(world=1), _estimate(world=2, tp=2)
    sequence = _estimate(world=2, tp=2, sequence_parallel=True)
    assert sequence.activations < split.activations < whole.activations
    # sequence parallelism halves what the norms keep (fp32, per token: h per norm, two per block and the
    # final one); the projections' gathered inputs stay whole
    tokens, h = 2 * 64, TINY.dim
    assert split.activations - sequence.activations == 4 * tokens * (2 * TINY.n_layers + 1) * h // 2
    assert split.logits == whole.logits  # the loss runs on the whole logits (no loss parallelism)


def test_loss_parallelism_splits_the_logits_over_tp():
    split, lost = _estimate(world=2, tp=2), _estimate(world=2, tp=2, loss_parallel=True)
    assert lost.logits * 2 == split.logits and lost.activations == split.activations
    assert ", tp 2 (loss parallel)" in lost.inputs.label
    both = _estimate(world=2, tp=2, sequence_parallel=True, loss_parallel=True)
    assert ", tp 2 (sequence parallel, loss parallel)" in both.inputs.label


def test_the_collectives_per_block_are_named():
    assert "per block, 2 all-reduces over tp of 0.0 MiB each" in str(_estimate(world=2, tp=2))
    note = str(_estimate(world=2, tp=2, sequence_parallel=True))
    assert "with sequence parallelism: per block, 2 all-gathers + 2 reduce-scatters over tp" in note


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(world=3, tp=2), "tp=2 with 3 processes: the world must be a multiple of tp"),
        (dict(world=4, tp=4), "tp=4 does not divide the model's 2 key/value heads"),
        (dict(world=2, sequence_parallel=True), "also give tp > 1"),
        (dict(world=2, loss_parallel=True), "loss_parallel=True splits the logits over the tp ranks: also give tp > 1"),
    ],
)
def test_tp_estimate_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        _estimate(**kwargs)


def test_plan_and_estimate_commands_know_tp(capsys):
    args = ["--model.name", "llama-tiny", "--data.seq_len", "64", "--train.batch_size", "8", "--engine.devices", "2"]
    split = ["--engine.tp", "2", "--engine.sequence_parallel", "true", "--engine.loss_parallel", "true"]
    assert cli.main(["plan", *args, *split]) == 0
    out = capsys.readouterr().out
    assert "micro-batch 8 x 1 accumulation step" in out and ", tp 2 (sequence parallel, loss parallel)" in out
    assert "strategy full_shard, tp 2 (sequence parallel, loss parallel), shard group of 1" in out
    assert "2 all-gathers + 2 reduce-scatters over tp" in out
    # 12 GPUs, tp 4: 3 data-parallel ranks, too few for a hybrid group (the default strategies drop it)
    assert cli.main(["estimate", "--model", "8b", "--gpus", "12", "--tp", "4"]) == 0
    out = capsys.readouterr().out
    assert "full_shard, tp 4" in out and "hybrid" not in out and "2 all-reduces over tp of 32.0 MiB" in out
    assert "/ 3 = " in out  # the model states' arithmetic: the TP-local model over 3 ranks
