"""The main job's training loop, run on every rank of a launched `Engine`.

Order matters for failures: everything a user can get wrong (data path, model name, batch size,
sequence length) is checked on every rank before the first collective, so each rank reports the
mistake itself and exits, and no rank waits in a collective for a peer that already gave up.

One optimizer step = `grad_accum` micro-batches (all but the last without gradient sync), one
gradient clip, one `optimizer.step()` and exactly one `scheduler.step()`. A non-finite loss or
gradient norm stops the run before any checkpoint of it, or skips that `optimizer.step()` on every
rank (`train.on_nonfinite`, see finite.py); a skipped step still steps the schedule, so the learning
rate stays a function of the step number.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import torch

from ..engine import Engine
from ..engine.health import heartbeat
from ..planning.cost.checkpointing import recompute_policy
from ..tp import plan_for
from .chunked_choice import check_chunked_loss_config, use_chunked_loss
from .config import save_config
from .data import ByteTokenizer
from .dpo_setup import build_pair_data, check_dpo_config, dpo_fields, is_dpo
from .dpo_step import DpoJob, preference_line
from .early_stop import EarlyStop
from .ema import WeightEMA
from .epochs import with_epoch_steps
from .finetune import build_dtype, check_finetune_config, describe_lora, export, load_base, with_lora
from .finite import NonFiniteGuard
from .hub_inputs import fetch_hub_inputs
from .inputs import DataPlan, build_data, plan_data
from .loggers import Logger
from .metrics import MetricsLog, Summary, format_bytes, memory_bytes, plot_metrics
from .model_builder import BuiltModel, build_model
from .optimizers import build_optimizer
from .packed import check_packing_static, check_packing_supported, use_block_sparse_attention
from .resume import resolve_resume
from .retention import Retention, load_best
from .run_log import open_run_log
from .schedule import build_scheduler
from .sections import Config
from .startup import StartupClock
from .step import Job


def check_batch(cfg: Config, world_size: int) -> int:
    """The global micro-batch (sequences per micro-step over all data-parallel ranks: `world_size` of
    them, the world / engine.tp); ValueError with the fix."""
    batch, accum = cfg.train.batch_size, cfg.train.grad_accum
    unit = world_size * accum
    if batch < unit or batch % unit:
        fix = max(unit, (batch // unit) * unit)
        ranks = "data-parallel ranks" if cfg.engine.tp > 1 else "world size"
        raise ValueError(
            f"train.batch_size={batch} must be a multiple of {ranks} {world_size} x train.grad_accum "
            f"{accum} = {unit}; use --train.batch_size {fix}"
        )
    return batch // accum


def _prepare(cfg: Config, engine: Engine, *, clock: StartupClock) -> tuple[BuiltModel, int, DataPlan]:
    """Every check a user can fail, on every rank, before any communication."""
    micro_batch = check_batch(cfg, engine.data_parallel_size)
    check_finetune_config(cfg)
    check_chunked_loss_config(cfg)
    check_dpo_config(cfg)
    if cfg.run.best_metric == "eval_loss_ema" and not cfg.train.ema_decay:
        raise ValueError("run.best_metric=eval_loss_ema needs the EMA weights: pass --train.ema_decay D (e.g. 0.999)")
    out_dir = Path(cfg.run.out_dir)
    blocker = next((p for p in (out_dir, *out_dir.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ValueError(
            f"run.out_dir={cfg.run.out_dir!r}: {str(blocker)!r} is an existing file, not a directory; "
            "pass a directory for the runs (it is created if missing), e.g. --run.out_dir runs"
        )
    if cfg.run.resume and not Path(cfg.run.resume).exists():
        raise ValueError(
            f"run.resume={cfg.run.resume!r} does not exist; pass a checkpoint directory "
            "(runs/<name>/checkpoints/step_NNNNNN, or runs/<name>/checkpoints for the latest)"
        )
    engine.seed_everything(cfg.train.seed)
    built = build_model(cfg.model, init_context=engine.init_module, dtype=build_dtype(cfg, engine.mixed_precision))
    clock.mark("model")
    if built.notice and engine.rank == 0:
        print(f"note: {built.notice}", flush=True)
    if built.max_seq_len is not None and cfg.data.seq_len > built.max_seq_len:
        raise ValueError(
            f"data.seq_len={cfg.data.seq_len} exceeds the model's maximum sequence length "
            f"{built.max_seq_len}; lower --data.seq_len or raise --model.kwargs.max_seq_len"
        )
    plan = plan_data(cfg, built.module, progress=cfg.run.progress and engine.local_rank == 0)
    clock.mark("data")
    if plan.notice and engine.rank == 0:
        print(f"note: {plan.notice}", flush=True)
    if plan.tokenizer is not None and cfg.data.packing and not is_dpo(cfg):
        if "attn_implementation" not in cfg.model.kwargs:
            notice = use_block_sparse_attention(built.module, device=engine.device)
            if notice and engine.rank == 0:
                print(f"note: {notice}", flush=True)
        check_packing_static(built.module)  # the probe, a forward, waits for the sharded model (build_job)
    return built, micro_batch, plan


def _run_dir(cfg: Config, engine: Engine) -> Path:
    name = cfg.run.name or engine.broadcast(datetime.now().strftime("%Y%m%d-%H%M%S"))
    run_dir = Path(cfg.run.out_dir) / name
    if engine.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    return run_dir


def build_job(cfg: Config, engine: Engine, *, clock: StartupClock | None = None) -> tuple[Job, str]:
    """Check the configuration, tokenize the data (once per node), build and shard the model, make the
    optimizer, scheduler and EMA. Returns the job and a description of the model; `clock` times the phases."""
    clock = clock or StartupClock()
    built, micro_batch, plan = _prepare(cfg, engine, clock=clock)
    if is_dpo(cfg):
        data, pairs = build_pair_data(cfg, engine, plan, micro_batch=micro_batch)
    else:
        data, pairs = build_data(cfg, engine, plan, micro_batch=micro_batch), None
    if data.held_out is None and engine.rank == 0:
        print(
            "note: data.val_fraction is 0 and there is no data.eval_path: training on all the data, no evaluation "
            "(hold rows out with --data.val_fraction F or --data.eval_path FILE for a held-out loss)",
            flush=True,
        )
    cfg, steps_line = with_epoch_steps(cfg, data.train.num_windows)
    if steps_line and engine.rank == 0:
        print(steps_line, flush=True)
    if cfg.data.show and engine.rank == 0 and data.tokenizer is not None:
        print(data.show(cfg.data.show), flush=True)
    clock.mark("data")
    model, adapter_init = with_lora(cfg, built.module)
    optimizer = build_optimizer(cfg.optim, model, device=engine.device)
    split = cfg.engine.tp > 1
    model, optimizer = engine.setup(
        model,
        optimizer,
        wrap=built.wrap,
        activation_checkpointing=recompute_policy(model, wrap=built.wrap, every=cfg.model.activation_checkpointing),
        **({"param_init_fn": adapter_init} if adapter_init else {}),
        **({"tp_plan": plan_for(model, **_parallel_styles(cfg))} if split else {}),
    )
    clock.mark("shard")
    loaded = load_base(cfg, model)
    clock.mark("weights")
    if loaded and engine.rank == 0:
        print(loaded, flush=True)
    if data.packed:  # every rank probes the model it will train, together (the forward gathers)
        check_packing_supported(model, device=engine.device)
    chunked, notice = use_chunked_loss(
        cfg, model, engine, micro_batch=micro_batch // engine.data_parallel_size, packed=data.packed
    )
    if notice and engine.rank == 0:
        print(f"note: {notice}", flush=True)
    clock.mark("probes")
    scheduler = build_scheduler(optimizer, optim=cfg.optim, total_steps=cfg.train.steps)
    guard = NonFiniteGuard(
        engine, mode=cfg.train.on_nonfinite, check_norm=cfg.optim.grad_clip > 0 and engine.grad_scaler is None
    )
    job_fields = dpo_fields(cfg, engine, model=model, data=data, prepared=pairs) if pairs is not None else {}
    job = (DpoJob if pairs is not None else Job)(
        cfg=cfg,
        engine=engine,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        guard=guard,
        ema=WeightEMA(model, decay=cfg.train.ema_decay) if cfg.train.ema_decay > 0 else None,
        stopper=EarlyStop(
            patience=cfg.train.early_stop_patience, min_delta=cfg.train.early_stop_min_delta, metric=cfg.run.best_metric
        )
        if cfg.train.early_stop_patience
        else None,
        data=data,
        vocab_size=ByteTokenizer.vocab_size if data.tokenizer is None else len(data.tokenizer),
        chunked_loss=chunked,
        **job_fields,
    )
    return job, describe_lora(cfg, model, built.description)


def run(cfg: Config, engine: Engine, *, loggers: Sequence[Logger] = ()) -> Summary:
    """Train as configured on this rank; rank 0 writes the run directory and feeds the trackers
    (run.loggers, and `loggers`: objects of the loggers.Logger interface). Returns the run's summary."""
    start, clock = time.perf_counter(), StartupClock()
    heartbeat(0, "setup")
    cfg = fetch_hub_inputs(resolve_resume(cfg), engine=engine)
    clock.mark("fetch")  # a model or data named by Hub id is downloaded here
    job, description = build_job(cfg, engine, clock=clock)
    try:
        first_step = job.resume(cfg.run.resume) if cfg.run.resume else 0
        if cfg.run.resume:
            clock.mark("resume")
        run_dir = _run_dir(cfg, engine)
        return _loop(
            job, run_dir, first_step=first_step, description=description, start=start, loggers=loggers, clock=clock
        )
    finally:
        job.data.close()


def _loop(
    job: Job,
    run_dir: Path,
    *,
    first_step: int,
    description: str,
    start: float,
    loggers: Sequence[Logger] = (),
    clock: StartupClock | None = None,
) -> Summary:
    cfg, engine = job.cfg, job.engine
    lead = engine.rank == 0
    world = f"{engine.world_size} x {engine.device.type}, {engine.strategy.value}, {engine.precision}" + (
        f", tp {engine.tp}" if engine.tp > 1 else ""
    )
    log = open_run_log(cfg, run_dir, plan=f"model: {description}\nworld: {world}", extra=loggers) if lead else None
    retention = (
        Retention(
            run_dir / "checkpoints",
            keep_last=cfg.run.keep_last,
            keep_best=cfg.run.keep_best,
            metric=cfg.run.best_metric,
        )
        if lead and (cfg.run.keep_last or cfg.run.keep_best)
        else None
    )
    metric, stopper = cfg.run.best_metric, job.stopper
    memory_label = "peak CUDA memory per rank" if engine.device.type == "cuda" else "model state per rank (CPU)"
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len * (2 if is_dpo(cfg) else 1)  # DPO: 2 rows a pair
    bar = _progress_bar(cfg, first_step) if lead and cfg.run.progress else None
    first_eval = job.evaluate(first_step, time.perf_counter() - start)
    evaluating = first_eval is not None  # else nothing is held out
    if not evaluating and (stopper or cfg.run.keep_best):
        asked = "train.early_stop_patience" if stopper else "run.keep_best"
        raise ValueError(
            f"{asked} judges the held-out {metric}, but nothing is held out (data.val_fraction 0, no "
            "data.eval_path); hold some rows out (e.g. --data.val_fraction 0.05) or drop it"
        )
    if log and evaluating:
        log.write(first_eval)
    _write_samples(job.samples(first_step), run_dir, log=log, step=first_step)
    if stopper and not first_step:  # a resumed run's stopper already took the evaluations up to first_step
        stopper.update(first_step, first_eval[metric])
    last_eval, memory, stopped, final_step = first_eval, [0] * engine.world_size, None, cfg.train.steps
    norm = None
    if clock is not None:
        clock.mark("first_eval")
    interval_start, interval_steps, train_time, train_tokens = time.perf_counter(), 0, 0.0, 0
    for step in range(first_step, cfg.train.steps):
        heartbeat(step + 1, "train")
        loss, norm, skipped = job.train_step(step)
        if clock is not None and step == first_step:
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)  # once: the first step's kernels, not only their launch
            clock.mark("first_step")
            if log:
                log.write(clock.record(step=step + 1))
        if not skipped:
            job.window.add_step(loss)
        interval_steps += 1
        done = step + 1
        if bar is not None:
            bar.update(1)
        logs = done % cfg.train.log_every == 0 or done == cfg.train.steps
        evaluates = evaluating and (
            (cfg.train.eval_every and done % cfg.train.eval_every == 0) or done == cfg.train.steps
        )
        saves = cfg.run.checkpoint_every and (done % cfg.run.checkpoint_every == 0 or done == cfg.train.steps)
        saves = saves or (cfg.run.keep_best and evaluates)  # so that the best can be kept
        if logs or evaluates or saves:  # a host sync: the moment to stop on a bad step, before any checkpoint
            job.guard.check()
        if logs:
            mean_loss = job.window.take_loss(engine)
            memory = [
                int(b) for b in engine.all_gather(torch.tensor(memory_bytes(job.model, job.optimizer, engine.device)))
            ]
            elapsed = time.perf_counter() - interval_start
            train_time += elapsed
            train_tokens += interval_steps * tokens_per_step
            record = {
                "kind": "train",
                "step": done,
                "loss": mean_loss,
                "lr": job.scheduler.get_last_lr()[0],
                "skipped_steps": job.guard.skipped,
                "grad_norm": None if norm is None else float(norm),
                "tokens": done * tokens_per_step,
                "tokens_per_s": interval_steps * tokens_per_step / elapsed,
                "data_load_s": round(job.load_s, 4),  # of elapsed: reading batches on the host
                "elapsed_s": round(time.perf_counter() - start, 3),
                "memory_bytes": memory,
                **job.log_metrics(),
            }
            if log:
                log.write(record)
            if bar is not None:
                bar.set_postfix(
                    loss="skipped" if mean_loss is None else f"{mean_loss:.3f}",
                    tok_s=f"{record['tokens_per_s']:,.0f}",
                    mem="/".join(format_bytes(b) for b in memory),
                    **({"acc": f"{record['rewards/accuracies']:.2f}"} if "rewards/accuracies" in record else {}),
                )
            interval_steps, interval_start, job.load_s = 0, time.perf_counter(), 0.0
        if evaluates:
            heartbeat(done, "eval")
            pause = time.perf_counter()
            last_eval = job.evaluate(done, pause - start)
            if log:
                log.write(last_eval)
            if bar is not None:
                bar.write(f"step {done}: held-out loss {last_eval['eval_loss']:.4f}" + preference_line(last_eval))
            _write_samples(job.samples(done), run_dir, log=log, step=done)
            stopped = stopper.update(done, last_eval[metric]) if stopper else None
            interval_start += time.perf_counter() - pause
        if saves or (stopped and cfg.run.checkpoint_every):
            heartbeat(done, "checkpoint")
            pause = time.perf_counter()
            job.save(run_dir, done)
            if retention:
                retention.after_save(done, last_eval[metric] if evaluates else None)
            interval_start += time.perf_counter() - pause
        if stopped:
            final_step = done
            if lead:
                print(stopped, flush=True)
            break
    if bar is not None:
        bar.close()
    if cfg.run.export_hf:
        heartbeat(final_step, "export")
        chosen = load_best(job, run_dir) if cfg.run.export == "best" else "the last weights"
        exported = export(cfg, job.model, run_dir)
        if lead and job.data.tokenizer is not None:
            # the run's tokenizer (with its chat template) beside the weights, as from_pretrained reads it
            job.data.tokenizer.save_pretrained(str(exported))
        if lead:
            print(f"exported {chosen} to {exported}", flush=True)
    summary = Summary(
        run_dir=str(run_dir),
        model=description,
        world=world,
        steps=final_step - first_step,
        tokens=train_tokens,
        wall_s=time.perf_counter() - start,
        tokens_per_s=train_tokens / train_time if train_time else math.nan,
        first_eval_loss=first_eval["eval_loss"] if evaluating else None,
        final_eval_loss=last_eval["eval_loss"] if evaluating else None,
        memory_per_rank=memory,
        memory_label=memory_label,
        skipped_steps=job.guard.skipped,
        data=job.data.describe(engine),
        stopped=stopped,
        best=retention and retention.describe_best(),
    )
    if log:
        log.write(
            {
                "kind": "summary",
                "step": final_step,
                "wall_s": round(summary.wall_s, 3),
                "eval_loss_drop": summary.eval_loss_drop,
                "tokens_per_s": summary.tokens_per_s,
                **({"stop_reason": stopped, "stop_step": final_step} if stopped else {}),
                **({"best_checkpoint": summary.best} if summary.best else {}),
            }
        )
        log.close()
        plot_metrics(log.records, run_dir / "metrics.png", memory_label=memory_label)
    return summary


def _write_samples(rows: list[dict], run_dir: Path, *, log: MetricsLog | None, step: int) -> None:
    """Append eval.samples' decoded prompts to runs/<name>/samples.jsonl and the trackers' tables (rank 0)."""
    if log is not None and rows:
        with open(run_dir / "samples.jsonl", "a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        if log.trackers is not None:
            log.trackers.log_table(rows, step=step)


def _progress_bar(cfg: Config, first_step: int):
    from tqdm import tqdm

    return tqdm(total=cfg.train.steps, initial=first_step, desc="train", unit="step", dynamic_ncols=True)


def _parallel_styles(cfg: Config) -> dict[str, bool]:
    """The tensor-parallel plan's options of `cfg` (tp/plans.py)."""
    return {"sequence_parallel": cfg.engine.sequence_parallel, "loss_parallel": cfg.engine.loss_parallel}
