"""The identical model of every engine: a Llama built on the meta device, initialised by name.

Engines materialise parameters in different orders (unit by unit, module by module, or all at once)
and hold different pieces of them (a flat shard, a DTensor row block, the whole tensor). Drawing
each parameter from a generator seeded by (seed, its name) makes the values independent of that
order and of the wrapping, so every engine starts from the same weights on a given device kind.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..models.llama import Llama, LlamaConfig, RMSNorm

INIT_STD = 0.02


@dataclass(frozen=True, kw_only=True)
class NamedModel:
    """A meta-device Llama and its modules under their names, taken before any engine wraps it."""

    model: Llama
    named_modules: tuple[tuple[str, nn.Module], ...]

    def init_all_(self, *, seed: int, device: torch.device) -> None:
        """Fill every parameter and buffer (already allocated, plain or DTensor) with its initial value."""
        for prefix, module in self.named_modules:
            init_module_(module, prefix, seed=seed, device=device)

    def param_init_fn(self, *, seed: int, device: torch.device, allocate: bool) -> Callable[[nn.Module], None]:
        """A per-module initialiser for engines that materialise lazily (shardtrain, torch FSDP1).

        shardtrain allocates the module's tensors before calling it; FSDP1 leaves that to the function
        (`allocate=True`).
        """
        prefixes = {id(m): prefix for prefix, m in self.named_modules}

        def init(module: nn.Module) -> None:
            if allocate:
                module.to_empty(device=device, recurse=False)
            init_module_(module, prefixes[id(module)], seed=seed, device=device)

        return init


def build_meta_model(cfg: LlamaConfig, *, float8: bool = False) -> NamedModel:
    """A Llama on the meta device (no memory, no initialisation yet); with `float8`, its large Linears
    already torchao's float8 ones (`ops.float8`), so every engine wraps the same converted modules."""
    with torch.device("meta"):
        model = Llama(cfg)
    if float8:
        from ..ops.float8 import convert_to_float8

        convert_to_float8(model)
    return NamedModel(model=model, named_modules=tuple(model.named_modules()))


def initial_value(name: str, shape: torch.Size, *, norm: bool, seed: int, device: torch.device) -> torch.Tensor:
    """The fp32 initial value of parameter `name`: ones for a norm weight, else N(0, 0.02²)."""
    if norm:
        return torch.ones(shape, device=device)
    generator = torch.Generator(device=device)
    generator.manual_seed((seed << 32) + zlib.crc32(name.encode()))
    return torch.empty(shape, device=device).normal_(0.0, INIT_STD, generator=generator)


def init_module_(module: nn.Module, prefix: str, *, seed: int, device: torch.device) -> None:
    """Initialise `module`'s own parameters by name; its own buffers through its `reset_parameters`."""
    with torch.no_grad():
        for attr, param in module._parameters.items():
            if param is None:
                continue
            name = f"{prefix}.{attr}" if prefix else attr
            value = initial_value(name, param.shape, norm=isinstance(module, RMSNorm), seed=seed, device=device)
            _copy_into(param, value)
        if any(b is not None for b in module._buffers.values()):
            module.reset_parameters()  # the Llama root's rotary tables: computed, not random


def _copy_into(param: torch.Tensor, value: torch.Tensor) -> None:
    if isinstance(param, DTensor):
        # The local piece of the full value, cut as the parameter is cut; no communication.
        local = distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(value)
