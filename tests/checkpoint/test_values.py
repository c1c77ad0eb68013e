"""Plain values survive JSON with their types; object state that weights_only cannot read is refused."""

import pytest
import torch

from shardtrain.checkpoint.values import check_weights_only, decode, encode


def test_round_trip_keeps_types():
    value = {
        "a": (1, 2.5, None),
        "b": [True, "x"],
        3: {"$k": torch.tensor(7, dtype=torch.int64)},
        "lr": torch.tensor(1e-3),
        "inf": float("inf"),
    }
    back = decode(encode(value, "v"))
    assert isinstance(back["a"], tuple) and back["a"] == value["a"] and back["b"] == value["b"]
    assert back[3]["$k"].dtype == torch.int64 and back[3]["$k"].item() == 7
    assert torch.equal(back["lr"], value["lr"]) and back["inf"] == float("inf")


def test_unstorable_values_are_named():
    with pytest.raises(ValueError, match=r"v\['x'\]\[1\] is a set"):
        encode({"x": [1, {2}]}, "v")
    check_weights_only({"a": [torch.ones(2), (1, "s")], "d": torch.float16}, "sd")
    with pytest.raises(ValueError, match=r"sd\['a'\]\[0\] is a builtins.object"):
        check_weights_only({"a": [object()]}, "sd")
