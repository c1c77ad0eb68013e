"""A failure on any rank in any step of a save (full or sharded: writing the modules, writing the
optimizers, the commit) raises on every rank: a failing rank its own error, the others the first
failing rank's message naming that rank. The staging directory is removed and the last checkpoint and
`latest` are as they were; no rank hangs in a gather (tests/checkpoint/failures.py)."""

import re

import pytest

from tests.checkpoint.failures import fail_in


def _no_space(file: str) -> str:
    return (
        rf"\[Errno 28\] could not write {{run}}/step2\.tmp-[0-9a-f]{{{{32}}}}/{file}: No space left on device; "
        r"free space on that filesystem or save to a directory on another one \(the last committed "
        r"checkpoint is untouched\)"
    )


IO_ERROR = (
    r"\[Errno 5\] could not write {run}/step2: Input/output error; check that the directory exists and is "
    r"writable, or save to another directory \(the last committed checkpoint is untouched\)"
)
# name: (format, where it fails, the failing ranks, the first failing rank's error: type, message)
CASES = {
    "sharded-module": ("sharded", "module", [1], "CheckpointWriteError", _no_space("model-00001-of-00002.safetensors")),
    "sharded-module-on-both": (
        "sharded",
        "module",
        [0, 1],
        "CheckpointWriteError",
        _no_space("model-0000[01]-of-00002.safetensors"),  # each rank its own shard
    ),
    "sharded-optimizer": (
        "sharded",
        "optimizer",
        [0],
        "CheckpointWriteError",
        _no_space("model-00000-of-00002.safetensors"),
    ),
    "sharded-commit": ("sharded", "commit", [0], "CheckpointWriteError", IO_ERROR),
    "full-module": ("full", "module", [0], "CheckpointWriteError", _no_space("model.safetensors")),
    "full-optimizer": ("full", "optimizer", [0], "CheckpointWriteError", _no_space("optimizer.safetensors")),
    "full-optimizer-rows": (
        "full",
        "rows",
        [1],
        "RuntimeError",
        r"injected: the rows of exp_avg of \S+ cannot be assembled",
    ),
    "full-commit": ("full", "commit", [0], "CheckpointWriteError", IO_ERROR),
}


@pytest.mark.parametrize("case", CASES)
def test_a_failed_save_raises_the_same_error_on_every_rank(pools, tmp_path, case):
    fmt, where, failing, kind, message = CASES[case]
    errors = pools(2).run(fail_in, str(tmp_path), fmt, where, failing, timeout=60)
    first = failing[0]
    pattern = message.format(run=re.escape(str(tmp_path / "run")))
    assert errors[first][0] == kind, errors
    assert re.fullmatch(pattern, errors[first][1]), errors[first][1]
    for rank, (other_kind, other_message) in enumerate(errors):
        if rank in failing:  # its own error, of the same kind
            assert other_kind == kind and re.fullmatch(message.format(run=".*"), other_message), other_message
        else:
            assert (other_kind, other_message) == ("RuntimeError", f"rank {first} failed: {kind}: {errors[first][1]}")


@pytest.mark.slow
def test_a_failure_on_two_of_three_ranks_raises_everywhere(pools, tmp_path):
    errors = pools(3).run(fail_in, str(tmp_path), "full", "rows", [1, 2], timeout=60)
    kind, message = errors[1]
    assert kind == "RuntimeError" and re.fullmatch(CASES["full-optimizer-rows"][4], message), errors[1]
    assert errors[2] == errors[1]  # its own error, the same
    assert errors[0] == ("RuntimeError", f"rank 1 failed: RuntimeError: {message}")
