"""Rank side of the packing start-up test: build the main job from a model folder on every rank."""

from __future__ import annotations

from shardtrain.engine import Engine
from shardtrain.train.config import load_config
from shardtrain.train.loop import build_job


def build_outcome(folder: str, data: str, cache: str, *extra: str) -> str:
    """ "built", or the message of the ValueError that stopped `build_job` on this rank."""
    engine = Engine(accelerator="cpu")
    engine.launch()
    cfg = load_config(
        None,
        [
            *("--model.pretrained", folder, "--data.path", data, "--data.eval_path", data),
            *("--data.seq_len", "48", "--data.cache_dir", cache, "--train.batch_size", "4"),
            *("--run.progress", "false", *extra),
        ],
    )
    try:
        build_job(cfg, engine)
    except ValueError as error:
        return str(error)
    return "built"


def sharded_verdicts(mixed_precision: str | None) -> dict[str, str]:
    """Each of transformers' Llama and OPT sharded (every decoder layer a unit) and checked on every rank:
    "accepted", or its refusal; and the dtype its probe measured in."""
    import torch
    import transformers

    import shardtrain as st
    from shardtrain.policy import classes_named
    from shardtrain.train.packed import _VERDICTS, check_packing_supported
    from tests.models_llama.packing import tiny_hf_llama

    torch.manual_seed(0)
    opt = transformers.OPTForCausalLM(
        transformers.OPTConfig(
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=2,
            ffn_dim=64,
            num_attention_heads=4,
            word_embed_proj_dim=32,
        )
    )
    out = {}
    for name, model in (("llama", tiny_hf_llama("sdpa")), ("opt", opt)):
        sharded = st.shard(
            model, wrap=classes_named(model, model._no_split_modules, what="test"), mixed_precision=mixed_precision
        )
        try:
            check_packing_supported(sharded, device=torch.device("cpu"))
            out[name] = "accepted"
        except ValueError as error:
            out[name] = str(error)
        out[f"{name} dtype"] = str(_VERDICTS[sharded][2].dtype)
    return out


def tensor_parallel_verdict() -> str:
    """The built-in Llama over 2 tp ranks, sequence and loss parallel (its logits a DTensor split over
    the vocabulary), checked on every rank: its probe, as text."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import shardtrain as st
    from shardtrain.models.llama import SHARD_UNITS, Llama, llama_config
    from shardtrain.train.packed import _VERDICTS, check_packing_supported

    torch.manual_seed(0)
    model = Llama(llama_config("tiny", n_layers=2))
    plan = st.tp.plan_for(model, sequence_parallel=True, loss_parallel=True)
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    sharded = st.shard(model, wrap=SHARD_UNITS, mesh=mesh, tp_plan=plan)
    check_packing_supported(sharded, device=torch.device("cpu"))
    return str(_VERDICTS[sharded][2])
