"""Rank-side code of the tensor-parallel tests: st.shard on a ("dp", "tp") mesh against one process.

The reference is the unsharded model in this process: each step it sums every dp rank's gradient
and divides by dp (tp ranks of one dp rank see the same batch), clips with torch's clip_grad_norm_ and
steps AdamW. The engine must give, at fp32 tolerance, the same loss on every rank, the same norm,
and the same parameters and gradients (`full_tensor()` of the optimizer's DTensors).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

import shardtrain as st
from shardtrain.models.llama import Block, Llama, llama_config

TOL = dict(rtol=2e-5, atol=2e-5)
# Note: eps 1e-5, not 1e-8: tensor parallelism sums each matmul in another order, and Adam's first
# steps turn a gradient of 2e-10 (there are such) into a step of lr * g / (|g| + eps); with eps 1e-8
# its last bits moved a weight by 1e-4. Below eps the step is proportional to the gradient.
ADAMW = dict(lr=1e-3, weight_decay=0.1, eps=1e-5)
MAX_NORM = 0.5
# bf16 compute against the fp32 reference: a few bf16 roundings per value, and AdamW moving a weight
# whose tiny gradient changed sign by up to 2 lr a step (4 steps: 8e-3)
LOW_TOL = dict(rtol=3e-2, atol=1e-2)  # below the first steps' norm: the clipping fires


@dataclass(frozen=True, kw_only=True)
class Case:
    mesh: tuple[int, ...]  # (dp, tp), or (replicate, shard, tp): hybrid sharding
    model: str = "llama"  # "llama" (built-in) | "hf" (transformers LlamaForCausalLM)
    sequence_parallel: bool = False
    loss_parallel: bool = False
    steps: int = 10
    prebuilt: bool = False  # the model goes through parallelize_module before st.shard (tp_plan=None)
    precision: str | None = None  # "bf16": compared at bf16's tolerance (LOW_TOL)
    checkpointed: bool = False  # activation checkpointing of every block

    @property
    def ffn_dim(self) -> int:
        """90 (uneven over 4 ranks) where tp <= 2; 92 at tp 4, because torch's RowwiseParallel assumes
        even splits of its input (`from_local` without a shape: 4 x 21 columns where rank 3 holds 21)."""
        return 92 if self.mesh[-1] > 2 else 90

    @property
    def dp(self) -> int:
        return math.prod(self.mesh[:-1])


def uneven_llama(ffn_dim: int) -> Llama:
    """Hidden 48, vocabulary 1000, feed-forward `ffn_dim` (90: not a multiple of 4): the dp cuts are uneven."""
    cfg = llama_config(
        "tiny", vocab_size=1000, dim=48, n_layers=2, n_heads=8, n_kv_heads=4, ffn_dim=ffn_dim, max_seq_len=32
    )
    return Llama(cfg)


def hf_llama(ffn_dim: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=48,
        intermediate_size=ffn_dim,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg).float()


def _loss(model, tokens: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "hf":
        logits = model(input_ids=tokens[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
    return model.loss(tokens[:, :-1], tokens[:, 1:])


def _batch(step: int, dp_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randint(0, 1000, (2, 17), generator=g)


def build(case: Case):
    """(model, reference, mesh): the sharded model and its unsharded twin with the same weights."""
    torch.manual_seed(0)
    model = hf_llama(case.ffn_dim) if case.model == "hf" else uneven_llama(case.ffn_dim)
    reference = copy.deepcopy(model)
    hybrid = len(case.mesh) == 3
    mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=st.tp.HYBRID_NAMES if hybrid else st.tp.FLAT_NAMES)
    if case.model == "hf":
        plan, units = st.tp.hf_plan(model), {type(model.model.layers[0])}
    else:
        plan = st.tp.llama_plan(sequence_parallel=case.sequence_parallel, loss_parallel=case.loss_parallel)
        units = {Block}
    if case.prebuilt:
        parallelize_module(model, mesh["tp"], plan)
        plan = None
    st.shard(
        model,
        mesh=mesh,
        tp_plan=plan,
        wrap=units,
        strategy="hybrid_shard" if hybrid else "full_shard",
        mixed_precision=case.precision,
        activation_checkpointing=units if case.checkpointed else None,
    )
    return model, reference, mesh


def expected_placements(name: str, tp: int, hybrid: bool) -> tuple:
    """FSDP2's placements of the uneven Llama's parameters on ("dp", "tp") (the table in tp/placements.py),
    after Replicate() on "replicate" under hybrid sharding."""
    return ((Replicate(),) if hybrid else ()) + _placements(name, tp)


def _placements(name: str, tp: int) -> tuple:
    colwise = ("wq", "wk", "wv", "w1", "w3", "head", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
    split_rows = any(f"{c}." in name for c in colwise) or name.startswith("embed.") or "embed_tokens." in name
    if tp > 1 and split_rows:
        return (_StridedShard(0, split_factor=tp), Shard(0))
    if tp > 1 and any(f"{r}." in name for r in ("wo", "w2", "o_proj", "down_proj")):
        return (Shard(0), Shard(1))
    return (Shard(0), Replicate())


def run_parity(case: Case) -> int:
    model, reference, mesh = build(case)
    dp, tp, hybrid = case.dp, case.mesh[-1], len(case.mesh) == 3
    coordinates = mesh.get_coordinate()[:-1]  # this rank's data-parallel index, row-major over the dp dims
    dp_rank = coordinates[0] * case.mesh[1] + coordinates[1] if hybrid else coordinates[0]
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.device_mesh == mesh, name
        assert p.placements == expected_placements(name, tp, hybrid), (name, p.placements)
        assert p.shape == dict(reference.named_parameters())[name].shape, name
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    ref_opt = torch.optim.AdamW(reference.parameters(), **ADAMW)
    fired = 0
    for step in range(case.steps):
        batches = [_batch(step, r) for r in range(dp)]
        with loss_parallel() if case.loss_parallel else contextlib.nullcontext():
            loss = _loss(model, batches[dp_rank], case.model)
            loss.backward()
        if isinstance(loss, DTensor):
            loss = loss.full_tensor()
        norm = st.clip_grad_norm_(model, MAX_NORM)
        ref_losses = [_loss(reference, b, case.model) for b in batches]
        for ref_loss in ref_losses:  # each rank's gradient, summed, then averaged: what data parallelism computes
            ref_loss.backward()
        for p in reference.parameters():
            p.grad /= dp
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        fired += bool(ref_norm > MAX_NORM)
        tol = LOW_TOL if case.precision else TOL
        torch.testing.assert_close(loss.detach(), ref_losses[dp_rank].detach(), **tol, msg=f"loss at step {step}")
        torch.testing.assert_close(norm, ref_norm, **tol, msg=f"norm at step {step}")
        if step in (0, 1, case.steps - 1) and not case.precision:  # every tensor at the first steps and the last
            compare(model, reference, step)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ref[name].detach(), **tol, msg=f"{name} after the last step")
    assert fired >= 2, f"the clipping fired at {fired} steps only"
    return 1


def compare(model, reference, step: int) -> None:
    """Every parameter and gradient, whole (`full_tensor()`), against the reference's."""
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ref[name].detach(), **TOL, msg=f"{name} at step {step}")
        if ref[name].grad is not None:
            assert p.grad is not None, f"{name} has no gradient at step {step}"
            torch.testing.assert_close(p.grad.full_tensor(), ref[name].grad, **TOL, msg=f"grad {name} at step {step}")


def forward_collectives(case: Case) -> dict[str, int]:
    """The collectives one forward issues: the dp all-gathers (c10d, one per unit) and the tp ones
    (functional collectives of DTensor's redistributions), by name."""
    os.environ["SHARDTRAIN_CHECK_ORDER"] = "0"  # the order check's own all-gathers are not the model's
    try:
        model, _, _ = build(case)
    finally:
        del os.environ["SHARDTRAIN_CHECK_ORDER"]
    tokens = _batch(0, 0)[:, :-1]
    with CommDebugMode() as comm, torch.no_grad():
        model(tokens)
    return {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}


def refusals() -> list[str]:
    """The messages of what st.shard refuses with tensor parallelism (each must name the fix)."""
    dp_tp = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("dp", "tp"))
    odd = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("data", "tp"))
    attempts = [
        lambda: st.shard(uneven_llama(90), tp_plan=st.tp.llama_plan()),
        lambda: st.shard(uneven_llama(90), mesh=odd, tp_plan=st.tp.llama_plan()),
        lambda: st.shard(uneven_llama(90), mesh=dp_tp, tp_plan=st.tp.llama_plan(), strategy="no_shard"),
        lambda: st.shard(Llama(llama_config("tiny", tie_embeddings=True)), mesh=dp_tp, tp_plan=st.tp.llama_plan()),
        lambda: st.shard(uneven_llama(90), mesh=dp_tp, tp_plan={"blocks.*.wq": "colwise"}),
        lambda: _compiled_block_forward(dp_tp),
        lambda: _lora_model_split(dp_tp),
        lambda: _compiled_block_put_back(dp_tp),
    ]
    messages = []
    for attempt in attempts:
        try:
            attempt()
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def _compiled_block_forward(mesh) -> None:
    model = uneven_llama(90)
    st.shard(model, mesh=mesh, tp_plan=st.tp.llama_plan(), wrap={Block})
    next(m for m in model.modules() if isinstance(m, Block)).compile(backend="eager")
    tokens = _batch(0, 0)
    model.loss(tokens[:, :-1], tokens[:, 1:])


def _compiled_block_put_back(mesh) -> None:
    model = uneven_llama(90)
    st.shard(model, mesh=mesh, tp_plan=st.tp.llama_plan(), wrap={Block})
    model.layers[1] = torch.compile(model.layers[1], backend="eager")
    tokens = _batch(0, 0)
    model.loss(tokens[:, :-1], tokens[:, 1:])


def _lora_model_split(mesh) -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(hf_llama(96), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    st.shard(model, mesh=mesh, tp_plan=st.tp.plan_for(model))


def agrees_with_fsdp2(mesh_shape: tuple[int, int]) -> int:
    """torch FSDP2 + parallelize_module as the control: the same model, split by the same plan, gets
    the same placements on the same mesh, and the same global tensors."""
    case = Case(mesh=mesh_shape, sequence_parallel=True)
    ours, reference, mesh = build(case)
    torch.manual_seed(0)
    control = uneven_llama(case.ffn_dim)
    parallelize_module(control, mesh["tp"], st.tp.llama_plan(sequence_parallel=True))
    for block in control.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(control, mesh=mesh["dp"])
    theirs = dict(control.named_parameters())
    for name, p in ours.named_parameters():
        assert p.placements == theirs[name].placements, (name, p.placements, theirs[name].placements)
        assert p.device_mesh.mesh.tolist() == theirs[name].device_mesh.mesh.tolist(), name
        torch.testing.assert_close(p.full_tensor(), theirs[name].full_tensor(), rtol=0, atol=0, msg=name)
    return 1


def exports_hf(directory: str) -> int:
    """st.save_pretrained of a tensor-parallel transformers model writes the global tensors:
    `from_pretrained` gives back the unsharded model's weights; st.load_pretrained of that folder into
    a fresh tensor-parallel model (other weights) gives each rank its block of each tensor: every
    `full_tensor()` is the original."""
    from transformers import LlamaForCausalLM

    case = Case(mesh=(1, dist.get_world_size()), model="hf")
    model, reference, mesh = build(case)
    st.save_pretrained(model, directory)
    if dist.get_rank() == 0:
        loaded = LlamaForCausalLM.from_pretrained(directory).float()
        expected = reference.state_dict()
        for name, tensor in loaded.state_dict().items():
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
    dist.barrier()
    torch.manual_seed(1)
    fresh = hf_llama(case.ffn_dim)  # other weights than the saved ones
    st.shard(fresh, mesh=mesh, tp_plan=st.tp.hf_plan(fresh), wrap={type(fresh.model.layers[0])})
    report = st.load_pretrained(fresh, directory)
    assert not report.missing and not report.unexpected, report
    expected = dict(reference.named_parameters())
    for name, param in fresh.named_parameters():
        torch.testing.assert_close(param.full_tensor(), expected[name], rtol=0, atol=0, msg=name)
    return 1


def fused_counts(directory: str) -> int:
    """Fused AdamW's step counts become DTensors replicated on the whole mesh after a step
    (core/replicated_steps.py), also after a checkpoint's load; a step with them builds no DTensorSpec
    once DTensor's sharding cache knows them, and updates the parameters bit for bit as a twin whose
    counts stay plain (each of its steps builds a spec per parameter)."""
    case = Case(mesh=(1, dist.get_world_size()))
    model, twin = build(case)[0], build(case)[0]
    opt, twin_opt = (torch.optim.AdamW(m.parameters(), **ADAMW, fused=True) for m in (model, twin))
    built: dict[str, list[int]] = {"wrapped": [], "plain": []}
    for step in range(4):
        if step == 2:
            st.save_checkpoint(directory, {"model": model, "optimizer": opt}, format="sharded")
            st.load_checkpoint(directory, {"model": model, "optimizer": opt})
        for kind, m, o in (("wrapped", model, opt), ("plain", twin, twin_opt)):
            _loss(m, _batch(step, 0), case.model).backward()
            if kind == "plain":
                twin_opt.load_state_dict(_plain_counts(twin_opt.state_dict()))
            with _counting_specs() as specs:
                o.step()
            o.zero_grad(set_to_none=True)
            built[kind].append(len(specs))
    params = list(model.parameters())
    assert built["wrapped"][3] == 0 and min(built["plain"][1:]) >= len(params), built
    for p, q in zip(params, twin.parameters()):
        count = opt.state[p]["step"]
        assert isinstance(count, DTensor) and count.placements == (Replicate(), Replicate()), count
        assert count.device_mesh == p.device_mesh and count.to_local().item() == 4.0
        torch.testing.assert_close(p.to_local(), q.to_local(), rtol=0, atol=0)
    return 1


def _plain_counts(state_dict: dict) -> dict:
    for entries in state_dict["state"].values():
        if isinstance(entries["step"], DTensor):
            entries["step"] = entries["step"].to_local().clone()
    return state_dict


@contextlib.contextmanager
def _counting_specs():
    """The DTensorSpecs built inside the block (DTensor's dispatch builds one per plain tensor it meets)."""
    built: list[int] = []
    original = DTensorSpec.__post_init__

    def counting(self) -> None:
        built.append(1)
        original(self)

    DTensorSpec.__post_init__ = counting
    try:
        yield built
    finally:
        DTensorSpec.__post_init__ = original
