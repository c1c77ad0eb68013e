"""Size tokens of `shardtrain bench --sizes` (bench/sizes.py): settings of their own per size, so the
1.5B and the 8-layer 8B shape at their own batch and checkpointing come from one invocation; and the
float8 mode's specs and models."""

import argparse

import pytest

from shardtrain.bench.sizes import BenchSize, parse_size
from tests.bench.test_runner import options


def test_a_token_sets_layers_batch_and_checkpointing():
    assert parse_size("1.5b") == BenchSize(name="1.5b")
    assert parse_size("8b:layers=8:batch=1:ac") == BenchSize(name="8b", layers=8, batch=1, ac=True)
    cfg = parse_size("8b:layers=8").model_config(seq=1024)
    assert (cfg.n_layers, cfg.dim, cfg.max_seq_len) == (8, 4096, 1024)


@pytest.mark.parametrize("token", ["8b:layers=0", "8b:depth=8", "8b:batch", "8b:ac=1", "3b"])
def test_bad_tokens_name_the_part(token):
    with pytest.raises(ValueError, match=r"is not a setting; use NAME|unknown Llama size"):
        parse_size(token)


def test_each_size_runs_with_its_own_settings():
    plan = options(sizes=("1.5b", "8b:layers=8:batch=1:ac"), compile=True, float8=True)
    small, eight = (plan.spec(size=s, engine="fsdp2") for s in plan.sizes)
    assert (small.batch, small.ac, small.seq, small.float8) == (2, False, 4096, True)
    assert (eight.batch, eight.ac, eight.seq, eight.model_config().n_layers) == (1, True, 4096, 8)


def test_float8_needs_compile_and_the_cli_implies_it():
    from shardtrain.cli.bench import options_from_args, register

    with pytest.raises(ValueError, match="float8=True needs compile=True"):
        options(sizes=("1.5b",), float8=True).spec(size="1.5b", engine="shardtrain")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["bench", "--device", "cpu", "--sizes", "1.5b", "--float8"])
    resolved = options_from_args(args)
    assert resolved.float8 and resolved.compile


def test_every_engine_starts_from_the_same_float8_model():
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    from shardtrain.bench.same_weights import build_meta_model

    named = build_meta_model(parse_size("1.5b:layers=2").model_config(), float8=True)
    converted = [n for n, m in named.named_modules if isinstance(m, Float8Linear)]
    assert len(converted) == 2 * 5 and "head" not in converted  # wq, wo, w1, w3, w2 per block
    assert not [
        n
        for n, m in build_meta_model(parse_size("1.5b:layers=2").model_config()).named_modules
        if isinstance(m, Float8Linear)
    ]
