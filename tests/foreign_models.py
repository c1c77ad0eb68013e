"""Models nobody here wrote, for the parity tests: Hugging Face Mixtral, T5 and BERT built from configs
(nothing downloaded) and torch's own FSDP test transformer (`torch.testing._internal.common_fsdp`).

Each is wrapped so that `model(x)` returns logits shaped for `F.cross_entropy(logits, y)`
(`[batch, classes, positions]`), with dropout off (parity needs determinism); the wrap policy is the
model's own block classes, as a user would write it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

VOCAB = 256  # the token range of the tests' language-model batches


class LogitsOf(nn.Module):
    """`model(input_ids=x)` (or a model-specific call) as logits `[batch, vocab, positions]`."""

    def __init__(self, model: nn.Module, call: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.call = call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.call(self.model, x).transpose(1, 2)


def _no_dropout(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(m, nn.MultiheadAttention):
            m.dropout = 0.0
    return model


def hf_mixtral() -> nn.Module:
    """A mixture of experts: top-2 routing over 4 experts whose weights are 3-D parameters."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
    )
    return LogitsOf(MixtralForCausalLM(config), lambda m, x: m(input_ids=x).logits)


def hf_t5() -> nn.Module:
    """An encoder-decoder whose embedding is shared by encoder, decoder and the tied head; its decoder
    keeps a key/value cache by default (`use_cache`), which checkpointed blocks must not refill."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
    )
    return LogitsOf(T5ForConditionalGeneration(config), lambda m, x: m(input_ids=x, decoder_input_ids=x).logits)


def hf_bert() -> nn.Module:
    """A masked-language-model encoder with a tied decoder and a bias of its own."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return LogitsOf(BertForMaskedLM(config), lambda m, x: m(input_ids=x).logits)


class _SequenceFirst(nn.Module):
    """torch's FSDP test transformer takes (source, target) ids as [positions, batch]; the batch here is
    [batch, 6 source + 4 target positions]."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        src, tgt = x[:, :6].t(), x[:, 6:].t()
        return self.model(src, tgt).permute(1, 2, 0)  # [target positions, batch, vocab] -> [batch, vocab, positions]


def fsdp_transformer() -> nn.Module:
    """`TransformerWithSharedParams` of torch's FSDP tests: nn.Transformer, a tied embedding and output
    projection, a BatchNorm over the batch of 2, a float and a long buffer."""
    import torch.distributed as dist
    from torch.testing._internal.common_fsdp import DEVICEInitMode, TransformerWithSharedParams

    model = TransformerWithSharedParams(dist.group.WORLD, DEVICEInitMode.DEVICE_NEVER, add_bn=True, deterministic=False)
    return _SequenceFirst(_no_dropout(model))


def block_classes(kind: str) -> set[type[nn.Module]]:
    """The wrap (and checkpointing) policy a user writes for each: the model's own block classes."""
    if kind == "hf_mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

        return {MixtralDecoderLayer}
    if kind == "hf_t5":
        from transformers.models.t5.modeling_t5 import T5Block

        return {T5Block}
    if kind == "hf_bert":
        from transformers.models.bert.modeling_bert import BertLayer

        return {BertLayer}
    return {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}


FACTORIES = {"hf_mixtral": hf_mixtral, "hf_t5": hf_t5, "hf_bert": hf_bert, "fsdp_transformer": fsdp_transformer}
FSDP_VOCAB = 23  # TransformerWithSharedParams' vocabulary


def batch(kind: str, global_batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One global batch of token ids and their targets for `kind`."""
    if kind == "fsdp_transformer":
        return (
            torch.randint(0, FSDP_VOCAB, (global_batch, 10), generator=generator),
            torch.randint(0, FSDP_VOCAB, (global_batch, 4), generator=generator),
        )
    tokens = torch.randint(0, VOCAB, (global_batch, 17), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]
