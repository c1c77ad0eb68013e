import math

import pytest
import torch

from shardtrain.engine import Engine
from shardtrain.models.llama import SHARD_UNITS, Block, Llama
from shardtrain.policy import classes_named
from shardtrain.train.model_builder import _no_split_units, build_model
from shardtrain.train.schedule import make_scheduler, warmup_cosine
from shardtrain.train.sections import ModelConfig
from shardtrain.train.step import loss_sum


def test_warmup_then_cosine_to_floor():
    f = lambda s: warmup_cosine(s, warmup_steps=4, total_steps=20, min_ratio=0.1)  # noqa: E731
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(12) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(20) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    values = [f(s) for s in range(4, 21)]
    assert values == sorted(values, reverse=True)


def test_scheduler_follows_optimizer_steps():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = make_scheduler(opt, warmup_steps=2, total_steps=10, min_ratio=0.0)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:2] == [1.0, 2.0] and lrs[-1] < lrs[2]


INIT = Engine(devices=1, accelerator="cpu").init_module  # the meta-device context the CLI uses


def test_builds_builtin_llama_on_meta():
    built = build_model(ModelConfig(name="llama-tiny", kwargs={"n_layers": 1}), init_context=INIT)
    assert isinstance(built.module, Llama) and built.wrap == {Block} and built.module.cfg.n_layers == 1
    assert all(p.is_meta for p in built.module.parameters())
    assert built.max_seq_len == 128 and "Llama tiny" in built.description


@pytest.mark.parametrize("size, split", [("2m", False), ("7m", False), ("34m", True), ("1.5b", True), ("8b", True)])
def test_builtin_llama_units_split_the_embedding_once_it_outgrows_a_block(size, split):
    # 2m: a 49K table against 394K-parameter blocks rides in the root; 34m: 4.2M against 3.1M, apart.
    built = build_model(ModelConfig(name=f"llama-{size}"), init_context=INIT)
    assert built.wrap == (SHARD_UNITS if split else {Block})


@pytest.mark.parametrize(
    "name, kwargs, expected",
    [
        ("llama-3t", {}, "unknown Llama size '3t'; built-in sizes: llama-tiny"),
        ("gpt", {}, "use one of llama-tiny"),
        ("llama-tiny", {"layers": 1}, "LlamaConfig fields are vocab_size"),
        ("llama-tiny", {"dim": 65}, "must be divisible"),
        ("llama-tiny", {"n_layers": "abc"}, r"model.kwargs.n_layers='abc' must be a positive integer \(LlamaConfig"),
        ("llama-tiny", {"dim": 0}, "model.kwargs.dim=0 must be a positive integer"),
        ("llama-tiny", {"norm_eps": float("nan")}, "model.kwargs.norm_eps=nan must be a positive finite number"),
        (
            "llama-tiny",
            {"tie_embeddings": "yes"},
            r"model.kwargs.tie_embeddings='yes' must be true or false "
            r"\(LlamaConfig.tie_embeddings\); e.g. --model.kwargs.tie_embeddings false",
        ),
        ("no_such_module:make", {}, "cannot import 'make' from 'no_such_module'"),
        ("torch.nn:Linear", {}, r"raised TypeError"),
        ("builtins:float", {}, "returned float, not an nn.Module"),
        ("hf", {}, "hf_config|transformers"),
    ],
)
def test_model_that_does_not_build_says_why(name, kwargs, expected):
    with pytest.raises(ValueError, match=f"model.name='{name}' does not build: .*({expected})"):
        build_model(ModelConfig(name=name, kwargs=kwargs), init_context=INIT)


def test_factory_and_explicit_wrap():
    built = build_model(
        ModelConfig(
            name="torch.nn:Transformer",
            kwargs={"d_model": 16, "nhead": 2, "batch_first": True},
            wrap=("TransformerEncoderLayer",),
        ),
        init_context=INIT,
    )
    assert {c.__name__ for c in built.wrap} == {"TransformerEncoderLayer"}
    with pytest.raises(ValueError, match=r"not module classes of Linear; its classes are \['Linear'\]"):
        classes_named(torch.nn.Linear(2, 2), ("Block",), what="model.wrap")
    lonely = torch.nn.Linear(2, 2)
    lonely._no_split_modules = ["Block"]  # a model's own list is named as such, not as model.wrap
    with pytest.raises(ValueError, match=r"^Linear._no_split_modules names \['Block'\]"):
        _no_split_units(lonely)


def test_loss_checks_the_vocabulary():
    model = torch.nn.Sequential(torch.nn.Embedding(256, 8), torch.nn.Linear(8, 100))
    tokens = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="predicts 100 classes but the tokenizer has 256"):
        loss_sum(model, {"input_ids": tokens, "labels": tokens}, packed=False, vocab_size=256, chunked=False)
