"""Start the local processes through torch's elastic launcher (the machinery behind torchrun).

Two modes, as in Lightning Fabric:

- `spawn(fn, args, nprocs)`: run a picklable `fn(*args)` in `nprocs` spawned processes and return
  their results by rank;
- `relaunch_script(nprocs)`: re-run the current command line (`python script.py ...`,
  `python -m pkg ...` or a console script) in `nprocs` processes; the children find RANK/WORLD_SIZE
  in their environment and join the group instead of launching again.

In both, the elastic agent watches the children: when one fails it stops the others, so a crashed
rank never leaves its peers blocked in a collective; and the children watch this process (see
lifeline.py): killed, it takes them along.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .lifeline import mark_launcher

_LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


def _launch_config(nprocs: int):
    from torch.distributed.launcher.api import LaunchConfig

    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nprocs,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # torchrun --standalone: a free port on this host
        max_restarts=0,
        monitor_interval=0.1,
    )


@contextlib.contextmanager
def _quiet_launcher() -> Iterator[None]:
    """Silence the agent's own log lines: the children print their errors, the caller gets the summary."""
    loggers = [logging.getLogger(name) for name in _LAUNCHER_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def spawn(fn: Callable[..., Any], args: tuple, *, nprocs: int) -> dict[int, Any]:
    """Run `fn(*args)` on `nprocs` local ranks; return {rank: result}.

    Raises torch's `ChildFailedError` (with the failing rank's traceback) if any rank fails.
    """
    from torch.distributed.launcher.api import elastic_launch

    mark_launcher()
    with _quiet_launcher():
        return elastic_launch(_launch_config(nprocs), fn)(*args)


def script_command() -> list[str]:
    """The interpreter arguments that re-run this process's command (options such as -X and -u kept)."""
    if not sys.argv or sys.argv[0] in ("", "-"):
        raise RuntimeError(
            "Engine.launch() without a function re-runs the current script, but this is an interactive "
            "session or a script read from stdin; call engine.launch(fn, *args) or run under torchrun"
        )
    return list(sys.orig_argv[1:])


def relaunch_script(*, nprocs: int, extra_args: Sequence[str] = ()) -> int:
    """Run the current command, `extra_args` appended, in `nprocs` processes; return the exit code to leave with.

    Ctrl-C (or SIGTERM) stops every rank and returns 128 + the signal number, as a shell would.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    command = script_command()
    mark_launcher()
    try:
        with _quiet_launcher():
            elastic_launch(_launch_config(nprocs), sys.executable)(*command, *extra_args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        print(
            f"launcher: rank {rank} exited with code {failure.exitcode}; the other ranks were stopped", file=sys.stderr
        )
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0
