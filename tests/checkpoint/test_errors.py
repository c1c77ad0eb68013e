"""Bad input fails with a ValueError naming the offending value and the remedy, on every rank."""

from tests.checkpoint.ranks import bad_inputs


def test_bad_inputs_are_reported(pools, tmp_path):
    messages = pools(2).run(bad_inputs, str(tmp_path))
    assert len(messages[0]) == len(messages[1]) == 14
    assert "rank 1 failed" in messages[0][6] and "rank 1 failed" not in messages[1][6]
