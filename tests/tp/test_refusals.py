"""tp/refusals.py: the one refusal of offload, and of the automatic plan, with tensor parallelism, as each
entry words it (st.shard, st.shard_auto, the Engine, `shardtrain train`/`plan`)."""

import pytest

import shardtrain as st
from shardtrain.policy import CPUOffload
from shardtrain.tp.refusals import refuse_auto, refuse_offload

AUTO_FIX = "use strategy 'full_shard' or 'shard_grad_op' (st.shard, not st.shard_auto) with tp, or drop tp"


def test_offload_with_tp_is_refused_naming_the_call_and_the_fix():
    with pytest.raises(ValueError) as caught:
        refuse_offload(CPUOffload(), spelled="Engine(tp=2)", given=True)
    message = str(caught.value)
    assert message.startswith("Engine(tp=2) with cpu_offload=True: offload is not supported with tensor parallelism")
    assert message.endswith("drop cpu_offload or tp") and "\n" not in message


def test_no_offload_passes():
    assert refuse_offload(None, spelled="st.shard with a tensor-parallel mesh", given=False) is None


def test_auto_with_tp_is_refused_naming_the_call_and_the_fix():
    with pytest.raises(ValueError) as caught:
        refuse_auto(auto=True, tp=True, spelled="engine.tp=2")
    message = str(caught.value)
    assert message == f"engine.tp=2: the automatic plan does not plan tensor parallelism; {AUTO_FIX}"


@pytest.mark.parametrize("auto, tp", [(True, False), (False, True), (False, False)])
def test_auto_or_tp_alone_passes(auto, tp):
    assert refuse_auto(auto=auto, tp=tp, spelled="engine.tp=2") is None


def test_the_engine_refuses_auto_with_tp_before_any_process_starts():
    policy = st.AutoPolicy(micro_batch=1, seq_len=8, device_memory="8GiB")
    with pytest.raises(ValueError) as caught:
        st.Engine(accelerator="cpu", devices=2, tp=2, strategy=policy)
    assert str(caught.value) == (
        f"Engine(tp=2) with strategy=st.AutoPolicy: the automatic plan does not plan tensor parallelism; {AUTO_FIX}"
    )
