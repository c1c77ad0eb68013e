"""torch.compile in every form users write trains exactly like eager on a sharded model.

The engine's hooks run outside compiled regions (torch._dynamo.disable), so a compiled block sees
its gathered parameters as plain inputs: one graph per block class, no graph break inside a block's
forward (the "compiled forward" form compiles with fullgraph=True), one recompilation for a new
sequence length. The forms compile with the aot_eager backend (dynamo and AOTAutograd, eager
kernels): results must then be bit-equal to eager. Inductor on the GPU: tests/gpu/test_compile_gpu.py.
"""

import pytest

from tests.core.compiled import FORMS, recompiles_per_length, train_form


@pytest.mark.parametrize(
    "strategy",
    [
        "full_shard",
        pytest.param("shard_grad_op", marks=pytest.mark.slow),
        pytest.param("no_shard", marks=pytest.mark.slow),
    ],
)
def test_every_form_trains_like_eager(pools, strategy):
    for form in FORMS:
        for r in pools(2).run(train_form, form, strategy):
            assert r["loss"] == 0.0 and r["weights"] == 0.0, (form, strategy, r)
            assert r["frames"] <= 2, (form, strategy, r)  # one graph for all blocks (a model compile: one more)
            if form == "compiled forward":
                assert r["breaks"] == 0, r


@pytest.mark.parametrize(
    "form", ["block.compile() after", pytest.param("torch.compile(block)", marks=pytest.mark.slow)]
)
def test_bf16_and_activation_checkpointing_match_eager(pools, form):
    for precision, ac in [("bf16", False), (None, True), ("bf16", True)]:
        for r in pools(2).run(train_form, form, "full_shard", precision=precision, ac=ac):
            assert r["loss"] == 0.0 and r["weights"] == 0.0, (form, precision, ac, r)
            assert r["frames"] == 1, (form, precision, ac, r)


def test_a_new_sequence_length_recompiles_once(pools):
    for r in pools(2).run(recompiles_per_length):
        assert r["frames"] == [1, 2, 2, 2], r  # the second length marks the sequence dimension dynamic
