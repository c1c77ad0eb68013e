"""Tensor parallelism composed with sharding (docs/api.md): the plans `st.shard(tp_plan=...)` applies and
the mesh's dimension names. The rest of tp/ is the engine's own (docs/design.md lists its files)."""

from .mesh import FLAT_NAMES, HYBRID_NAMES
from .plans import hf_plan, llama_plan, plan_for

__all__ = ["FLAT_NAMES", "HYBRID_NAMES", "hf_plan", "llama_plan", "plan_for"]
