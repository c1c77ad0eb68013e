"""Checkpoints of sharded training: sharded or full, resharded on load, committed atomically.

    st.save_checkpoint(path, {"model": model, "optimizer": opt, "scheduler": sched, "step": 120})
    rest = st.load_checkpoint(path, {"model": model, "optimizer": opt, "scheduler": sched})

The call chain: entries (what `state` holds) -> save (snapshot, write, commit) with sharded / full
writers, optim_state (optimizer state <-> units), objects and rng (per-rank torch files) and
commit (staging, rename, latest, rotation); load -> source (a saved module read by name) with the
sharded / full sources. format names every file and field; docs/checkpoint-format.md describes
them. convert turns a sharded checkpoint into one safetensors file without a process group.
"""

from .load import load_checkpoint
from .save import save_checkpoint

__all__ = ["load_checkpoint", "save_checkpoint"]
