"""What tensor parallelism refuses to run with, in one place: `st.shard` (core/shard_module.py) and
`Engine(tp=N)`, before any process starts (tp/engine_setup.py), raise the same error."""

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
