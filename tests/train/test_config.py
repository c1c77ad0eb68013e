import pytest

from shardtrain.train.config import Config, ConfigError, load_config, parse_overrides, save_config


def test_defaults_need_no_file():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.model.name == "llama-2m" and cfg.engine.devices == "auto"


def test_held_out_defaults_per_data_source():
    """A user's rows train whole and the held-out set is evaluated whole, unless asked; the byte corpus
    keeps a held-out share for the main job's held-out loss."""
    cfg = load_config()
    assert cfg.train.eval_batches == 0 and cfg.data.val_fraction is None
    assert cfg.data.held_out_fraction(byte_corpus=False) == 0 and cfg.data.held_out_fraction(byte_corpus=True) > 0
    zero = load_config(None, ["--data.val_fraction", "0"]).data
    assert zero.held_out_fraction(byte_corpus=False) == zero.held_out_fraction(byte_corpus=True) == 0


def test_overrides_are_typed():
    cfg = load_config(
        None,
        [
            "--train.steps",
            "5",
            "--optim.lr=1e-3",
            "--run.tensorboard",
            "--engine.devices",
            "1",
            "--model.wrap",
            "Block,Attention",
            "--data.path",
            "none",
            "--model.kwargs.n_layers",
            "2",
        ],
    )
    assert cfg.train.steps == 5 and cfg.optim.lr == 1e-3 and cfg.run.tensorboard is True
    assert cfg.engine.devices == 1 and cfg.model.wrap == ("Block", "Attention")
    assert cfg.data.path is None and cfg.model.kwargs == {"n_layers": 2}
    assert load_config(None, ["--train.compile", "true"]).train.compile is True
    assert load_config(None, []).train.compile is False


def test_file_then_overrides(tmp_path):
    toml = tmp_path / "job.toml"
    toml.write_text('[train]\nsteps = 7\nbatch_size = 4\n[model]\nname = "llama-tiny"\nkwargs = { n_layers = 1 }\n')
    cfg = load_config(toml, ["--train.steps", "9"])
    assert (cfg.train.steps, cfg.train.batch_size, cfg.model.name, cfg.model.kwargs) == (
        9,
        4,
        "llama-tiny",
        {"n_layers": 1},
    )
    yml = tmp_path / "job.yaml"
    yml.write_text("optim:\n  lr: 0.01\nengine:\n  devices: 2\n")
    cfg = load_config(yml)
    assert cfg.optim.lr == 0.01 and cfg.engine.devices == 2


def test_saved_config_reloads(tmp_path):
    cfg = load_config(None, ["--train.steps", "3", "--model.wrap", "Block", "--model.kwargs.dim", "64"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


@pytest.mark.parametrize(
    "tokens, expected",
    [
        (["--train.stpes", "5"], "did you mean 'train.steps'"),
        (["--steps", "5"], "did you mean 'train.steps'"),
        (["--trian.steps", "5"], "did you mean 'train.steps'"),
        (["--optim.learning_rate", "1"], "Valid keys: optim.name, optim.lr"),
    ],
)
def test_unknown_key_suggests_and_lists(tokens, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, tokens)


def test_unknown_key_in_file_is_an_error(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[train]\nstep = 3\n")
    with pytest.raises(ConfigError, match="did you mean 'train.steps'"):
        load_config(path)


@pytest.mark.parametrize(
    "tokens, expected",
    [
        (["--train.steps", "many"], r"train.steps='many': expected int"),
        (["--train.steps", "0"], r"train.steps=0 is invalid: use 1 or more"),
        (["--run.tensorboard", "maybe"], "expected bool"),
        (["--data.seq_len"], r"--data.seq_len needs a value"),
        (["--data.val_fraction", "1.5"], r"use a value in \[0, 1\) \(0: hold out nothing\)"),
        (["--train.eval_batches", "-1"], r"train.eval_batches=-1 is invalid: use 0 \(all\) or more"),
        (["--lora.targets", "all-linear,q_proj"], r"all-linear already names every linear layer: pass it alone"),
        (["stray"], "unexpected argument 'stray'"),
        (["--train.steps.x", "1"], "is not a table"),
        (["--model.activation_checkpointing", "-1"], r"model.activation_checkpointing=-1 is invalid: use true"),
        (["--dpo.loss", "hinge"], r"dpo.loss='hinge' is invalid: use one of sigmoid, ipo"),
    ],
)
def test_bad_values_name_key_and_fix(tokens, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, tokens)


@pytest.mark.parametrize(
    "text, key, shown",
    [
        ("optim:\n  lr: .inf\n", "optim.lr", "inf"),
        ("optim:\n  grad_clip: .nan\n", "optim.grad_clip", "nan"),
        ("train:\n  ema_decay: -.inf\n", "train.ema_decay", "-inf"),
    ],
)
def test_non_finite_numbers_in_a_file_are_refused(tmp_path, text, key, shown):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{key}={float(shown)!r} is not a finite number; give a finite value such as 0.001"


@pytest.mark.parametrize("value", ["inf", "nan", "-Infinity"])
def test_non_finite_numbers_on_the_command_line_are_refused(value):
    with pytest.raises(ConfigError, match=f"^optim.lr='{value}' is not a finite number; give a finite value"):
        load_config(None, ["--optim.lr", value])


def test_missing_or_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    ini = tmp_path / "c.ini"
    ini.write_text("")
    with pytest.raises(ConfigError, match="unknown format"):
        load_config(ini)


def test_parse_overrides_forms():
    assert parse_overrides(["--a.b", "1", "--c.d=2", "--e.f"]) == [("a.b", "1"), ("c.d", "2"), ("e.f", None)]


def test_data_sources_are_a_list_of_tables_in_toml_and_on_the_command_line(tmp_path):
    path = tmp_path / "mix.toml"
    path.write_text(
        '[[data.sources]]\npath = "task.jsonl"\nweight = 0.7\ncolumns = {question = "prompt"}\n'
        '[[data.sources]]\npath = "chat.jsonl"\nweight = 0.3\ntrain_on = "all"\n'
    )
    more = ["--data.sources.2.path", "more.jsonl", "--data.sources.2.weight", "0.1"]
    cfg = load_config(path, ["--data.sources.1.weight", "0.2", *more])
    task, chat, added = cfg.data.sources
    assert (task.path, task.weight, task.columns) == ("task.jsonl", 0.7, {"question": "prompt"})
    assert (chat.weight, chat.train_on, added.path, added.weight) == (0.2, "all", "more.jsonl", 0.1)
    save_config(load_config(path), tmp_path / "saved.yaml")  # the YAML form reloads the same
    assert load_config(tmp_path / "saved.yaml").data.sources == load_config(path).data.sources
    # one source by --data.path is the same single-item form inside
    assert [s.path for s in load_config(None, ["--data.path", "a.jsonl"]).data.source_list()] == ["a.jsonl"]


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        (["--data.sources.0.wieght", "1"], "did you mean 'data.sources.0.weight'"),
        (["--data.sources", "[{path: a, wieght: 1}]"], "did you mean 'data.sources.0.weight'"),
        (["--data.sources.3.path", "a"], "data.sources has 0 item(s), numbered from 0; set item 0 to add one"),
        (["--data.sources.path", "a"], "is set as data.sources.N.KEY"),
        (
            ["--data.sources", "[{path: a, weight: 1, epochs: 2}]"],
            "data.sources.0.epochs=2.0 is invalid: a source gives a weight",
        ),
        (["--data.sources", "[{path: a, weight: 0}, {path: b, weight: 0}]"], "the weights sum to 0"),
        (["--data.sources", "[{path: a, weight: 1}, {path: b}]"], "give every source a weight, or none"),
        (["--data.sources", "[{path: a}]", "--data.path", "b"], "not both"),
        (["--data.sources", "[{weight: 1}]"], "data.sources.0.path=None is invalid"),
    ],
)
def test_data_source_mistakes_are_one_line_with_the_fix(tokens, expected):
    with pytest.raises(ConfigError) as err:
        load_config(None, tokens)
    assert expected in str(err.value) and "\n" not in str(err.value)
