"""The Fabric FSDP guide's loop, run with Fabric's DDP strategy and then with ShardtrainStrategy.

Run as a script (`python fabric_run.py OUT_DIR [--more]`): Fabric's launcher re-runs it once per
device (2 CPU ranks, Gloo). Rank 0 writes OUT_DIR/result.json with the losses, gradient norms and
parameter differences the test asserts on. The parity run picks its units and the blocks it recomputes with
torch FSDP's policies, as a script written for Lightning's FSDPStrategy passes them. `--resume CKPT`: steps 4-6 from the parity run's checkpoint,
in fresh processes; `--more` (alone or after `--resume`): the half precisions and full checkpoints.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import lightning as L
import torch
from safetensors.torch import load_file
from torch.distributed.fsdp.wrap import CustomPolicy, size_based_auto_wrap_policy

import shardtrain as st
from shardtrain.core.collectives import observe
from shardtrain.integrations.fabric import ShardtrainMixedPrecision, ShardtrainStrategy
from tests.integrations.toy import Block, ReduceScatters, Toy, batch, initial_state, param_bytes, sharding_layout

STEPS, ACCUM, MAX_NORM, LR = 6, 2, 0.05, 1e-2


def train_steps(fabric, model, opt, steps: range, reduces: list[int] | None = None) -> tuple[list[float], list[float]]:
    """Steps of ACCUM micro-batches: no gradient sync but on the last, clip, step. Loss: mean over ranks.
    `reduces` gets the number of gradient reduce-scatters of each micro-batch."""
    losses, norms = [], []
    counter = ReduceScatters()
    for step in steps:
        total = 0.0
        for micro in range(ACCUM):
            tokens, targets = batch(fabric.global_rank, step * ACCUM + micro)
            with observe(counter), fabric.no_backward_sync(model, enabled=micro < ACCUM - 1):
                loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())
                fabric.backward(loss / ACCUM)
            total += loss.item() / ACCUM
            if reduces is not None:
                reduces.append(counter.take())
        norms.append(float(fabric.clip_gradients(model, opt, max_norm=MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(float(fabric.all_reduce(torch.tensor(total), reduce_op="mean")))
    return losses, norms


def ddp_reference() -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp", precision="32-true")
    fabric.launch()
    model = Toy()
    model.load_state_dict(initial_state())
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=LR))
    losses, norms = train_steps(fabric, model, opt, range(STEPS))
    return losses, norms, {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def sharded_model(fabric):
    """The guide's set-up: built on meta (no rank holds it whole), sharded, optimizer after."""
    with fabric.init_module(empty_init=True):
        model = Toy()
    on_meta = all(p.is_meta for p in model.parameters())
    model = fabric.setup_module(model)
    st.load_full_state_dict(model.module, initial_state())
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    return model, opt, on_meta


def more(out: Path) -> dict:
    """bf16-mixed and bf16-true train (masters fp32, resp. bf16); a "full" checkpoint opens with
    safetensors and loads back into a fresh sharded model."""
    result = {}
    for precision in ("bf16-mixed", "bf16-true"):
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ShardtrainStrategy(wrap={Block}), precision=precision)
        fabric.launch()
        model, opt, _ = sharded_model(fabric)
        losses, _ = train_steps(fabric, model, opt, range(3))
        result[precision] = {"losses": losses, "dtypes": sorted({str(p.dtype) for p in model.parameters()})}
    # "16-mixed": Fabric turns it into bf16 on the CPU, so the plugin is given as such (fp16 runs there).
    fp16 = ShardtrainMixedPrecision("16-mixed", "cpu")
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ShardtrainStrategy(wrap={Block}), plugins=[fp16])
    fabric.launch()
    model, opt, _ = sharded_model(fabric)
    losses, _ = train_steps(fabric, model, opt, range(3))
    scales = fabric.all_gather(fp16.scaler.get_scale() * torch.ones(1))
    result["16-mixed"] = {"losses": losses, "scales": scales.flatten().tolist()}
    strategy = ShardtrainStrategy(wrap={Block}, state_dict_type="full")
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="32-true")
    fabric.launch()
    model, opt, _ = sharded_model(fabric)
    train_steps(fabric, model, opt, range(2))
    fabric.save(out / "full", {"model": model, "optimizer": opt})
    saved = st.full_state_dict(model.module)
    fresh, fresh_opt, _ = sharded_model(fabric)
    fabric.load(out / "full", {"model": fresh, "optimizer": fresh_opt})
    loaded = st.full_state_dict(fresh.module)
    if fabric.global_rank == 0:
        plain = Toy()
        plain.load_state_dict(load_file(out / "full" / "model.safetensors"))
        result["full_file_diff"] = max((v - saved[k]).abs().max().item() for k, v in plain.state_dict().items())
        result["full_reload_diff"] = max((v - saved[k]).abs().max().item() for k, v in loaded.items())
    return result


def resume(checkpoint: Path) -> dict:
    """A fresh run (new processes) loads the parity run's step-3 checkpoint and trains steps 4-6."""
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ShardtrainStrategy(wrap={Block}), precision="32-true")
    fabric.launch()
    model, opt, _ = sharded_model(fabric)
    state = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(checkpoint, state)
    losses, _ = train_steps(fabric, model, opt, range(state["step"], STEPS))
    return {"resumed_step": state["step"], "resumed_losses": losses} if fabric.global_rank == 0 else {}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--more", action="store_true")
    parser.add_argument("--resume", type=Path, help="a checkpoint to continue from in a fresh run")
    args = parser.parse_args()
    if args.more or args.resume:
        # One launch does both (fresh processes cost seconds): the resume first, in processes that have
        # run nothing else; rank 0 writes the file (more's full-checkpoint differences are its own).
        result = resume(args.resume) if args.resume else {}
        result.update(more(args.out) if args.more else {})
        if torch.distributed.get_rank() == 0:
            (args.out / "result.json").write_text(json.dumps(result))
        return
    ddp_losses, ddp_norms, ddp_params = ddp_reference()

    strategy = ShardtrainStrategy(
        auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=3000),  # a block: 4192
        activation_checkpointing_policy=CustomPolicy(lambda module: isinstance(module, Block)),
    )
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision="32-true")
    fabric.launch()
    model, opt, on_meta = sharded_model(fabric)
    held = param_bytes(model)
    full = sum(v.numel() * v.element_size() for v in initial_state().values())
    reduces: list[int] = []
    losses, norms = train_steps(fabric, model, opt, range(3), reduces)
    fabric.save(args.out / "ckpt", {"model": model, "optimizer": opt, "step": 3})
    more_losses, more_norms = train_steps(fabric, model, opt, range(3, STEPS))
    final = st.full_state_dict(model.module)

    fresh, fresh_opt, _ = sharded_model(fabric)
    state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
    fabric.load(args.out / "ckpt", state)
    resumed_losses, _ = train_steps(fabric, fresh, fresh_opt, range(state["step"], STEPS))

    everyone = {
        "on_meta": on_meta,
        "held_bytes": held,
        "full_bytes": full,
        "broadcast": fabric.broadcast(fabric.global_rank + 7),
    }
    gathered = fabric.all_gather(torch.tensor([held, int(on_meta)]))
    fabric.barrier()
    if fabric.global_rank == 0:
        result = {
            **everyone,
            "held_bytes_per_rank": gathered[:, 0].tolist(),
            "on_meta_per_rank": gathered[:, 1].tolist(),
            "ddp_losses": ddp_losses,
            "ddp_norms": ddp_norms,
            "losses": losses + more_losses,
            "norms": norms + more_norms,
            "reduce_scatters": reduces,
            "resumed_step": state["step"],
            "resumed_losses": resumed_losses,
            "max_param_diff": max((final[k] - ddp_params[k]).abs().max().item() for k in ddp_params),
            "param_names_match": sorted(final) == sorted(ddp_params),
            "layout": sharding_layout(model.module),
        }
        (args.out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    # Leave together: a rank that exits while its peer still tears the Gloo group down can abort it
    # ("terminate called without an active exception", seen once in the slow tier).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
