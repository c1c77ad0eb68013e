"""Checkpoints across a change of (dp, tp): the next steps after loading equal the uninterrupted run."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from shardtrain.checkpoint.convert import convert_checkpoint
from tests.tp.resume import resume, save_then_continue

TOL = dict(rtol=1e-5, atol=1e-5)


def _check(expected: dict, results: list[dict]) -> None:
    for got in results:
        assert got.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], **TOL, msg=name)


def test_resume_two_ranks_and_convert(pools, tmp_path):
    directory = str(tmp_path / "ckpt")
    expected = pools(2).run(save_then_continue, directory, (1, 2))[0]
    # (1, 2) -> (2, 1) through the sharded files, -> (1, 1) (the 1-D engine) through the full ones
    for fmt, mesh in (("sharded", (2, 1)), ("full", (1, 1))):
        _check(expected, pools(2).run(resume, f"{directory}/{fmt}", mesh))
    # `shardtrain convert`: the sharded (1, 2) checkpoint's global tensors are the full checkpoint's
    converted = convert_checkpoint(f"{directory}/sharded", tmp_path / "model.safetensors")
    whole, full = load_file(converted.weights), load_file(f"{directory}/full/model.safetensors")
    assert whole.keys() == full.keys() and "layers.0.attn.wo.weight" in whole
    for name, tensor in full.items():
        torch.testing.assert_close(whole[name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_resume_four_ranks(pools, tmp_path):
    directory = str(tmp_path / "ckpt")
    expected = pools(4).run(save_then_continue, directory, (2, 2))[0]
    for mesh in [(4, 1), (1, 4), (1, 1)]:
        _check(expected, pools(4).run(resume, f"{directory}/sharded", mesh))
