"""What tensor parallelism refuses to run with, in one place, so every entry raises the same error before
any process starts: offload (`st.shard`, core/shard_module.py, and `Engine(tp=N)`, tp/engine_setup.py) and
the automatic plan (`Engine(tp=N)`, `st.shard_auto` and `shardtrain train`/`plan` with strategy "auto")."""

from __future__ import annotations

from ..policy import CPUOffload


def refuse_offload(offload: CPUOffload | None, *, spelled: str, given: object) -> None:
    """Refuse CPU offload (`offload`, resolved from the user's `given` value) with tensor parallelism,
    which the offload package does not run; `spelled` names the call for the message."""
    if offload is not None:
        raise ValueError(
            f"{spelled} with cpu_offload={given!r}: offload is not supported with tensor parallelism; "
            "drop cpu_offload or tp"
        )


def refuse_auto(*, auto: bool, tp: bool, spelled: str) -> None:
    """Refuse the automatic plan (`auto`) with tensor parallelism (`tp`): the plan does not weigh it;
    `spelled` names the call and its values for the message."""
    if auto and tp:
        raise ValueError(
            f"{spelled}: the automatic plan does not plan tensor parallelism; use strategy 'full_shard' or "
            "'shard_grad_op' (st.shard, not st.shard_auto) with tp, or drop tp"
        )
