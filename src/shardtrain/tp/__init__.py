"""Tensor parallelism composed with sharding: plans, the 2-D mesh's roles, FSDP2's placements."""

from .boxes import SPLITS, Box, chunk, held_box, split_of, stores
from .mesh import FLAT_NAMES, HYBRID_NAMES, MeshDims, is_tensor_parallel_mesh, mesh_dims
from .placements import mesh_placements, replicated_on_tp
from .plans import HF_STYLES, TpPlan, hf_plan, llama_plan, plan_for, resolve_plan, translate_hf_plan

__all__ = [
    "Box",
    "chunk",
    "held_box",
    "split_of",
    "stores",
    "FLAT_NAMES",
    "HF_STYLES",
    "HYBRID_NAMES",
    "SPLITS",
    "MeshDims",
    "TpPlan",
    "hf_plan",
    "is_tensor_parallel_mesh",
    "llama_plan",
    "mesh_dims",
    "mesh_placements",
    "plan_for",
    "replicated_on_tp",
    "resolve_plan",
    "translate_hf_plan",
]
