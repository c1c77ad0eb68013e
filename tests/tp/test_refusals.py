"""tp/refusals.py: the one refusal of offload with tensor parallelism, as st.shard and the Engine word it."""

import pytest

from shardtrain.policy import CPUOffload
from shardtrain.tp.refusals import refuse_offload


def test_offload_with_tp_is_refused_naming_the_call_and_the_fix():
    with pytest.raises(ValueError) as caught:
        refuse_offload(CPUOffload(), spelled="Engine(tp=2)", given=True)
    message = str(caught.value)
    assert message.startswith("Engine(tp=2) with cpu_offload=True: offload is not supported with tensor parallelism")
    assert message.endswith("drop cpu_offload or tp") and "\n" not in message


def test_no_offload_passes():
    assert refuse_offload(None, spelled="st.shard with a tensor-parallel mesh", given=False) is None
