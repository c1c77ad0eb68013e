"""FSDP x tensor parallelism on a ("dp", "tp") mesh against one process (tests/tp/parity_ranks.py).

The default tier runs each kind on two ranks; the slow tier the (2, 2), (1, 4) and (4, 1) meshes,
bf16 with activation checkpointing, and hybrid sharding on ("replicate", "shard", "tp").
"""

from __future__ import annotations

import pytest

from tests.tp.parity_ranks import Case, agrees_with_fsdp2, exports_hf, forward_collectives, refusals, run_parity

DEFAULT = [
    Case(mesh=(1, 2)),
    Case(mesh=(1, 2), sequence_parallel=True, loss_parallel=True),
    Case(mesh=(2, 1)),
    Case(mesh=(1, 2), model="hf"),
]
SLOW = [
    Case(mesh=(2, 2)),
    Case(mesh=(2, 2), sequence_parallel=True, loss_parallel=True, prebuilt=True),
    Case(mesh=(1, 4), sequence_parallel=True),
    Case(mesh=(4, 1)),
    Case(mesh=(2, 2), sequence_parallel=True, precision="bf16", checkpointed=True, steps=4),
    Case(mesh=(2, 1, 2), sequence_parallel=True),  # hybrid: ("replicate", "shard", "tp")
]


def _id(case: Case) -> str:
    flags = [
        f for f in ("sequence_parallel", "loss_parallel", "prebuilt", "precision", "checkpointed") if getattr(case, f)
    ]
    return "-".join([case.model, "x".join(map(str, case.mesh)), *flags])


@pytest.mark.parametrize("case", DEFAULT, ids=_id)
def test_parity_two_ranks(pools, case):
    assert pools(2).run(run_parity, case) == [1, 1]


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=_id)
def test_parity_four_ranks(pools, case):
    assert pools(4).run(run_parity, case) == [1] * 4


def _expected_tp(case: Case, layers: int = 2) -> dict[str, int]:
    """The tp collectives of the Llama plan's forward: per block one all-reduce after attention and one
    after the feed-forward, or, under sequence parallelism, an all-gather before and a reduce-scatter
    after each; the embedding's reduction and the head's gathers around them."""
    if not case.sequence_parallel:
        return {"all_reduce": 2 * layers + 1, "all_gather_into_tensor": 1}
    return {
        "reduce_scatter_tensor": 2 * layers + 1,
        "all_gather_into_tensor": 2 * layers + 1 + (not case.loss_parallel),
    }


@pytest.mark.parametrize(
    "case", [Case(mesh=(1, 2)), Case(mesh=(1, 2), sequence_parallel=True), Case(mesh=(2, 1))], ids=_id
)
def test_collectives_of_one_forward_two_ranks(pools, case):
    dp, tp = case.mesh
    expected = (_expected_tp(case) if tp > 1 else {}) | ({"_allgather_base_": 3} if dp > 1 else {})
    assert pools(2).run(forward_collectives, case) == [expected] * 2


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", [Case(mesh=(2, 2)), Case(mesh=(2, 2), sequence_parallel=True, loss_parallel=True)], ids=_id
)
def test_collectives_of_one_forward_four_ranks(pools, case):
    # one dp all-gather per unit (the root and two blocks), over dp only, and the tp collectives
    assert pools(4).run(forward_collectives, case) == [_expected_tp(case) | {"_allgather_base_": 3}] * 4


def test_refusals_name_the_fix(pools):
    messages = pools(2).run(refusals)[0]
    assert len(messages) == 8, messages
    assert "tp_plan given with mesh=None" in messages[0] and "('dp', 'tp')" in messages[0]
    assert "dimensions ('data', 'tp')" in messages[1] and "mesh_dim_names=('dp', 'tp')" in messages[1]
    assert "strategy='no_shard' with a tensor-parallel mesh" in messages[2]
    assert "'embed.weight' and 'head.weight' are tied" in messages[3] and "untie them" in messages[3]
    assert "tp_plan split no parameter of Llama: its paths ['blocks.*.wq']" in messages[4]
    assert "(Block) is compiled (module.compile()) in a tensor-parallel model" in messages[5], messages[5]
    assert "peft" in messages[6] and "LoRA" in messages[6], messages[6]
    assert "layers.1 (Block) is compiled (torch.compile(module) in its parent)" in messages[7], messages[7]


def test_placements_and_tensors_match_torch_fsdp2_two_ranks(pools):
    assert pools(2).run(agrees_with_fsdp2, (1, 2)) == [1, 1]


@pytest.mark.slow
def test_placements_and_tensors_match_torch_fsdp2_four_ranks(pools):
    assert pools(4).run(agrees_with_fsdp2, (2, 2)) == [1] * 4


def test_save_pretrained_writes_global_tensors_and_load_pretrained_reads_blocks(pools, tmp_path):
    assert pools(2).run(exports_hf, str(tmp_path / "hf")) == [1, 1]
