"""The sections of how the main job runs: the optimizer and its schedule, the training loop, the engine,
and the run's folder, trackers and checkpoints (the model and data sections are sections.py's)."""

from __future__ import annotations

from dataclasses import dataclass

from .dpo_section import OBJECTIVES
from .loggers.trackers import LOGGER_NAMES
from .section_fields import help_field as _help
from .section_fields import require as _require


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    name: str = _help(
        "optimizer: adamw (fused on CUDA), sgd (optim.momentum, optim.nesterov), adafactor, "
        "adamw8bit / adamw4bit (torchao's low-bit AdamW: the 'torchao' extra), or muon (torch's Muon on "
        "the hidden 2-D matrices, AdamW on embeddings, the output head and vectors)",
        "adamw",
    )
    lr: float = _help("peak learning rate", 3e-3)
    schedule: str = _help(
        "learning-rate schedule after optim.warmup_steps of linear warm-up: cosine (to optim.min_lr_ratio; "
        "built in), constant, linear (to 0), cosine_with_restarts (optim.num_cycles hard restarts, to 0) "
        "or wsd (warmup-stable-decay: constant, then the last optim.decay_fraction of the steps decay "
        "to optim.min_lr_ratio); all but cosine are transformers' get_scheduler (the 'hf' extra)",
        "cosine",
    )
    min_lr_ratio: float = _help("final learning rate as a fraction of the peak (cosine and wsd)", 0.1)
    warmup_steps: int = _help("optimizer steps of linear warm-up", 10)
    warmup_ratio: float = _help(
        "warm-up as a fraction of the run's optimizer steps (instead of optim.warmup_steps; 0: use warmup_steps)", 0.0
    )
    num_cycles: int = _help("cosine_with_restarts: the number of cosine cycles", 1)
    decay_fraction: float = _help("wsd: the fraction of the steps that decays at the end", 0.1)
    weight_decay: float = _help("weight decay (not applied to norms and biases)", 0.1)
    beta1: float = _help("AdamW beta1 (adamw, adamw8bit, adamw4bit, and muon's AdamW part)", 0.9)
    beta2: float = _help("AdamW beta2 (adamw, adamw8bit, adamw4bit, and muon's AdamW part)", 0.95)
    momentum: float | None = _help("sgd and muon: momentum (default: 0.9 for sgd, 0.95 for muon)", None)
    nesterov: bool | None = _help("sgd and muon: Nesterov momentum (default: false for sgd, true for muon)", None)
    grad_clip: float = _help("clip the global gradient norm to this value (0: no clipping)", 1.0)

    def __post_init__(self) -> None:
        from .optimizers import OPTIMIZER_NAMES
        from .schedule import SCHEDULE_NAMES

        _require(self.name in OPTIMIZER_NAMES, "optim.name", self.name, f"use one of {', '.join(OPTIMIZER_NAMES)}")
        _require(
            self.schedule in SCHEDULE_NAMES, "optim.schedule", self.schedule, f"use one of {', '.join(SCHEDULE_NAMES)}"
        )
        _require(
            self.name not in ("adamw8bit", "adamw4bit"),
            "optim.name",
            self.name,
            "torchao's low-bit AdamW quantizes blocks of a whole tensor, which the engine's row shards cut "
            "differently, and its quantized state cannot be checkpointed yet; use adamw, or adafactor for "
            "a small optimizer state",
        )
        _require(self.lr >= 0, "optim.lr", self.lr, "use a learning rate of 0 (nothing changes) or more")
        _require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", self.min_lr_ratio, "use a value in [0, 1]")
        _require(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "use 0 or more")
        _require(0 <= self.warmup_ratio < 1, "optim.warmup_ratio", self.warmup_ratio, "use a value in [0, 1)")
        _require(self.num_cycles >= 1, "optim.num_cycles", self.num_cycles, "use 1 or more cycles")
        _require(0 < self.decay_fraction <= 1, "optim.decay_fraction", self.decay_fraction, "use a value in (0, 1]")
        _require(
            self.momentum is None or self.momentum >= 0,
            "optim.momentum",
            self.momentum,
            "use 0 (none) or more, e.g. 0.9",
        )
        _require(
            not self.nesterov or self.momentum is None or self.momentum > 0,
            "optim.nesterov",
            self.nesterov,
            "Nesterov momentum needs momentum: also give --optim.momentum 0.9",
        )
        _require(self.grad_clip >= 0, "optim.grad_clip", self.grad_clip, "use 0 (off) or a positive norm")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = _help("optimizer steps (unless train.epochs is given)", 120)
    objective: str = _help(
        "what the run trains: 'lm' (next-token cross-entropy on the trained tokens) or 'dpo' (preference "
        "tuning on prompt / chosen / rejected rows; the dpo section; train.batch_size then counts pairs)",
        "lm",
    )
    epochs: float = _help(
        "passes over the training windows instead of train.steps (0: use train.steps): floor(epochs x "
        "windows / batch_size) optimizer steps, the same at every world size, printed at start-up; the "
        "data runs on across epoch boundaries, so only the run's last partial batch is dropped",
        0.0,
    )
    batch_size: int = _help("sequences per optimizer step, over all ranks and micro-batches", 16)
    grad_accum: int = _help("micro-batches accumulated per optimizer step", 1)
    eval_every: int = _help("evaluate the held-out loss every N steps (and at step 0 and the end)", 30)
    eval_batches: int = _help(
        "held-out micro-batches per evaluation, at most (0: the whole held-out set, a partial last batch "
        "included; the loss is per held-out trained token, the same for any batch and world size)",
        0,
    )
    log_every: int = _help("log the training loss every N steps", 10)
    ema_decay: float = _help("keep an exponential moving average of the weights on CPU (0: off)", 0.0)
    seed: int = _help("seed of the model initialisation and the data order", 0)
    compile: bool = _help(
        "torch.compile each repeated block after sharding (one graph per block class, activation "
        "checkpointing inside it; the engine's hooks stay eager); the first steps pay the "
        "compilation",
        False,
    )
    float8: bool = _help(
        "train the large Linears in float8 (torchao's Float8Linear; the output head and Linears with a dimension "
        "below 1024 or not a multiple of 16 stay in bf16; checkpoints hold the usual weights): needs "
        "train.compile true and a GPU with float8 matmuls (H100, sm89+), and the 'float8' extra",
        False,
    )
    on_nonfinite: str = _help(
        "a non-finite loss or gradient norm: 'stop' (exit with an error naming the step, before "
        "any checkpoint of it) or 'skip' (skip that optimizer step on every rank and count it; "
        "costs a host sync per step)",
        "stop",
    )
    early_stop_patience: int = _help(
        "stop after this many evaluations in a row without the held-out metric (run.best_metric) improving (0: off)",
        0,
    )
    early_stop_min_delta: float = _help("an evaluation improves when it beats the best by more than this", 0.0)
    chunked_loss: bool | str = _help(
        "compute the loss through the output head in chunks of rows, never holding the [tokens, vocab] logits "
        "(st.chunked_cross_entropy; Liger's fused kernel on CUDA when installed): true, false (the full logits), "
        "or auto (on where the memory estimator prices it below the full logits, for the built-in Llama and "
        "transformers models with an nn.Linear head, without tensor parallelism)",
        False,
    )

    def __post_init__(self) -> None:
        _require(
            self.early_stop_patience >= 0, "train.early_stop_patience", self.early_stop_patience, "use 0 (off) or more"
        )
        _require(
            self.early_stop_min_delta >= 0, "train.early_stop_min_delta", self.early_stop_min_delta, "use 0 or more"
        )
        _require(
            not self.float8 or self.compile,
            "train.float8",
            self.float8,
            "float8 casts are fast only compiled (eager they are kernels of their own, slower than bf16): also "
            "give --train.compile true",
        )
        _require(self.objective in OBJECTIVES, "train.objective", self.objective, f"use one of {', '.join(OBJECTIVES)}")
        _require(self.on_nonfinite in ("stop", "skip"), "train.on_nonfinite", self.on_nonfinite, "use stop or skip")
        _require(
            self.chunked_loss in (True, False, "auto"),
            "train.chunked_loss",
            self.chunked_loss,
            "use true, false or auto",
        )
        for key in ("steps", "batch_size", "grad_accum", "log_every"):
            value = getattr(self, key)
            _require(value >= 1, f"train.{key}", value, "use 1 or more")
        _require(self.eval_batches >= 0, "train.eval_batches", self.eval_batches, "use 0 (all) or more")
        _require(self.epochs >= 0, "train.epochs", self.epochs, "use 0 (train.steps decides) or a positive number")
        _require(self.eval_every >= 0, "train.eval_every", self.eval_every, "use 0 (only first and last) or more")
        _require(0 <= self.ema_decay < 1, "train.ema_decay", self.ema_decay, "use 0 (off) or a value in (0, 1)")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    devices: int | str = _help("'auto' (every GPU, else 2 CPU processes) or a number of processes", "auto")
    accelerator: str = _help("'auto', 'cuda' or 'cpu'", "auto")
    strategy: str = _help(
        "full_shard, shard_grad_op, optimizer_only, no_shard, hybrid_shard, or 'auto' (the fastest "
        "configuration predicted to fit; it also sets model.activation_checkpointing, "
        "engine.cpu_offload and train.grad_accum, keeping train.batch_size)",
        "full_shard",
    )
    cpu_offload: bool | float = _help(
        "keep the fp32 shards, their gradients and the optimizer state in host memory: "
        "true (every unit), or a share such as 0.5 (the units holding half the "
        "parameters)",
        False,
    )
    offload_dir: str | None = _help(
        "with engine.cpu_offload: keep the offloaded units' optimizer state in per-rank files in this "
        "directory on a local disk (the disk tier), streamed through the host optimizer step; with "
        "strategy 'auto': only when nothing fits in device and host memory",
        None,
    )
    precision: str = _help("'auto' (bf16-mixed on GPU, 32-true on CPU), 'bf16-mixed' or '32-true'", "auto")
    auto_trials: int = _help(
        "with strategy 'auto': train this many of the best predicted configurations for a few "
        "steps each, in fresh processes, and keep the fastest measured (0: trust the prediction)",
        0,
    )
    tp: int = _help(
        "tensor parallelism: split each layer over this many ranks (a ('dp', 'tp') mesh, parameters "
        "sharded over the world / tp data-parallel ranks; the built-in Llama's plan, or a Hugging Face "
        "model's base_model_tp_plan); 1: none",
        1,
    )
    sequence_parallel: bool = _help(
        "with engine.tp > 1 and the built-in Llama: split the activations between the layers (norms, "
        "residual) along the sequence over the tp ranks",
        False,
    )
    loss_parallel: bool = _help(
        "with engine.tp > 1 and the built-in Llama: keep the logits split over the vocabulary on the tp "
        "ranks and compute the cross-entropy there (torch's loss_parallel), instead of gathering them",
        False,
    )
    timeout: float = _help(
        "seconds a rank waits in a collective for its peers before the job stops, naming the "
        "rank that did not arrive (raise it for a first step or a tokenization that takes longer)",
        300.0,
    )

    def __post_init__(self) -> None:
        _require(self.auto_trials >= 0, "engine.auto_trials", self.auto_trials, "use 0 (no trials) or more")
        _require(self.tp >= 1, "engine.tp", self.tp, "use 1 (no tensor parallelism) or more ranks per layer")
        _require(
            not self.sequence_parallel or self.tp > 1,
            "engine.sequence_parallel",
            self.sequence_parallel,
            "sequence parallelism splits activations over the tp ranks: also give --engine.tp N (N > 1)",
        )
        _require(
            not self.loss_parallel or self.tp > 1,
            "engine.loss_parallel",
            self.loss_parallel,
            "loss parallelism splits the logits over the tp ranks: also give --engine.tp N (N > 1)",
        )
        _require(self.timeout > 0, "engine.timeout", self.timeout, "use a positive number of seconds, e.g. 300")
        _require(
            isinstance(self.cpu_offload, bool) or 0 < self.cpu_offload <= 1,
            "engine.cpu_offload",
            self.cpu_offload,
            "use true, false, or a share of the parameters in (0, 1]",
        )
        _require(
            self.offload_dir is None or bool(self.cpu_offload) or self.strategy == "auto",
            "engine.offload_dir",
            self.offload_dir,
            "the disk tier holds offloaded state: also give --engine.cpu_offload true (or a share), "
            "or --engine.strategy auto to use it only when nothing fits otherwise",
        )


EXPORT_DTYPES = ("master", "bfloat16", "float16", "float32")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    out_dir: str = _help("directory of the runs", "runs")
    name: str | None = _help("run name (default: the start time)", None)
    checkpoint_every: int = _help("save a checkpoint every N steps and at the end (0: no checkpoints)", 0)
    resume: str | None = _help(
        "checkpoint to resume from: runs/<name>/checkpoints/step_N, runs/<name>/checkpoints (or runs/<name>) for "
        "its latest, or 'latest' (also `--resume` alone) for the run in run.out_dir saved last; the run goes on in "
        "its folder (metrics.jsonl appended) unless run.name names another",
        None,
    )
    keep_last: int = _help(
        "keep only the K newest checkpoints (0: all; with run.keep_best, the newest only, for resuming)", 0
    )
    keep_best: int = _help(
        "also keep the K checkpoints with the lowest run.best_metric, with a checkpoints/best pointer to the "
        "best; a checkpoint is saved at each evaluation (0: off)",
        0,
    )
    best_metric: str = _help(
        "the held-out metric that ranks checkpoints and early stopping: eval_loss or eval_loss_ema", "eval_loss"
    )
    export: str = _help(
        "with run.export_hf: export the 'last' weights, or the 'best' checkpoint (run.keep_best)", "last"
    )
    loggers: tuple[str, ...] = _help(
        f"experiment trackers besides metrics.jsonl, comma-separated: {', '.join(LOGGER_NAMES)} (each its "
        "extra, e.g. pip install 'shardtrain[wandb]'); one that cannot start is one line and the run goes on",
        (),
    )
    project: str = _help("the W&B project, MLflow experiment and trackio project of the run", "shardtrain")
    mlflow_uri: str | None = _help(
        "MLflow tracking URI (default: MLFLOW_TRACKING_URI, else file:<run.out_dir>/mlruns)", None
    )
    tensorboard: bool = _help(
        "also write TensorBoard events (= tensorboard in run.loggers; needs the 'tensorboard' extra)", False
    )
    progress: bool = _help("show a progress bar on rank 0", True)
    export_hf: bool = _help(
        "at the end, write runs/<name>/hf/, a Hugging Face folder that from_pretrained opens "
        "(config.json + safetensors, split past 5 GB), streamed one unit at a time; with LoRA, the "
        "adapters in peft's format unless lora.merge_on_export",
        False,
    )
    export_dtype: str = _help(
        "dtype of the exported weights: 'master' (as stored: the fp32 masters, exact), "
        "'bfloat16', 'float16' or 'float32'",
        "master",
    )

    def __post_init__(self) -> None:
        _require(self.checkpoint_every >= 0, "run.checkpoint_every", self.checkpoint_every, "use 0 or more")
        unknown = [name for name in self.loggers if name not in LOGGER_NAMES]
        _require(not unknown, "run.loggers", ",".join(self.loggers), f"use some of {', '.join(LOGGER_NAMES)}")
        for key in ("keep_last", "keep_best"):
            _require(getattr(self, key) >= 0, f"run.{key}", getattr(self, key), "use 0 (off) or more")
        _require(
            not self.keep_last or self.checkpoint_every or self.keep_best,
            "run.keep_last",
            self.keep_last,
            "it keeps checkpoints: also give --run.checkpoint_every N (or --run.keep_best K)",
        )
        metrics = ("eval_loss", "eval_loss_ema")
        _require(self.best_metric in metrics, "run.best_metric", self.best_metric, f"use one of {', '.join(metrics)}")
        _require(self.export in ("last", "best"), "run.export", self.export, "use last or best")
        _require(
            self.export == "last" or (self.keep_best and self.export_hf),
            "run.export",
            self.export,
            "exporting the best checkpoint needs --run.keep_best K and --run.export_hf true",
        )
        _require(
            self.export_dtype in EXPORT_DTYPES,
            "run.export_dtype",
            self.export_dtype,
            f"use one of {', '.join(EXPORT_DTYPES)}",
        )
