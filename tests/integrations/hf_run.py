"""transformers.Trainer (DDP) against ShardtrainTrainer on a small LlamaForCausalLM, under torchrun.

`torchrun --nproc_per_node=2 hf_run.py OUT [--mode parity|sft|single]`: rank 0 writes
OUT/result.json with both runs' losses, the save_model round trip, generation, the resumed run's
losses and a run with load_best_model_at_end. `--mode sft`: TRL's SFTTrainer with the mixin trains a few steps instead; `--mode single`
(plain `python`, one process): a meta-built model loaded with st.load_pretrained after sharding.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from datasets import Dataset
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast, Trainer, TrainerCallback, TrainingArguments

from shardtrain.core.collectives import observe
from shardtrain.integrations.transformers import ShardtrainTrainer, ShardtrainTrainerMixin
from tests.integrations.toy import ReduceScatters
from tests.pretrained.hf_models import config

SEQ, STEPS, WRAP = 16, 10, ["LlamaDecoderLayer"]
TEXT = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(200)]


def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=160, special_tokens=["<unk>", "<eos>", "<pad>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")


def dataset(tok: PreTrainedTokenizerFast, first: int, count: int) -> Dataset:
    ids = [t for text in TEXT for t in tok(text).input_ids]
    blocks = [ids[i * SEQ : (i + 1) * SEQ] for i in range(first, first + count)]
    return Dataset.from_dict({"input_ids": blocks, "labels": blocks})


def model() -> LlamaForCausalLM:
    """The same initial weights in every run (the pretrained tests' untied Llama; vocabulary 259)."""
    torch.manual_seed(0)
    return LlamaForCausalLM(config("llama_untied"))


def arguments(out: Path, **overrides) -> TrainingArguments:
    defaults = dict(
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        learning_rate=3e-3,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="steps",
        save_steps=5,
        report_to="none",
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
    )
    return TrainingArguments(output_dir=str(out), **{**defaults, **overrides})


def losses(trainer: Trainer, after: int = 0) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h and h["step"] > after]


def grad_norms(trainer: Trainer) -> list[float]:
    return [float(h["grad_norm"]) for h in trainer.state.log_history if "grad_norm" in h]


def compare(out: Path, ref: LlamaForCausalLM, tok: PreTrainedTokenizerFast) -> dict:
    """Rank 0: the saved folder against the DDP run's final weights; the tokenizer came along."""
    saved = LlamaForCausalLM.from_pretrained(out)
    reference = ref.state_dict()
    loaded = PreTrainedTokenizerFast.from_pretrained(out)
    return {
        "saved_names_match": sorted(saved.state_dict()) == sorted(reference),
        "saved_max_diff": max((v - reference[k]).abs().max().item() for k, v in saved.state_dict().items()),
        "tokenizer_round_trip": loaded("def f3(x):").input_ids == tok("def f3(x):").input_ids,
    }


class CountReduces(TrainerCallback):
    """The gradient reduce-scatters of each accumulating micro-batch and of each optimizer step's last one."""

    def __init__(self) -> None:
        self.counter = ReduceScatters()
        self.accumulating: list[int] = []
        self.syncing: list[int] = []

    def on_substep_end(self, args, state, control, **kwargs):
        self.accumulating.append(self.counter.take())

    def on_step_end(self, args, state, control, **kwargs):
        self.syncing.append(self.counter.take())


def best_model(out: Path, common: dict) -> dict:
    """load_best_model_at_end: evaluate and save every 2 of 6 steps, the best being the highest eval loss
    (training lowers it, so the best is an early checkpoint, not the last); the final model's weights
    against the safetensors save_model wrote into each checkpoint."""
    import shardtrain as st

    args = arguments(
        out,
        max_steps=6,
        gradient_accumulation_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        save_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
        greater_is_better=True,
    )
    trainer = ShardtrainTrainer(model=model(), args=args, **common)
    trainer.train()
    evals = {h["step"]: h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h}
    after = trainer.evaluate()["eval_loss"]
    final = st.full_state_dict(trainer.model)
    if dist.get_rank() != 0:
        return {}

    def diff(step: int) -> float:
        saved = load_file(out / f"checkpoint-{step}" / "model.safetensors")
        return max((final[k] - v).abs().max().item() for k, v in saved.items())

    best = Path(trainer.state.best_model_checkpoint).name
    return {
        "evals": evals,
        "best_checkpoint": best,
        "best_metric": trainer.state.best_metric,
        "eval_after_load": after,
        "diff_to_checkpoint": {step: diff(step) for step in evals},
    }


def parity(out: Path) -> dict:
    tok = tokenizer()
    train, evaluation = dataset(tok, 0, 96), dataset(tok, 96, 8)
    common = dict(train_dataset=train, eval_dataset=evaluation, processing_class=tok)
    ddp = Trainer(model=model(), args=arguments(out / "ddp"), **common)
    ddp.train()
    ddp_eval = ddp.evaluate()["eval_loss"]

    documents = dict(fsdp="full_shard auto_wrap", fsdp_config={"transformer_layer_cls_to_wrap": WRAP})
    reduces = CountReduces()
    sharded = ShardtrainTrainer(model=model(), args=arguments(out / "st", **documents), callbacks=[reduces], **common)
    with observe(reduces.counter):
        sharded.train()
    sharded_eval = sharded.evaluate()["eval_loss"]
    sharded.save_model(str(out / "final"))
    prompt = tok("def f12(x):", return_tensors="pt").input_ids
    generated = sharded.model.generate(prompt, max_new_tokens=6, do_sample=False).tolist()

    transformers5 = dict(fsdp=True, fsdp_config={"transformer_layer_cls_to_wrap": WRAP, "reshard_after_forward": True})
    resumed = ShardtrainTrainer(model=model(), args=arguments(out / "st", **transformers5), **common)
    resumed.train(resume_from_checkpoint=str(out / "st" / "checkpoint-5"))
    best = best_model(out / "best", common)
    result = {}
    if dist.get_rank() == 0:
        result = {
            "ddp_losses": losses(ddp),
            "losses": losses(sharded),
            "ddp_grad_norms": grad_norms(ddp),
            "grad_norms": grad_norms(sharded),
            "ddp_eval": ddp_eval,
            "eval": sharded_eval,
            "generated": generated,
            "ddp_generated": ddp.model.generate(prompt, max_new_tokens=6, do_sample=False).tolist(),
            "resumed_losses": losses(resumed, after=5),
            "accumulating_reduces": reduces.accumulating,
            "syncing_reduces": reduces.syncing,
            "checkpoint_files": sorted(p.name for p in (out / "st" / "checkpoint-5").iterdir()),
            **compare(out / "final", ddp.model, tok),
            "best_model": best,
        }
    return result


def sft(out: Path) -> dict:
    from trl import SFTConfig, SFTTrainer

    class ShardtrainSFTTrainer(ShardtrainTrainerMixin, SFTTrainer):
        pass

    tok = tokenizer()
    data = Dataset.from_dict({"text": TEXT[:64]})
    sft_args = SFTConfig(
        output_dir=str(out / "sft"),
        per_device_train_batch_size=2,
        max_steps=4,
        max_length=SEQ,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
        fsdp="full_shard auto_wrap",
        fsdp_config={"transformer_layer_cls_to_wrap": WRAP},
    )
    trainer = ShardtrainSFTTrainer(model=model(), args=sft_args, train_dataset=data, processing_class=tok)
    trainer.train()
    return {"losses": losses(trainer), "sharded": all(hasattr(p, "to_local") for p in trainer.model.parameters())}


def single(out: Path) -> dict:
    """One process without torchrun: a model built on meta, sharded by the Trainer, then loaded with
    st.load_pretrained (the docs' way for models larger than host memory); 3 steps in bf16; save_model."""
    import shardtrain as st

    tok = tokenizer()
    model().save_pretrained(out / "pretrained")
    with torch.device("meta"):
        meta = LlamaForCausalLM(config("llama_untied"))
    args = arguments(out / "single", bf16=True)  # bf16 compute by st.shard, fp32 masters
    args.max_steps = 3
    trainer = ShardtrainTrainer(model=meta, args=args, train_dataset=dataset(tok, 0, 16), processing_class=tok)
    st.load_pretrained(trainer.model, out / "pretrained")
    loaded = st.full_state_dict(trainer.model)
    reference = model().state_dict()
    trainer.train()
    trainer.save_model(str(out / "final"))
    saved = LlamaForCausalLM.from_pretrained(out / "final").state_dict()
    final = st.full_state_dict(trainer.model)
    return {
        "world": dist.get_world_size(),
        "loaded_diff": max((v - reference[k]).abs().max().item() for k, v in loaded.items()),
        "saved_diff": max((v - final[k]).abs().max().item() for k, v in saved.items()),
        "losses": losses(trainer),
        "dtypes": sorted({str(p.dtype) for p in trainer.model.parameters()}),
        "mixed_precision": trainer._sharding.shard["mixed_precision"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--mode", choices=("parity", "sft", "single"), default="parity")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    result = {"parity": parity, "sft": sft, "single": single}[args.mode](args.out)
    if dist.get_rank() == 0:
        (args.out / "result.json").write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    main()
