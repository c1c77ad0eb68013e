"""train/packing_probe.py through `check_packing_supported`: the probe decides by what a model does
(a model whose attention ignores the document mask is refused, the built-in Llama accepted), leaves
the model as it found it, runs once per model, and measures against the model's compute dtype."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardtrain.models.llama import Llama, llama_config
from shardtrain.train.packed import check_packing_supported, forward_logits
from shardtrain.train.packing_probe import MATCH_ULPS, PROBE_LENGTHS, PROBE_SHAPE, SEPARATION_ULPS, probe_packing
from tests.models_llama.packing import LENGTHS, VOCAB, packed_rows, tiny_hf_llama, worst_document_error
from tests.train.packing_ranks import sharded_verdicts, tensor_parallel_verdict

pytest.importorskip("transformers")
CPU = torch.device("cpu")
PROBE_FORWARDS = 1 + len(PROBE_LENGTHS[0])  # packed, first documents changed, the rows rotated (each document first)


def _counting(model: nn.Module) -> list[int]:
    calls = [0]
    model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _tiny_opt() -> nn.Module:
    import transformers

    config = transformers.OPTConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4, word_embed_proj_dim=32
    )
    torch.manual_seed(0)
    return transformers.OPTForCausalLM(config)


def _probe(model: nn.Module):
    return probe_packing(
        model,
        lambda ids, positions: model(input_ids=ids, position_ids=positions, use_cache=False).logits,
        name="probed",
        vocab_size=100,
        device=CPU,
    )


def test_the_probe_leaves_modes_gradients_and_the_random_stream_as_they_were():
    model = tiny_hf_llama("sdpa").train()
    model.model.layers[0].eval()
    modes = [m.training for m in model.modules()]
    rng = torch.get_rng_state()
    check_packing_supported(model, device=CPU)
    assert [m.training for m in model.modules()] == modes
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())


def test_the_verdict_is_kept_per_model_and_asked_again_when_its_attention_changes():
    model = tiny_hf_llama("sdpa")
    calls = _counting(model)
    ids, positions, _ = packed_rows(LENGTHS, vocab=VOCAB, seed=1)
    forward_logits(model, ids, position_ids=positions)
    assert calls[0] == PROBE_FORWARDS + 1
    forward_logits(model, ids, position_ids=positions)
    assert calls[0] == PROBE_FORWARDS + 2
    model.set_attn_implementation("eager")
    forward_logits(model, ids, position_ids=positions)
    assert calls[0] == 2 * PROBE_FORWARDS + 3

    leaking = _tiny_opt()
    calls = _counting(leaking)
    for _ in range(2):  # refused both times, probed once
        with pytest.raises(ValueError, match="^OPTForCausalLM lets packed documents attend to each other"):
            forward_logits(leaking, ids % 100, position_ids=positions)
    assert calls[0] == PROBE_FORWARDS


def test_every_probe_forward_has_one_shape_so_a_compiled_attention_compiles_once():
    """transformers' flex_attention is compiled per shape: the probe and the chunked loss's probe run
    theirs at PROBE_SHAPE only, so the start-up compiles one attention kernel before the first step."""
    from shardtrain.train.head_loss import probe

    model = tiny_hf_llama("sdpa")
    shapes = []
    model.register_forward_pre_hook(lambda _m, _a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    check_packing_supported(model, device=CPU)
    assert probe(model, device=CPU, packed=True).reason is None
    assert len(shapes) == PROBE_FORWARDS + 1 and set(shapes) == {PROBE_SHAPE}


class _DroppingPositions(nn.Module):
    """Takes position_ids, and drops them: every row one causal sequence."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner(tokens)


def test_the_built_in_llama_is_probed_and_accepted_and_a_model_dropping_positions_refused():
    torch.manual_seed(0)
    llama = Llama(llama_config("tiny", n_layers=2))
    calls = _counting(llama)
    check_packing_supported(llama, device=CPU)
    assert calls[0] == PROBE_FORWARDS
    dropping = _DroppingPositions(llama)
    pattern = (
        r"^_DroppingPositions lets packed documents attend to each other: a document's logits packed differ from "
        r"the document alone by up to (\S+) .* train unpacked: --data.packing false$"
    )
    with pytest.raises(ValueError, match=pattern) as refused:
        check_packing_supported(dropping, device=CPU)
    assert "\n" not in str(refused.value)


def test_an_attention_that_ignores_the_document_mask_is_refused():
    """A custom attention registered with transformers (whose masks are built as for sdpa) that attends
    causally over the whole row: the static facts all pass, the probe refuses."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    def whole_row_causal(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("whole_row_causal", whole_row_causal)
    AttentionMaskInterface.register("whole_row_causal", sdpa_mask)
    model = tiny_hf_llama("whole_row_causal")
    with pytest.raises(ValueError, match="^LlamaForCausalLM lets packed documents attend to each other"):
        check_packing_supported(model, device=CPU)
    ids, positions, docs = packed_rows(LENGTHS, vocab=VOCAB, seed=2)
    model.set_attn_implementation("sdpa")  # the same weights under sdpa: accepted, and right
    check_packing_supported(model, device=CPU)
    assert worst_document_error(model, ids, positions, docs) < 1e-5


def test_tolerances_follow_the_compute_dtype():
    bf16 = _probe(tiny_hf_llama("sdpa").to(torch.bfloat16))
    assert bf16.dtype == torch.bfloat16 and bf16.ulp == 2.0**-7 and bf16.keeps_documents_apart
    assert bf16.separation_tolerance == SEPARATION_ULPS * 2.0**-7 * bf16.scale
    assert bf16.match_tolerance == MATCH_ULPS * 2.0**-7 * bf16.scale
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 weights, bf16 matmuls
        assert _probe(tiny_hf_llama("sdpa")).dtype == torch.bfloat16
    precision = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # tf32 matmuls where the device has them
        tf32 = _probe(tiny_hf_llama("sdpa"))
    finally:
        torch.set_float32_matmul_precision(precision)
    assert tf32.dtype == torch.float32 and tf32.ulp == 2.0**-10
    fp32 = _probe(_tiny_opt())
    assert fp32.ulp == torch.finfo(torch.float32).eps and not fp32.keeps_documents_apart
    assert fp32.crosstalk > 1e4 * fp32.separation_tolerance


def test_all_zero_logits_show_nothing_and_are_refused():
    model = tiny_hf_llama("sdpa")
    with torch.no_grad():
        model.lm_head.weight.zero_()
    with pytest.raises(ValueError, match="^LlamaForCausalLM gave all-zero logits to the packing probe"):
        check_packing_supported(model, device=CPU)


def test_a_peft_model_is_refused_by_its_base_class():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(_tiny_opt(), config)
    with pytest.raises(ValueError, match="^OPTForCausalLM lets packed documents attend to each other"):
        check_packing_supported(model, device=CPU)


@pytest.mark.parametrize("mixed_precision", [None, "bf16"])
def test_sharded_models_are_probed_on_every_rank_in_their_compute_dtype(pools, mixed_precision):
    dtype = "torch.bfloat16" if mixed_precision else "torch.float32"
    for verdicts in pools(2).run(sharded_verdicts, mixed_precision):
        assert verdicts["llama"] == "accepted", verdicts
        assert verdicts["opt"].startswith("OPTForCausalLM lets packed documents attend to each other"), verdicts
        assert verdicts["llama dtype"] == verdicts["opt dtype"] == dtype


def test_a_tensor_parallel_model_is_probed_through_its_split_logits(pools):
    probes = pools(2).run(tensor_parallel_verdict)
    assert probes[0] == probes[1] and probes[0].startswith("PackingProbe(model='Llama', dtype=torch.float32"), probes
