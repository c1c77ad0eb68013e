"""The four moments of a training step whose peak the memory estimate bills, each itemised: forward +
loss, backward start, backward end and the optimizer step.

`step_states` computes what the moments share (the states, what the host and the disk tier take off
the device, the unsharded copies); each moment's function then bills its items. Each moment's items:
docs/design.md, Note [Memory moments].
"""

from __future__ import annotations

from dataclasses import dataclass

from ...policy import CPUOffload
from .activations import ActivationBill, activation_bill
from .inputs import EstimateInputs
from .model_spec import ModelSpec

MASTER_BYTES = 4  # fp32 master weights
GRAD_BYTES = 4  # fp32 sharded gradients
MOMENTS = ("forward + loss", "backward start", "backward end", "optimizer step")

Items = dict[str, int]  # the MemoryEstimate items a moment holds (parameters, gradients, ...), in bytes


def offloaded_units(model: ModelSpec, offload: CPUOffload | None) -> list[int]:
    """The parameters of each unit `offload` moves to the host (whole units, as CPUOffload.select picks them)."""
    if offload is None:
        return []
    sizes = (model.root_params, *model.unit_params)  # plan order, as CPUOffload.select walks it
    return [size for size, on in zip(sizes, offload.select(sizes)) if on]


def offloaded_share(model: ModelSpec, offload: CPUOffload | None) -> float:
    """The share of the parameters `offload` moves to the host (whole units, as CPUOffload.select picks them)."""
    return sum(offloaded_units(model, offload)) / max(1, model.root_params + sum(model.unit_params))


@dataclass(frozen=True, kw_only=True)
class StepStates:
    """What the step's moments share: the device's states, the host's and the disk's, and the sizes of
    the unsharded copies (0 where a copy is a view of the master, the frozen shards or the gradient)."""

    parameters: int  # master weights on the device, frozen ones as stored
    gradients: int  # sharded fp32 gradients on the device
    optimizer_state: int
    host: int  # what CPU offload keeps on the host
    disk: int  # the offloaded optimizer state in the disk tier's files
    copy: int  # bytes per trainable parameter of an unsharded copy
    frozen_copy: float  # ... per frozen parameter (a 4-bit base: its packed bytes per parameter)
    grad_copy: int  # bytes per parameter of an unsharded gradient
    lookups_gather: bool  # whether a sharded embedding unit is gathered (core.lookup.runs_sharded_lookup)

    def unsharded(self, params: int, trainable_params: int) -> int:
        """Bytes of the unsharded copies of `params` parameters, `trainable_params` of them trainable."""
        trains = min(params, trainable_params)
        return trains * self.copy + int((params - trains) * self.frozen_copy)


def step_states(inputs: EstimateInputs) -> StepStates:
    """The states each moment holds, after CPU offload and the disk tier take their shares."""
    m, p, n = inputs.model, inputs.param_bytes, inputs.shard_size
    resident = inputs.strategy.keeps_params_resident
    # Frozen parameters stay in the dtype they were built in (`policy.storage_dtypes`): no master.
    frozen_size = inputs.frozen_param_bytes
    params_alias = p == MASTER_BYTES and (n == 1 or resident)  # unsharded params are views of the master
    # ... or of the frozen shards (a 4-bit base computes from its packed shards, gathered as they are stored)
    frozen_alias = (frozen_size == p or m.quantized_base) and (n == 1 or resident)
    # Each parameter's rows are padded to a multiple of the shard group (core.param_layout).
    padding, trainable_padding = m.padding(n)
    trainable = m.trainable_params + trainable_padding
    frozen_stored = int((m.frozen_params + padding - trainable_padding) * frozen_size) // n
    sharded = trainable * MASTER_BYTES // n + frozen_stored
    master = (
        (m.trainable_params * MASTER_BYTES if params_alias else trainable * MASTER_BYTES // n)
        + (int(m.frozen_params * frozen_size) if frozen_alias else frozen_stored)
        if resident
        else sharded
    )
    grads = trainable * GRAD_BYTES // n
    optim = int(trainable * inputs.optimizer_bytes / n)
    host = disk = 0
    if inputs.offload:  # the host keeps shards, gradients and optimizer state; the step runs there
        share = offloaded_share(m, inputs.offload)
        moved = [int(share * b) for b in (sharded, grads, optim)]
        host = sum(moved)
        master, grads, optim = (b - off for b, off in zip((sharded, grads, optim), moved))
        params_alias = frozen_alias = False  # the offloaded shards live on the host: the device needs copies
        if inputs.offload.disk_dir is not None:  # the disk tier keeps the offloaded optimizer state in files
            disk = moved[2]  # (offload/disk_state.py)
            host -= disk
    return StepStates(
        parameters=master,
        gradients=grads,
        optimizer_state=optim,
        host=host,
        disk=disk,
        copy=0 if params_alias else p,
        frozen_copy=0 if frozen_alias else (frozen_size if m.quantized_base else p),
        grad_copy=0 if p == GRAD_BYTES and n == 1 else p,  # unsharded grads land in the fp32 gradient itself
        # Note: mirrors core.lookup.runs_sharded_lookup: an embedding unit sharded over several ranks,
        # neither resident nor offloaded, is never gathered and has no unsharded gradient.
        lookups_gather=n == 1 or resident or bool(inputs.offload),
    )


def _resident_params(inputs: EstimateInputs, states: StepStates) -> int:
    """Unsharded copies kept for good (no_shard, optimizer_only): every unit."""
    m = inputs.model
    return states.unsharded(m.num_params, m.trainable_params) if inputs.strategy.keeps_params_resident else 0


def _gathered(inputs: EstimateInputs, states: StepStates) -> tuple[int, int]:
    """Unsharded parameters at the loss and at the start of backward."""
    m = inputs.model
    if not inputs.strategy.reshard_after_forward:  # gathered in forward, kept until each unit's backward ends
        whole = states.unsharded(m.num_params, m.trainable_params)
        kept = whole - (0 if states.lookups_gather else sum(m.lookup_params) * states.copy)  # copy == frozen_copy
        return kept, kept
    # only the outermost unit and the units in flight are gathered
    in_flight = m.largest_units(inputs.in_flight, lookups_gather=states.lookups_gather)
    # CPUOffload(reshard_after_forward=False): the offloaded units stay gathered from forward to backward
    offload = inputs.offload
    keeps = offload is not None and not offload.reshards_after_forward(strategy_reshards=True)
    kept = sum(offloaded_units(m, offload)) if keeps else 0
    at_loss = states.unsharded(kept, kept)
    gathered = (
        at_loss
        + states.unsharded(m.enclosing_params, m.trainable_of("enclosing"))
        + states.unsharded(in_flight, inputs.in_flight * m.trainable_of("unit"))
    )
    return at_loss, gathered


def _largest_trainable_unit(inputs: EstimateInputs, states: StepStates) -> int:
    """Gradients are of the trainable parameters only: the unit with the most of them."""
    m = inputs.model
    return min(m.largest_units(1, lookups_gather=states.lookups_gather), m.trainable_of("unit"))


def _reduce_copy(inputs: EstimateInputs, numel: int) -> int:
    """A reduce buffer of `numel` gradients: a cast copy only when the reduce dtype differs."""
    return numel * inputs.reduce_bytes if inputs.reduce_bytes != inputs.param_bytes else 0


def _activations(inputs: EstimateInputs) -> ActivationBill:
    shape = inputs.model.shape
    if shape is None:
        return ActivationBill(saved=0, backward_extra=0, loss_peak=0)
    return activation_bill(
        shape,
        micro_batch=inputs.micro_batch,
        seq_len=inputs.seq_len,
        compute_bytes=inputs.param_bytes,
        recompute_every=inputs.recompute_every,
        trained=inputs.model.trained,
        sequence_split=inputs.tp if inputs.sequence_parallel else 1,
        vocab_split=inputs.tp if inputs.loss_parallel else 1,
        chunked_loss=inputs.chunked_loss,
    )


def _states(states: StepStates, *, gradients: int) -> Items:
    return dict(parameters=states.parameters, optimizer_state=states.optimizer_state, gradients=gradients)


def _between_steps_grads(inputs: EstimateInputs, states: StepStates) -> int:
    return states.gradients if inputs.keep_grads else 0


def forward_and_loss(inputs: EstimateInputs, states: StepStates, acts: ActivationBill) -> Items:
    at_loss, _ = _gathered(inputs, states)
    return dict(
        _states(states, gradients=_between_steps_grads(inputs, states)),
        unsharded_params=at_loss,
        unsharded_grads=0,
        reduce_buffers=0,
        activations=acts.saved,
        logits=acts.loss_peak,
    )


def backward_start(inputs: EstimateInputs, states: StepStates, acts: ActivationBill) -> Items:
    _, gathered = _gathered(inputs, states)
    big = _largest_trainable_unit(inputs, states)
    return dict(
        _states(states, gradients=_between_steps_grads(inputs, states)),
        unsharded_params=gathered,
        unsharded_grads=(inputs.model.trainable_of("enclosing") + big) * states.grad_copy,
        reduce_buffers=_reduce_copy(inputs, big),
        activations=acts.saved + acts.backward_extra,
        logits=0,
    )


def backward_end(inputs: EstimateInputs, states: StepStates) -> Items:
    root_trainable = inputs.model.trainable_of("root")
    big = _largest_trainable_unit(inputs, states)
    reducing = dict(
        unsharded_params=_resident_params(inputs, states),
        reduce_buffers=_reduce_copy(inputs, root_trainable) + _reduce_copy(inputs, big),
        activations=0,
        logits=0,
    )
    grads = states.gradients
    root_shard = min(grads, root_trainable * GRAD_BYTES // inputs.shard_size)
    in_place = root_trainable * states.grad_copy if inputs.reduce_bytes == inputs.param_bytes else 0
    return max(
        (  # the outermost unit's gradients are copied into its reduce buffer...
            dict(
                _states(states, gradients=grads - root_shard),
                unsharded_grads=root_trainable * states.grad_copy,
                **reducing,
            ),
            # ...then freed, while the reduce-scatter writes its shard of the gradients
            dict(_states(states, gradients=grads), unsharded_grads=in_place, **reducing),
        ),
        key=lambda items: sum(items.values()),
    )


def optimizer_step(inputs: EstimateInputs, states: StepStates) -> Items:
    return dict(
        _states(states, gradients=states.gradients),
        unsharded_params=_resident_params(inputs, states),
        unsharded_grads=0,
        reduce_buffers=0,
        activations=0,
        logits=0,
    )


def moments(inputs: EstimateInputs, states: StepStates) -> dict[str, Items]:
    """Each moment's items, in the step's order (`MOMENTS`)."""
    acts = _activations(inputs)
    bills = (
        forward_and_loss(inputs, states, acts),
        backward_start(inputs, states, acts),
        backward_end(inputs, states),
        optimizer_step(inputs, states),
    )
    return dict(zip(MOMENTS, bills))
