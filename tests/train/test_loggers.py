"""Each tracker writes its run (offline / a local store) and the test reads it back through the tracker's
own library; a tracker that cannot start or fails later is one line and the others go on."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardtrain.train.loggers import RunInfo, start_trackers
from shardtrain.train.loggers.base import scalars
from tests.train.test_metrics import RECORDS as METRICS_RECORDS
from tests.train.wandb_records import offline_run

ROOT = Path(__file__).resolve().parents[2]
# the metrics.jsonl records of test_metrics, with the data wait a run measures
RECORDS = [r | {"data_load_s": 0.25 * r["step"]} if r["kind"] == "train" else r for r in METRICS_RECORDS]
SAMPLES = [{"step": 2, "prompt": "What is the capital of Zorbel?", "completion": "Mirtan", "reference": "Mirtan"}]
SUMMARY = {"kind": "summary", "step": 2, "wall_s": 1.5, "stop_reason": "early stop at step 2"}
CONFIG = {"train": {"steps": 2, "batch_size": 8}, "run": {"name": "r1", "loggers": ["wandb"]}}


def _run_info(tmp_path: Path, **changes) -> RunInfo:
    fields = dict(
        name="r1",
        run_dir=tmp_path,
        project="proj",
        config=CONFIG,
        plan="model: tiny\nworld: 2 x cpu",
        mlflow_uri=(tmp_path / "mlruns").as_uri(),
    )
    return RunInfo(**(fields | changes))


def _feed(trackers) -> None:
    for record in RECORDS:
        trackers.log(record)
    trackers.log_table(SAMPLES, step=2)
    trackers.finish(SUMMARY)


def test_scalars_name_each_number_by_kind_and_rank():
    assert scalars(RECORDS[1]) == {
        "train/loss": 5.0,
        "train/lr": 1e-3,
        "train/tokens_per_s": 100.0,
        "train/data_load_s": 0.25,
        "train/memory_bytes/rank0": 1000.0,
        "train/memory_bytes/rank1": 1200.0,
    }
    each = {"kind": "eval", "step": 4, "eval_loss": 2.5, "loss": {"task": 2.0, "general": 3.0}}
    assert scalars(each) == {"eval/eval_loss": 2.5, "eval/loss/task": 2.0, "eval/loss/general": 3.0}


def test_wandb_offline_run_holds_metrics_config_plan_samples_and_summary(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    trackers = start_trackers(["wandb"], _run_info(tmp_path))
    assert [logger.name for logger in trackers.loggers] == ["wandb"]
    _feed(trackers)
    run = offline_run(tmp_path)
    assert (run["project"], run["name"]) == ("proj", "r1")
    assert run["config"]["train"] == {"steps": 2, "batch_size": 8} and run["config"]["plan"].startswith("model: tiny")
    by_step = {row["_step"]: row for row in run["history"]}
    assert by_step[1]["train/loss"] == 5.0 and by_step[1]["train/memory_bytes/rank1"] == 1200
    assert by_step[2]["train/loss"] == 4.0 and by_step[2]["eval/eval_loss"] == 3.3
    assert by_step[2]["train/data_load_s"] == 0.5 and by_step[2]["samples/nrows"] == 1
    assert run["summary"]["stop_reason"] == "early stop at step 2" and run["summary"]["wall_s"] == 1.5
    (table,) = tmp_path.glob("wandb/offline-run-*/files/media/table/samples_2_*.table.json")
    assert json.loads(table.read_text())["data"] == [list(SAMPLES[0].values())]


def test_mlflow_file_store_run_reads_back_through_the_client(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    info = _run_info(tmp_path)
    _feed(start_trackers(["mlflow"], info))
    client = MlflowClient(tracking_uri=info.mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.info.run_name == "r1" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(1, 5.0), (2, 4.0)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "eval/eval_loss")] == [5.5, 3.3]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "train/grad_norm")] == [1.5]
    assert run.data.params["train.batch_size"] == "8" and run.data.tags["stop_reason"] == "early stop at step 2"
    artifacts = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / "got")))
    assert (artifacts / "plan.txt").read_text() == info.plan
    assert json.loads((artifacts / "samples" / "step_000002.json").read_text())["completion"] == ["Mirtan"]


_TRACKIO = """
import json, sys
from pathlib import Path
from shardtrain.train.loggers import RunInfo, start_trackers
from tests.train.test_loggers import _feed, CONFIG
trackers = start_trackers(["trackio"], RunInfo(name="r1", run_dir=Path(sys.argv[1]), project="proj", config=CONFIG, plan="p", mlflow_uri=""))
_feed(trackers)
from trackio.sqlite_storage import SQLiteStorage
print("RESULT", json.dumps({"logs": SQLiteStorage.get_logs("proj", "r1"), "config": SQLiteStorage.get_run_config("proj", "r1")}))
"""


def test_trackio_local_store_reads_back_through_its_storage(tmp_path):
    pytest.importorskip("trackio")
    # trackio reads TRACKIO_DIR when imported: a fresh process keeps the test's store in tmp_path
    env = {**__import__("os").environ, "TRACKIO_DIR": str(tmp_path / "trackio")}
    done = subprocess.run(
        [sys.executable, "-c", _TRACKIO, str(tmp_path)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stderr
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    got = json.loads(line.removeprefix("RESULT "))
    losses = {row["step"]: row["train/loss"] for row in got["logs"] if "train/loss" in row}
    assert losses == {1: 5.0, 2: 4.0}
    assert [row["eval/eval_loss"] for row in got["logs"] if "eval/eval_loss" in row] == [5.5, 3.3]
    assert any(row.get("samples", {}).get("_value") == SAMPLES for row in got["logs"])
    assert got["config"]["train"] == {"steps": 2, "batch_size": 8}
    assert (tmp_path / "trackio" / "proj.db").is_file()


class _Recorder:
    name = "recorder"
    fix = "nothing"

    def __init__(self):
        self.calls = []

    def start(self, run):
        self.calls.append(("start", run.name))

    def log(self, record):
        self.calls.append(("log", record["step"]))

    def log_table(self, rows, *, step):
        self.calls.append(("table", step))

    def finish(self, summary):
        self.calls.append(("finish", summary["step"]))


class _Broken(_Recorder):
    name = "broken"

    def log(self, record):
        super().log(record)
        if record["step"] == 1:
            raise ConnectionError("the server went away")


def test_a_logger_that_cannot_start_is_one_line_and_the_others_go_on(tmp_path, capsys):
    pytest.importorskip("mlflow")
    recorder, broken = _Recorder(), _Broken()
    # port 9 (discard) refuses: MLflow has no server
    trackers = start_trackers(
        ["mlflow"], _run_info(tmp_path, mlflow_uri="http://127.0.0.1:9"), extra=[recorder, broken]
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("note: logger mlflow did not start (ConnectionError")
    assert "--run.mlflow_uri" in lines[0] and "The run continues without it" in lines[0]
    _feed(trackers)
    assert recorder.calls == [
        ("start", "r1"),
        ("log", 0),
        ("log", 1),
        ("log", 2),
        ("log", 2),
        ("table", 2),
        ("finish", 2),
    ]
    assert broken.calls == [("start", "r1"), ("log", 0), ("log", 1)]  # dropped at its first failure
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "note: logger broken failed to log (ConnectionError: the server went away); the run continues without it"
    )


def test_a_missing_library_names_the_extra_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "trackio", None)  # import trackio raises ImportError
    trackers = start_trackers(["trackio"], _run_info(tmp_path))
    assert trackers.loggers == []
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("note: logger trackio did not start (ModuleNotFoundError") or line.startswith(
        "note: logger trackio did not start (ImportError"
    )
    assert "fix: pip install 'shardtrain[trackio]'" in line


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="needs the 'tensorboard' extra")
def test_tensorboard_events(tmp_path):
    _feed(start_trackers(["tensorboard"], _run_info(tmp_path)))
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
