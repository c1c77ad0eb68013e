"""The memory estimate and the automatic plan of fine-tunes: a frozen base, LoRA adapters, a trainable share."""

from types import SimpleNamespace

import pytest
import torch

import shardtrain as st
from shardtrain.planning.cost.activations import block_bytes, chunked_loss_wins, loss_bytes
from shardtrain.planning.cost.auto import choose_plan
from shardtrain.planning.cost.estimate import OVERHEAD_BYTES
from shardtrain.planning.cost.sizes import GiB
from shardtrain.planning.cost.trained import lora_parts
from tests.planning.cost import peak_ranks

# Llama-3-8B as a Hugging Face config
HF_8B = SimpleNamespace(
    hidden_size=4096,
    num_hidden_layers=32,
    intermediate_size=14336,
    vocab_size=128256,
    num_attention_heads=32,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)
P8 = 8_030_261_248
ADAPTERS8 = 32 * 8 * ((4096 + 4096) + (4096 + 1024))  # r * (in + out) for q_proj and v_proj, 32 blocks
T = 4096


def test_lora_bill_by_hand():
    e = st.estimate_memory(HF_8B, world_size=1, lora_rank=8, lora_targets=("q_proj", "v_proj"), seq_len=T)
    m = e.inputs.model
    assert (m.trainable_params, m.frozen_params) == (ADAPTERS8, P8)
    assert e.peak_phase == "forward + loss"
    # the bf16 base as stored (no fp32 master), fp32 masters and AdamW moments of the adapters only
    assert e.parameters == 2 * P8 + 4 * ADAPTERS8 and e.optimizer_state == 8 * ADAPTERS8
    assert e.gradients == 0 and e.unsharded_params == 0  # world 1: the bf16 base computes in place
    # per token and block, in bf16: q, k, v and the attention output (kernel), silu's input and both
    # factors of the product, the attention-norm output (input of the q / v adapters), the adapters' A
    # outputs (2 x 8); fp32: the two norms' input copies, the kernel's log-sum-exp, the norms' statistics
    per_token = 2 * (4096 + 2 * 1024 + 4096 + 3 * 14336 + 4096 + 16) + 2 * 4 * 4096 + 4 * 32 + 8
    assert per_token == 147_624
    assert e.activations == 32 * T * per_token + T * 4 * 4096  # + the final norm's fp32 input copy
    assert e.logits == 12 * T * 128256
    # the full-training bill of the same model peaks at the end of backward with 16 B/param
    full = st.estimate_memory(HF_8B, world_size=1, seq_len=T)
    assert full.peak_phase == "backward end" and full.model_states == 16 * P8


def test_chunked_loss_bill_by_hand():
    """Only a chunk of logits lives: 128 rows (logits as large as the 4096 x 4096 hidden states), fp32 logits
    and log-probabilities and the bf16 gradient, beside the hidden states' bf16 gradient; a trained head adds
    its weight's fp32 gradient and a bf16 product."""
    lora = dict(world_size=1, lora_rank=8, lora_targets=("q_proj", "v_proj"), seq_len=T)
    full = st.estimate_memory(HF_8B, **lora)
    chunked = st.estimate_memory(HF_8B, **lora, chunked_loss=True)
    assert chunked.logits == (4 + 4 + 2) * 128 * 128256 + 2 * T * 4096
    assert chunked.activations == full.activations and chunked.logits < full.logits / 30
    assert st.estimate_memory(HF_8B, **lora, chunked_loss="auto").logits == chunked.logits
    sizes = dict(dim=4096, vocab=128256, compute_bytes=2)
    trained = loss_bytes(tokens=T, **sizes, head_trains=True, chunked=True)
    assert trained == chunked.logits + (4 + 2) * 128256 * 4096
    # a trained head at 512 tokens: the weight's gradient outweighs the logits, so auto keeps them whole
    assert chunked_loss_wins(tokens=T, **sizes, head_trains=True)
    assert not chunked_loss_wins(tokens=512, **sizes, head_trains=True)
    assert chunked_loss_wins(tokens=512, **sizes, head_trains=False)
    with pytest.raises(ValueError, match="chunked_loss='yes' is invalid"):
        st.estimate_memory(HF_8B, world_size=1, chunked_loss="yes")


def test_frozen_fp32_base_sharded_and_a_trainable_share():
    lora = st.estimate_memory("8b", world_size=2, lora_rank=16, lora_targets="wq,wk,wv,wo", precision="fp32")
    adapters = 32 * 16 * ((4096 + 4096) * 2 + (4096 + 1024) * 2)
    assert lora.inputs.model.trainable_params == adapters
    assert lora.parameters == (4 * P8 + 4 * adapters) // 2 and lora.optimizer_state == 8 * adapters // 2
    assert lora.inputs.model.trained == lora_parts(("wq", "wk", "wv", "wo"), rank=16)
    share = st.estimate_memory("8b", world_size=2, trainable_fraction=0.25)
    trainable = round(0.25 * P8)
    assert share.parameters == (4 * trainable + 2 * (P8 - trainable)) // 2
    assert share.optimizer_state == 8 * trainable // 2
    kept = st.estimate_memory("8b", world_size=2, trainable_fraction=0.25, keep_grads=True)
    assert kept.gradients == 4 * trainable // 2
    # which projections train is not known: the activations are full training's
    assert share.activations == st.estimate_memory("8b", world_size=2).activations


def test_block_activations_per_trained_part():
    shape = st.estimate_memory("8b", world_size=1).inputs.model.shape
    full = block_bytes(shape, tokens=1, seq_len=T, compute_bytes=2)
    frozen_qv = block_bytes(shape, tokens=1, seq_len=T, compute_bytes=2, trained=lora_parts(("wq", "wv"), rank=8))
    # LoRA on q / v drops the output projection's input (q), the ffn-norm output (h) and w2's input (f)
    assert full - frozen_qv == 2 * (4096 + 4096 + 14336) - 2 * 16
    everything = lora_parts(("wq", "wo", "w1", "w2"), rank=8)
    assert full - block_bytes(shape, tokens=1, seq_len=T, compute_bytes=2, trained=everything) == -2 * 32


def test_a_live_peft_model_matches_its_description():
    pytest.importorskip("peft")
    model = peak_ranks.meta_model(lora=True)
    live = st.estimate_memory(model, world_size=2, wrap=peak_ranks.blocks(), seq_len=512, micro_batch=2)
    described = st.estimate_memory(
        peak_ranks.hf_config(), world_size=2, seq_len=512, micro_batch=2, lora_rank=8, lora_targets=("q_proj", "v_proj")
    )
    adapters = peak_ranks.LAYERS * 8 * ((peak_ranks.DIM + peak_ranks.DIM) + (peak_ranks.DIM + peak_ranks.DIM // 2))
    assert live.inputs.model.trainable_params == described.inputs.model.trainable_params == adapters
    assert live.inputs.model.trained == described.inputs.model.trained
    assert live.total == described.total


def test_plan_of_a_peft_model_shows_frozen_units_without_gradients_or_optimizer_state():
    pytest.importorskip("peft")
    model = peak_ranks.meta_model(lora=True)
    plan = st.plan(model, wrap=peak_ranks.blocks(), world_size=2, mixed_precision="bf16")
    root, *layers = plan.units
    assert root.frozen and root.grad_bytes == 0 and root.optimizer_bytes == 0
    assert root.sharded_bytes == root.padded * 2 // 2  # bf16 as built, no fp32 master
    per_block = 8 * ((peak_ranks.DIM + peak_ranks.DIM) + (peak_ranks.DIM + peak_ranks.DIM // 2))
    for row in layers:
        assert row.trainable == per_block and row.grad_bytes == per_block * 4 // 2
        assert row.optimizer_bytes == 2 * row.grad_bytes
    assert any("are frozen (1 of 3 units wholly)" in n for n in plan.notes)


# Measured on one H200, Llama-3-8B shape, bf16 compute, batch 1 x 4096, fused AdamW (issue 33; BENCHMARKS.md,
# 'Loading a pretrained 8B ...'): LoRA rank (None: full fine-tuning), checkpointing, GiB
HF_8B_PEAKS = [(8, False, 39.9), (8, True, 22.49), (None, True, 124.36)]


@pytest.mark.parametrize("rank,ac,gib", HF_8B_PEAKS)
def test_8b_fine_tunes_against_measured_peaks(rank, ac, gib):
    e = st.estimate_memory(HF_8B, world_size=1, lora_rank=rank, activation_checkpointing=ac, seq_len=T)
    assert abs(e.total / GiB / gib - 1) < 0.05  # the training estimate's band (test_estimate.py)


def test_auto_plan_of_the_8b_lora_skips_checkpointing():
    choice = choose_plan(HF_8B, world_size=1, device_memory="141GB", seq_len=T, micro_batch=1, lora_rank=8)
    assert choice.recompute_every == 0 and choice.cpu_offload == 0 and choice.micro_batch == 1
    assert choice.predicted_bytes < 45 * GiB
    speedup = [r for r in choice.reasons if r.startswith("vs full_shard with every block checkpointed")]
    assert speedup and "1.31x" in speedup[0]  # measured 12,812 / 9,723 tokens/s = 1.32x


def test_fine_tune_inputs_are_checked():
    with pytest.raises(ValueError, match=r"lora targets \['qkv'\]: unknown \['qkv'\].*q_proj,v_proj"):
        st.estimate_memory("8b", world_size=1, lora_rank=8, lora_targets=("qkv",))
    with pytest.raises(ValueError, match="lora_rank=0 must be a positive integer"):
        st.estimate_memory("8b", world_size=1, lora_rank=0)
    with pytest.raises(ValueError, match="both say what trains"):
        st.estimate_memory("8b", world_size=1, lora_rank=8, trainable_fraction=0.1)
    with pytest.raises(ValueError, match=r"trainable_fraction=1.5 must be a share in \(0, 1\]"):
        st.estimate_memory("8b", world_size=1, trainable_fraction=1.5)
    with torch.device("meta"):
        module = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="live model, whose requires_grad already says what trains"):
        st.estimate_memory(module, world_size=1, lora_rank=8)


def _measured_against_estimated(pools, *, checkpointing: bool) -> tuple[int, int]:
    pytest.importorskip("peft")
    kwargs = dict(micro_batch=2, seq_len=256)
    (measured,) = pools(1).run(peak_ranks.measured_peak, lora=True, checkpointing=checkpointing, **kwargs)
    e = st.estimate_memory(
        peak_ranks.meta_model(lora=True),
        world_size=1,
        wrap=peak_ranks.blocks(),
        activation_checkpointing=checkpointing,
        **kwargs,
    )
    return measured, e.total - OVERHEAD_BYTES  # the overhead item stands for CUDA's work buffers


def test_small_lora_run_peak_on_the_cpu(pools):
    measured, estimated = _measured_against_estimated(pools, checkpointing=False)
    assert abs(estimated / measured - 1) < 0.05, (measured, estimated)


@pytest.mark.slow
def test_small_checkpointed_lora_run_peak_on_the_cpu(pools):
    measured, estimated = _measured_against_estimated(pools, checkpointing=True)
    assert abs(estimated / measured - 1) < 0.05, (measured, estimated)


def test_a_4bit_base_is_billed_at_its_packed_size_and_computes_from_its_shards():
    """QLoRA (base_bits=4): the blocks' linear weights at 0.5 B per parameter plus an int8 scale per 64 and a
    16-bit factor per 16,384; the embedding, head and norms in bf16; at world 1 nothing is gathered."""
    lora = dict(world_size=1, lora_rank=8, lora_targets=("q_proj", "v_proj"), seq_len=T)
    sixteen = st.estimate_memory(HF_8B, **lora)
    four = st.estimate_memory(HF_8B, **lora, base_bits=4)
    linear = 32 * (4096 * (2 * 4096 + 2 * 1024) + 3 * 4096 * 14336)
    frozen = round(linear * (0.5 + 1 / 64 + 2 / 16384) + (P8 - linear) * 2)
    assert four.inputs.model.frozen_bytes == frozen and four.inputs.model.frozen_params == P8
    assert four.parameters == frozen + 4 * ADAPTERS8 and four.unsharded_params == 0
    assert four.activations == sixteen.activations
    assert sixteen.total - four.total == sixteen.parameters - four.parameters > 9 * GiB
    sharded = st.estimate_memory(HF_8B, **{**lora, "world_size": 2}, base_bits=4)
    assert abs(2 * sharded.parameters - four.parameters) < 10**6  # each rank holds half of the packed base
    with pytest.raises(ValueError, match="base_bits=4 quantises the frozen base under LoRA adapters"):
        st.estimate_memory(HF_8B, world_size=1, base_bits=4)
