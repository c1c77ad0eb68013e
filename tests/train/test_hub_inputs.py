"""`shardtrain train --model.pretrained org/name --data.path org/name`: a Hub model and dataset, read from
the HF cache with the network off (built here, nothing downloaded), on 2 ranks; each missing id one line."""

import json

import pytest
import yaml

from tests.data.hub_fixture import cache_snapshot, dataset_repo
from tests.train.data_runs import records
from tests.train.facts import chat_rows, llama_folder, prompt_completion_rows, write_jsonl
from tests.train.hub_ranks import fetch_error, train_offline
from tests.train.test_finetune_data import _args as hub_args

pytest.importorskip("datasets")
SHORT = ("--train.batch_size", "4", "--train.steps", "2", "--optim.warmup_steps", "1")


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> dict:
    """HF_HOME with 'org/llama' (a model), 'org/facts' (a dataset: configs chat and completions) and 'org/held'
    (16 other prompt/completion rows) cached."""
    root = tmp_path_factory.mktemp("hub")
    cache = root / "home" / "hub"
    model = cache_snapshot(cache, kind="model", repo_id="org/llama", folder=llama_folder(root / "llama"))
    parts = {"chat": {"train": chat_rows()[:40]}, "completions": {"train": prompt_completion_rows()[:24]}}
    facts = dataset_repo(root / "facts", parts)
    cache_snapshot(cache, kind="dataset", repo_id="org/facts", folder=facts)
    held = dataset_repo(root / "held", {"default": {"train": prompt_completion_rows()[24:40]}})
    cache_snapshot(cache, kind="dataset", repo_id="org/held", folder=held)
    return {"home": str(root / "home"), "cache": cache, "model": model}


def _args(tmp_path, *extra: str) -> list[str]:
    """test_finetune_data's run, from the Hub ids, 2 short steps on the 'completions' config."""
    return hub_args("org/llama", "org/facts", tmp_path, "--data.config", "completions", *SHORT, *extra)


def test_a_hub_model_and_dataset_train_offline_by_id(pools, hub, tmp_path):
    results = pools(2).run(train_offline, hub["home"], _args(tmp_path, "--run.export_hf", "true"))
    assert [code for code, _, _ in results] == [0, 0], [err for _, _, err in results]
    out = " ".join(results[0][1].split())
    assert "24 rows (0 held out)" in out  # the 'completions' config alone, not the 40 chat rows too
    saved = yaml.safe_load((tmp_path / "runs" / "ft" / "config.yaml").read_text())
    assert saved["model"]["pretrained"] == str(hub["model"])  # the run read the cached snapshot
    exported = tmp_path / "runs" / "ft" / "hf"
    assert json.loads((exported / "config.json").read_text())["hidden_size"] == 64
    assert (exported / "tokenizer.json").is_file()


def test_each_missing_hub_id_is_one_line_on_every_rank(pools, hub, tmp_path):
    cache = hub["cache"]
    offline = "offline (HF_HUB_OFFLINE=1), so only the HF cache was searched"
    cases = [
        (
            ["--model.pretrained", "org/missing"],
            f"model.pretrained='org/missing': not a local path; {offline}, and the model is not in the HF cache "
            f"at {cache}; download it once with network (HF_HUB_OFFLINE unset), or pass a local model folder",
        ),
        (
            ["--data.path", "org/nodata"],
            f"data.path='org/nodata': not a local path; {offline}, and the dataset is not in the HF cache at {cache}",
        ),
        (["--data.config", "nope"], "data.path='org/facts': cannot load config 'nope', split 'train'"),
    ]
    for overrides, message in cases:
        for error in pools(2).run(fetch_error, hub["home"], *_args(tmp_path), *overrides):
            assert message in error and "\n" not in error, error


def _mix_args(tmp_path, *extra: str) -> list[str]:
    """Two sources (a Hub config and a local file) held out as a whole mix by data.eval_path."""
    local = write_jsonl(prompt_completion_rows()[40:80], tmp_path / "local.jsonl")
    sources = f"[{{path: org/facts, config: completions, weight: 0.5}}, {{path: {local}, weight: 0.5}}]"
    args = _args(tmp_path, "--data.sources", sources, "--train.eval_every", "2", *extra)
    cut = args.index("--data.path")
    return [*args[:cut], *args[cut + 2 :]]


@pytest.mark.parametrize("streaming", ["false", "true"])
def test_a_hub_id_as_the_whole_mixs_eval_path_is_read_offline_from_the_cache(pools, hub, tmp_path, streaming):
    args = _mix_args(tmp_path, "--data.eval_path", "org/held", "--data.streaming", streaming)
    results = pools(2).run(train_offline, hub["home"], args)
    assert [code for code, _, _ in results] == [0, 0], [err for _, _, err in results]
    evals = [r for r in records(tmp_path / "runs" / "ft") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2] and all(r["eval_loss"] > 0 for r in evals)


def test_a_missing_eval_path_beside_sources_is_one_line_on_every_rank(pools, hub, tmp_path):
    cache, missing = hub["cache"], str(tmp_path / "none.jsonl")
    offline = "offline (HF_HUB_OFFLINE=1), so only the HF cache was searched"
    cases = [
        ("org/nohold", f"data.eval_path='org/nohold': not a local path; {offline}, and the dataset is not in the HF "
         f"cache at {cache}; download it once with network (HF_HUB_OFFLINE unset), or pass a local file or folder"),
        (missing, f"data.eval_path={missing!r} does not exist; pass an existing file or folder"),
    ]  # fmt: skip
    for eval_path, message in cases:
        for error in pools(2).run(fetch_error, hub["home"], *_mix_args(tmp_path, "--data.eval_path", eval_path)):
            assert message in error and "\n" not in error, error
