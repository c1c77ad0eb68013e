"""Tensor-parallel plans: which modules split how, in torch's `parallelize_module` vocabulary.

A plan maps module paths (with `*` wildcards, as `parallelize_module` reads them) to torch's
parallel styles. `llama_plan` is the Megatron split of the built-in Llama (torchtitan's recipe):
attention's q/k/v and the feed-forward's w1/w3 column-wise, their output projections row-wise, so
each block costs one all-reduce after attention and one after the feed-forward (or, under sequence
parallelism, an all-gather before and a reduce-scatter after each, with the norms computing on
sequence shards). `hf_plan` translates a transformers model's own plan strings.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from ..models.llama import Llama

TpPlan = dict[str, ParallelStyle]


def llama_plan(*, sequence_parallel: bool = False, loss_parallel: bool = False) -> TpPlan:
    """The plan of the built-in Llama (shardtrain.models.llama) for `st.shard(..., tp_plan=...)`.

    `sequence_parallel`: activations between blocks are split along the sequence over the tp ranks
    (the norms run on the shards), which cuts their memory by the tp size. `loss_parallel`: the
    logits stay split over the vocabulary (a DTensor), for `torch.distributed.tensor.parallel.
    loss_parallel()`, which computes the cross-entropy without gathering them; otherwise the head
    returns the whole logits. The input and output embeddings must not be tied.
    """
    for name, value in (("sequence_parallel", sequence_parallel), ("loss_parallel", loss_parallel)):
        if not isinstance(value, bool):
            raise TypeError(f"llama_plan: {name}={value!r} must be True or False")
    between = Shard(1) if sequence_parallel else Replicate()
    plan: TpPlan = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "head": ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    block: TpPlan = {
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=between),
        "ffn.w1": ColwiseParallel(),
        "ffn.w3": ColwiseParallel(),
        "ffn.w2": RowwiseParallel(output_layouts=between),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
        block |= {
            "attn_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            # Attention(x, cos, sin, mask) and FeedForward(x): gather the sequence before the projections
            "attn": PrepareModuleInput(
                input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None)
            ),
            "ffn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        }
    return plan | {f"layers.*.{path}": style for path, style in block.items()}


def _colwise_gather_output() -> ParallelStyle:
    return ColwiseParallel(output_layouts=Replicate())


def _embedding_rowwise() -> ParallelStyle:
    return RowwiseParallel(input_layouts=Replicate())


# transformers' plan strings this translator understands, and the torch style each one means
HF_STYLES = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": _colwise_gather_output,
    "embedding_rowwise": _embedding_rowwise,
}


def translate_hf_plan(strings: Mapping[str, str], *, prefix: str = "") -> TpPlan:
    """A plan of torch styles from transformers' plan strings (`config.base_model_tp_plan`), each
    path prefixed by `prefix` (the base model's attribute in a model with a head, e.g. "model.")."""
    plan: TpPlan = {}
    for path, kind in strings.items():
        if kind not in HF_STYLES:
            raise ValueError(
                f"tensor-parallel plan entry {path!r}: {kind!r} is not supported; "
                f"use one of {sorted(HF_STYLES)} or pass torch ParallelStyles in tp_plan"
            )
        plan[prefix + path] = HF_STYLES[kind]()
    return plan


def hf_plan(model: nn.Module) -> TpPlan:
    """The plan a transformers model declares: its own `_tp_plan` (transformers fills it from the
    config's `base_model_tp_plan` under the base model's prefix, plus the head's entries), else the
    config's `base_model_tp_plan` under the base model's prefix."""
    own = getattr(model, "_tp_plan", None)
    if isinstance(own, Mapping) and own:
        return translate_hf_plan(own)
    strings = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if not strings:
        raise ValueError(
            f"{type(model).__name__} declares no base_model_tp_plan in its config; pass tp_plan= as a dict of "
            "module paths to torch ParallelStyles (or to 'colwise' / 'rowwise')"
        )
    base = getattr(model, "base_model_prefix", "")
    prefix = f"{base}." if base and getattr(model, base, None) is not None else ""
    return translate_hf_plan(strings, prefix=prefix)


def plan_for(model: nn.Module, *, sequence_parallel: bool = False, loss_parallel: bool = False) -> TpPlan:
    """The plan of `model`: `llama_plan` for the built-in Llama, else the transformers model's own
    (`hf_plan`); sequence and loss parallelism are in the built-in Llama's plan only."""
    if isinstance(model, Llama):
        return llama_plan(sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    if sequence_parallel:
        raise ValueError(
            f"sequence_parallel=True with {type(model).__name__}: only the built-in Llama's plan has sequence "
            "parallelism; drop it, or pass your own tp_plan with SequenceParallel() styles"
        )
    if loss_parallel:
        raise ValueError(
            f"loss_parallel=True with {type(model).__name__}: only the built-in Llama's plan keeps the logits "
            "split; drop it, or pass your own tp_plan whose output head returns Shard(-1) DTensors"
        )
    return hf_plan(model)


def resolve_plan(plan: Mapping[str, ParallelStyle | str]) -> TpPlan:
    """`plan` with transformers' strings translated (a plan may mix them with torch styles)."""
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"tp_plan={plan!r}: pass a dict of module paths to torch ParallelStyles or to 'colwise' / 'rowwise' "
            "(st.tp.llama_plan(), st.tp.hf_plan(model))"
        )
    out: TpPlan = {}
    for path, style in plan.items():
        if isinstance(style, str):
            out |= translate_hf_plan({path: style})
        elif isinstance(style, ParallelStyle):
            out[path] = style
        else:
            raise TypeError(f"tp_plan[{path!r}]={style!r}: use a torch ParallelStyle or 'colwise' / 'rowwise'")
    return out
