"""A LightningModule with `configure_model`, trained by `L.Trainer` with strategy="ddp" and then with
ShardtrainStrategy (accumulate_grad_batches=2, gradient_clip_val=1.0), then resumed with `ckpt_path=`.
The shardtrain runs take the blocks as units and recompute them in backward, spelled as a script written for
Lightning's FSDPStrategy spells it: sets of classes, then torch's policy callables.

Run as a script (`python lightning_run.py OUT`): the Trainer's launcher re-runs it once per device
(2 CPU ranks, Gloo). Rank 0 writes OUT/result.json.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
from pathlib import Path

import lightning as L
import torch
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, lambda_auto_wrap_policy
from torch.utils.data import DataLoader, TensorDataset

import shardtrain as st
from shardtrain.core.collectives import observe
from shardtrain.integrations.lightning import ShardtrainStrategy
from shardtrain.ops.grad_norm import grad_norm
from tests.integrations.toy import Block, ReduceScatters, Toy, batch, initial_state, sharding_layout

EPOCHS, STEPS_PER_EPOCH, ACCUM, LR = 2, 3, 2, 1e-2
LOSS_SCALE = 4.0  # makes gradient_clip_val=1.0 clip


class Module(L.LightningModule):
    def __init__(self, *, load_initial: bool) -> None:
        super().__init__()
        self.model: Toy | None = None
        self.load_initial = load_initial
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.reduces: list[int] = []  # gradient reduce-scatters of each micro-batch (shardtrain's)
        self.counter = ReduceScatters()
        self.observing = contextlib.ExitStack()

    def configure_model(self) -> None:
        if self.model is None:
            self.model = Toy()

    def on_fit_start(self) -> None:
        """The same start for both strategies (a resumed run keeps the checkpoint's weights)."""
        self.observing.enter_context(observe(self.counter))
        if not self.load_initial:
            return
        state = {f"model.{k}": v for k, v in initial_state().items()}
        if hasattr(next(self.parameters()), "to_local"):
            st.load_full_state_dict(self, state)
        else:
            self.load_state_dict(state)

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        loss = torch.nn.functional.cross_entropy(self.model(tokens).flatten(0, 1), targets.flatten()) * LOSS_SCALE
        self.log("train_loss", loss)
        self.losses.append(float(self.all_gather(loss.detach()).mean()))
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.reduces.append(self.counter.take())

    def on_fit_end(self) -> None:
        self.observing.close()

    def validation_step(self, batch, batch_idx):
        tokens, targets = batch
        self.log(
            "val_loss",
            torch.nn.functional.cross_entropy(self.model(tokens).flatten(0, 1), targets.flatten()),
            sync_dist=True,
        )

    def on_before_optimizer_step(self, optimizer) -> None:
        """The norm before clipping, over all ranks."""
        if hasattr(next(self.parameters()), "to_local"):
            self.norms.append(float(grad_norm(self)))
        else:
            self.norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in self.parameters()])))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=LR)


def loader() -> DataLoader:
    """One epoch: rank r gets samples `batch(r, i)` (the sampler deals it every other one), 4 a micro-batch."""
    pairs = [batch(rank, i, size=1) for i in range(STEPS_PER_EPOCH * ACCUM * 4) for rank in range(2)]
    tokens, targets = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
    return DataLoader(TensorDataset(tokens, targets), batch_size=4)


def trainer(strategy, callbacks=()) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=EPOCHS,
        accumulate_grad_batches=ACCUM,
        gradient_clip_val=1.0,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    out = parser.parse_args().out

    ddp_module = Module(load_initial=True)
    ddp = trainer("ddp")
    ddp.fit(ddp_module, loader(), loader())
    ddp_val = ddp.validate(ddp_module, loader(), verbose=False)[0]["val_loss"]
    ddp_params = {k: v.detach().clone() for k, v in ddp_module.state_dict().items()}

    module = Module(load_initial=True)
    saving = L.pytorch.callbacks.ModelCheckpoint(dirpath=out / "ckpts", every_n_epochs=1, save_top_k=-1)
    strategy = ShardtrainStrategy(auto_wrap_policy={Block}, activation_checkpointing_policy={Block})
    sharded = trainer(strategy, callbacks=[saving])
    sharded.fit(module, loader(), loader())
    val = sharded.validate(module, loader(), verbose=False)[0]["val_loss"]
    final = st.full_state_dict(module)

    resumed_module = Module(load_initial=False)
    checkpoint = out / "ckpts" / f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"  # the end of the first epoch
    is_block = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, Block))
    resumed = trainer(
        ShardtrainStrategy(auto_wrap_policy=ModuleWrapPolicy({Block}), activation_checkpointing_policy=is_block)
    )
    resumed.fit(resumed_module, loader(), loader(), ckpt_path=checkpoint)

    if sharded.global_rank == 0:
        result = {
            "ddp_losses": ddp_module.losses,
            "losses": module.losses,
            "reduce_scatters": module.reduces,
            "ddp_norms": ddp_module.norms,
            "norms": module.norms,
            "ddp_val": float(ddp_val),
            "val": float(val),
            "max_param_diff": max((final[k] - ddp_params[k]).abs().max().item() for k in ddp_params),
            "param_names_match": sorted(final) == sorted(ddp_params),
            "resumed_losses": resumed_module.losses,
            "resumed_step": resumed.global_step,
            "layout": sharding_layout(module),
            "resumed_layout": sharding_layout(resumed_module),
        }
        (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
