"""Which parts of a Llama-style block train: what backward must keep from the forward of a fine-tune.

Backward through a frozen linear layer needs only its weight, not its input, so in a fine-tune of a
frozen base a projection's input stays saved only where the projection (or an adapter on it) trains;
`TrainedParts` names those parts for `activations`. Which input each part keeps: docs/design.md,
Note [Activation memory].
"""

from __future__ import annotations

from dataclasses import dataclass

# Target names of the projections, Hugging Face's and the built-in Llama's, by their place in a block.
ATTENTION_IN = ("q_proj", "k_proj", "v_proj", "wq", "wk", "wv")
ATTENTION_OUT = ("o_proj", "wo")
MLP_IN = ("gate_proj", "up_proj", "w1", "w3")
MLP_OUT = ("down_proj", "w2")
TARGETS = ATTENTION_IN + ATTENTION_OUT + MLP_IN + MLP_OUT


@dataclass(frozen=True, kw_only=True)
class TrainedParts:
    """What trains in each block (module docstring); all True: full training."""

    attention_in: bool = True
    attention_out: bool = True
    mlp_in: bool = True
    mlp_out: bool = True
    norms: bool = True
    head: bool = True
    adapter_rank: int = 0  # summed over a block's adapters: elements per token their A outputs keep


FULL_TRAINING = TrainedParts()


def check_targets(targets: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The LoRA target names, each a projection the planner knows; ValueError naming the others."""
    names = tuple(t.strip() for t in targets if t.strip())
    unknown = [t for t in names if t not in TARGETS]
    if unknown or not names:
        raise ValueError(
            f"lora targets {list(names)}: {'unknown ' + str(unknown) if unknown else 'none given'}; "
            f"name projections of a Llama block, e.g. q_proj,v_proj (known: {','.join(TARGETS)})"
        )
    return names


def lora_parts(targets: tuple[str, ...], *, rank: int) -> TrainedParts:
    """What a LoRA fine-tune of `targets` trains in each block (the base, norms and head frozen)."""
    names = set(check_targets(targets))
    return TrainedParts(
        attention_in=bool(names & set(ATTENTION_IN)),
        attention_out=bool(names & set(ATTENTION_OUT)),
        mlp_in=bool(names & set(MLP_IN)),
        mlp_out=bool(names & set(MLP_OUT)),
        norms=False,
        head=False,
        adapter_rank=rank * len(names),
    )
