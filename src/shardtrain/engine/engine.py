"""`Engine`: the Fabric-like front door to shardtrain.

A user's own training script keeps its loop; the engine owns what is tedious and easy to get
wrong around it: starting one process per device, joining the process group, building the model on
the meta device, sharding it, rebinding an optimizer that was built before sharding, clipping
gradients with the true global norm, skipping gradient sync on accumulation micro-batches, and
saving/loading sharded checkpoints. With `tp=N` it also splits each layer over N ranks (tensor
parallelism on a ("dp", "tp") mesh); the data-parallel ranks are then `world_size // N`.

Beside it: the collectives its ranks share (rank_collectives.py, a base of `Engine`), what `tp=N`
checks and builds (tp/engine_setup.py), and fp16's optimizer step through the loss scaler (fp16_step.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..core.rebind_optimizers import rebind, rebind_replaced
from ..core.shard_module import runtime_of
from ..ops.float8 import check_float8, convert_to_float8
from ..options import ShardOptions, is_auto, precision_name, resolve_options
from ..policy import AutoPolicy, CPUOffload, MixedPrecision, WrapPolicy
from ..sharding import shard_with
from ..strategy import Strategy
from ..tp.engine_setup import check_tensor_parallel, dp_tp_mesh, with_tensor_parallel
from ..tp.mesh import check_tp_divides
from . import launch as _launch
from .devices import (
    RankInfo,
    Topology,
    join_process_group,
    launched_externally,
    mark_failed,
    rank_info_from_env,
    resolve_topology,
)
from .fp16_step import step_through_scaler
from .lifeline import die_with_launcher
from .rank_collectives import RankCollectives

if TYPE_CHECKING:
    from ..ops.grad_scaler import GradScaler


class Engine(RankCollectives):
    """Run a training script on every local device with a fully sharded model.

    Args (all keyword-only):
        devices: "auto" (every visible GPU, else 2 CPU processes) or a number of local processes.
        accelerator: "auto", "cuda" or "cpu".
        strategy: a sharding strategy name accepted by `st.shard` ("full_shard", "shard_grad_op", ...), or
            `st.AutoPolicy(micro_batch=..., seq_len=...)`: planned at setup by `st.shard_auto`.
        precision: "auto" (bf16-mixed on CUDA, 32-true on CPU, where bf16 matmuls are slow),
            "bf16-mixed", "32-true", or anything `st.shard(mixed_precision=...)` accepts.
        wrap, activation_checkpointing, cpu_offload, param_init_fn, sync_module_states: passed to `st.shard`.
        compile: after sharding, `module.compile()` on each repeated block (`ops.compile.compile_blocks`),
            after activation checkpointing, as torch.compile pays on a sharded model.
        timeout: the process group's collective timeout (None: torch's default).
        tp: tensor parallelism: each layer split over `tp` ranks, parameters sharded over the
            `world_size // tp` data-parallel ranks (a ("dp", "tp") mesh); 1: none.
        tp_plan: with tp > 1, the plan `st.shard` applies (default: `st.tp.plan_for(model)`, the built-in
            Llama's or the transformers model's own).
        float8: at setup, before sharding, swap the large Linears (not the output head) for torchao's float8
            Linears (`ops.float8`); needs compile=True, and tp=1.
    """

    def __init__(
        self,
        *,
        devices: int | str = "auto",
        accelerator: str = "auto",
        strategy: Strategy | str | AutoPolicy = "full_shard",
        precision: MixedPrecision | str | None = "auto",
        wrap: WrapPolicy | None = None,
        activation_checkpointing: WrapPolicy | None = None,
        cpu_offload: CPUOffload | bool | float = False,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        sync_module_states: bool = False,
        timeout: timedelta | None = None,
        compile: bool = False,
        tp: int = 1,
        tp_plan: Mapping[str, Any] | None = None,
        float8: bool = False,
    ) -> None:
        if not isinstance(compile, bool):
            raise TypeError(f"Engine(compile={compile!r}): use True or False")
        check_float8(float8, compile=compile, tp=tp)
        self._float8 = float8
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"Engine(tp={tp!r}): give the number of ranks each layer is split over (1: none)")
        self._tp = tp
        self._mesh: DeviceMesh | None = None
        self._compile = compile
        self._devices = devices
        self._topology: Topology = resolve_topology(accelerator=accelerator, devices=devices)
        self.precision = precision_name(precision, accelerator=self._topology.accelerator)
        # fp16 needs dynamic loss scaling; the scaler is made once the device is known (setup).
        self.grad_scaler: GradScaler | None = None
        # st.AutoPolicy is planned at setup, when the model is known (st.shard_auto); the other
        # options are read once, here.
        self._auto = strategy if isinstance(strategy, AutoPolicy) else None
        if is_auto(strategy) and self._auto is None:
            raise ValueError(
                f"Engine(strategy={strategy!r}) needs the batch it will be fed to plan: pass "
                "strategy=st.AutoPolicy(micro_batch=..., seq_len=...)"
            )
        self._shard_kwargs: dict[str, Any] = dict(
            strategy="full_shard" if self._auto else strategy,
            wrap=wrap,
            mixed_precision=self.precision,
            activation_checkpointing=activation_checkpointing,
            cpu_offload=cpu_offload,
            param_init_fn=param_init_fn,
            sync_module_states=sync_module_states,
            tp_plan=tp_plan,
        )
        self._options = resolve_options(**self._shard_kwargs)
        if tp > 1:
            check_tensor_parallel(tp=tp, options=self._options, auto=self._auto, cpu_offload=cpu_offload)
            if not launched_externally():
                check_tp_divides(tp=tp, world_size=self._topology.num_processes, spelled=f"Engine(tp={tp})")
        self._strategy: Strategy | AutoPolicy = self._auto or self._options.strategy
        self._timeout = timeout
        self._info: RankInfo | None = None
        self._device: torch.device | None = None

    # ----------------------------------------------------------------------------------- launching

    def launch(self, fn: Callable[..., Any] | None = None, *args: Any, relaunch_args: Sequence[str] = ()) -> Any:
        """Start the processes and join the process group.

        - Under torchrun (RANK/WORLD_SIZE set) or in a world of one: join in this process, then run
          `fn(self, *args)` if given and return its result.
        - Launched plainly with several devices and no `fn`: re-run this script in one process per
          device, with `relaunch_args` appended to its command line, and exit with their exit code
          when they finish (this process does not return).
        - Launched plainly with `fn`: spawn the processes, run `fn(engine, *args)` on each, return
          rank 0's result. `fn` and `args` must be picklable (a module-level function).
        """
        if self._info is not None:
            raise RuntimeError("Engine.launch() was already called in this process")
        if launched_externally() or self._topology.num_processes == 1:
            self._join()
            return fn(self, *args) if fn is not None else None
        if fn is None:
            sys.exit(_launch.relaunch_script(nprocs=self._topology.num_processes, extra_args=relaunch_args))
        return _launch.spawn(_run_on_rank, (self, fn, args), nprocs=self._topology.num_processes)[0]

    def _join(self) -> None:
        if launched_externally():
            die_with_launcher()  # a killed launcher (ours or torchrun's agent) takes its ranks along
            info = rank_info_from_env()
            check_tp_divides(tp=self._tp, world_size=info.world_size, spelled=f"Engine(tp={self._tp})")
            if self._devices != "auto" and self._devices != info.local_world_size:
                raise ValueError(
                    f"Engine(devices={self._devices}) but the launcher started {info.local_world_size} "
                    "processes on this node; pass devices='auto' or match the launcher's --nproc_per_node"
                )
        else:
            info = RankInfo(rank=0, world_size=1, local_rank=0, local_world_size=1)
        self._device = join_process_group(self._topology, info, timeout=self._timeout)
        self._info = info

    def _require_launch(self) -> RankInfo:
        if self._info is None:
            raise RuntimeError("call engine.launch() before using the engine's ranks, devices or models")
        return self._info

    @property
    def rank(self) -> int:
        return self._require_launch().rank

    @property
    def world_size(self) -> int:
        return self._require_launch().world_size

    @property
    def local_rank(self) -> int:
        return self._require_launch().local_rank

    @property
    def tp(self) -> int:
        """The ranks each layer is split over (1: no tensor parallelism)."""
        return self._tp

    @property
    def data_parallel_size(self) -> int:
        """The ranks that read different data: world_size // tp (the ranks of one tp group read the same)."""
        return self.world_size // self._tp

    @property
    def data_parallel_rank(self) -> int:
        """This rank's coordinate on "dp" (init_device_mesh puts the tp ranks of one group next to each other)."""
        return self.rank // self._tp

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        self._require_launch()
        assert self._device is not None  # joined with the process group, as _info
        return self._device

    @property
    def strategy(self) -> Strategy | AutoPolicy:
        """The sharding strategy (an `st.AutoPolicy` until setup has planned it)."""
        return self._strategy

    @property
    def mixed_precision(self) -> MixedPrecision:
        """The engine's `precision` as `st.shard` runs it."""
        return self._options.precision

    # ------------------------------------------------------------------------------ model & optim

    @contextlib.contextmanager
    def init_module(self, *, empty_init: bool = True) -> Iterator[None]:
        """Build the model inside this block. With `empty_init`, parameters are created on the meta
        device (no memory, no init time); `setup` then materialises and initialises them unit by unit,
        so a model larger than one device's memory can be built."""
        with torch.device("meta") if empty_init else contextlib.nullcontext():
            yield

    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, **overrides: Any):
        """Shard `model` in place with the engine's settings; return it, or (model, optimizer).

        An optimizer built on the unsharded parameters is rebound, group by group and hyperparameters
        kept, to the sharded parameters that replace them. An optimizer may also be built after setup
        from `model.parameters()`. Keyword `overrides` (e.g. `wrap=`, `activation_checkpointing=`)
        replace the engine's `st.shard` settings for this model only.
        """
        self._require_launch()
        unknown = set(overrides) - set(self._shard_kwargs)
        if unknown:
            raise TypeError(
                f"Engine.setup got unknown settings {sorted(unknown)}; it accepts {sorted(self._shard_kwargs)}"
            )
        options = resolve_options(**{**self._shard_kwargs, **overrides}) if overrides else self._options
        options = dataclasses.replace(options, device=self.device)
        if self._float8:
            self.print(f"float8: {len(convert_to_float8(model))} Linears train in float8 (float8_rule.py's rule)")
        before = dict(model.named_parameters()) if self._tp > 1 else {}
        if self._tp > 1:
            options = self._with_tensor_parallel(model, options)
        if self._auto is not None:
            from ..planning.cost.shard_auto import shard_auto_with

            _, choice = shard_auto_with(model, self._auto, options)
            self.print(choice)  # the plan and its reasons, once (rank 0)
        else:
            shard_with(model, options)
        rebind_replaced(before, model)
        self._strategy = runtime_of(model, settle=False).strategy
        if self._compile:
            from ..ops.compile import compile_blocks

            compile_blocks(model)
        fp16 = options.precision.param_dtype is torch.float16
        if optimizer is None:
            if fp16:
                raise ValueError(
                    "precision='16-mixed' needs the optimizer at setup, so that its step() goes "
                    "through the loss scaler: call engine.setup(model, optimizer)"
                )
            return model
        rebind(optimizer)
        owned = {id(p) for p in model.parameters()}
        foreign = [tuple(p.shape) for group in optimizer.param_groups for p in group["params"] if id(p) not in owned]
        if foreign:
            raise ValueError(
                f"the optimizer holds {len(foreign)} parameter(s) (shapes {foreign[:3]}) that are not a "
                "parameter of the model given to Engine.setup; build the optimizer from that model's "
                "parameters"
            )
        if fp16:
            from ..ops.grad_scaler import GradScaler

            self.grad_scaler = self.grad_scaler or GradScaler(self.device.type)
            step_through_scaler(optimizer, self.grad_scaler)
        return model, optimizer

    def _with_tensor_parallel(self, model: nn.Module, options: ShardOptions) -> ShardOptions:
        """`options` on the ("dp", "tp") mesh (built once) with the model's plan (tp/engine_setup.py)."""
        if self._mesh is None:
            self._mesh = dp_tp_mesh(self.device, data_parallel=self.data_parallel_size, tp=self._tp)
        return with_tensor_parallel(model, options, mesh=self._mesh)

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, with the loss scaled first under fp16."""
        (self.grad_scaler.scale(loss) if self.grad_scaler is not None else loss).backward()

    def clip_gradients(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, max_norm: float) -> torch.Tensor:
        """Clip the gradients of `model` to a global L2 norm of `max_norm`; return the norm before clipping
        (the same value on every rank). `optimizer` is the one that will step on these gradients."""
        from .. import clip_grad_norm_

        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        return clip_grad_norm_(model, max_norm)

    def no_backward_sync(self, model: nn.Module, *, enabled: bool = True) -> contextlib.AbstractContextManager:
        """Within this block (when `enabled`), backward accumulates local gradients without communicating;
        use it on every micro-batch but the last of an accumulation window."""
        if not enabled:
            return contextlib.nullcontext()
        from .. import no_sync

        return no_sync(model)

    # -------------------------------------------------------------------------------- checkpoints

    def save(self, path: str, state: dict[str, Any], **kwargs: Any) -> None:
        """Save `state` (modules, optimizers, schedulers by reference; other values as metadata) with
        `st.save_checkpoint`; every rank's random generators are saved too. All ranks must call it."""
        from ..checkpoint import save_checkpoint

        save_checkpoint(path, state, **kwargs)

    def load(self, path: str, state: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        """Load into the objects of `state` in place with `st.load_checkpoint`; return the stored
        non-object values. All ranks must call it."""
        from ..checkpoint import load_checkpoint

        return load_checkpoint(path, state, **kwargs)


def _run_on_rank(engine: Engine, fn: Callable[..., Any], args: tuple) -> Any:
    """Entry point of a spawned rank: join the group, then run the user's function."""
    engine._join()
    try:
        return fn(engine, *args)
    except BaseException as exc:  # the launcher reports it; this rank must not wait for its peers at exit
        mark_failed(exc)
        raise
