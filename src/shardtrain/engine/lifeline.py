"""A rank dies with the process that launched it.

When a launcher (`shardtrain train`, `Engine.launch`, torchrun's agent) is killed outright, nothing
stops its ranks: they would train on, write checkpoints and hold their devices with nobody left to
collect them. So each launched rank, as it joins, asks Linux to SIGKILL it when its parent exits
(`prctl(PR_SET_PDEATHSIG)`), and also starts a thread that polls `os.getppid()` and exits the
process once the parent changed: the fallback where prctl is unavailable (not Linux).

The launcher to watch is the parent at join time, except that our own launcher records its pid in
the environment first: a rank whose launcher died before the rank joined then sees that the
recorded launcher is gone and exits at once, instead of adopting its new parent.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

LAUNCHER_PID_ENV = "SHARDTRAIN_LAUNCHER_PID"
POLL_S = 0.5
_PR_SET_PDEATHSIG = 1


def mark_launcher() -> None:
    """In a launching process, before it starts ranks: record its pid for them to watch."""
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())


def die_with_launcher() -> None:
    """In a launched rank: exit (within `POLL_S`, at once where prctl works) when the launcher exits."""
    parent = os.getppid()
    recorded = os.environ.get(LAUNCHER_PID_ENV)
    if recorded and int(recorded) != parent and not _alive(int(recorded)):
        _exit(int(recorded))  # reparented already: the launcher died before this rank got here
    _kill_me_with_parent()
    if os.getppid() != parent:  # the parent died before prctl took effect
        _exit(parent)
    threading.Thread(target=watch, args=(parent,), name="shardtrain-lifeline", daemon=True).start()


def watch(parent: int, *, interval: float = POLL_S) -> None:
    """Return never: poll until this process's parent is no longer `parent`, then exit the process."""
    while os.getppid() == parent:
        time.sleep(interval)
    _exit(parent)


def _kill_me_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # on failure the watch thread remains


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _exit(launcher: int) -> None:
    try:
        print(
            f"rank {os.environ.get('RANK', '?')} (pid {os.getpid()}): its launcher (pid {launcher}) is gone; exiting",
            file=sys.stderr,
            flush=True,
        )
    except (OSError, ValueError):
        pass  # the launcher's end of stderr may be gone too
    os._exit(1)
