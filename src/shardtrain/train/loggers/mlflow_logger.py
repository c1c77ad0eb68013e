"""MLflow (the 'mlflow' extra, mlflow-skinny): one MLflow run per launch in the experiment run.project.

The tracking URI is run.mlflow_uri (default: MLFLOW_TRACKING_URI, else a file store in
<run.out_dir>/mlruns). MLflow keeps its file store only on request (MLFLOW_ALLOW_FILE_STORE); a
`file:` URI given here is that request. The configuration goes in as parameters and config.yaml,
the plan as plan.txt, each eval.samples table as samples/step_<N>.json.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .base import RunInfo, flat_config, scalars


class MlflowLogger:
    name = "mlflow"
    fix = (
        "pip install 'shardtrain[mlflow]', and a reachable --run.mlflow_uri (e.g. file:runs/mlruns or http://host:5000)"
    )

    def start(self, run: RunInfo) -> None:
        from mlflow.tracking import MlflowClient

        if run.mlflow_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        elif run.mlflow_uri.startswith(("http://", "https://")):
            import requests

            # a server that is down answers now, not after MLflow's retries
            requests.get(run.mlflow_uri.rstrip("/") + "/health", timeout=10).raise_for_status()
        self._client = client = MlflowClient(tracking_uri=run.mlflow_uri)
        experiment = client.get_experiment_by_name(run.project)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(run.project)
        self._id = client.create_run(experiment_id, run_name=run.name).info.run_id
        from mlflow.entities import Param

        client.log_batch(self._id, params=[Param(k, v[:6000]) for k, v in flat_config(run.config).items()])
        client.log_dict(self._id, run.config, "config.yaml")
        client.log_text(self._id, run.plan, "plan.txt")

    def log(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, record["step"]) for key, value in scalars(record).items()]
        self._client.log_batch(self._id, metrics=metrics)

    def log_table(self, rows: list[dict[str, Any]], *, step: int) -> None:
        columns = {key: [row[key] for row in rows] for key in rows[0]}
        self._client.log_dict(self._id, columns, f"samples/step_{step:06d}.json")

    def finish(self, summary: dict[str, Any]) -> None:
        for key, value in summary.items():
            if isinstance(value, str) and key != "kind":
                self._client.set_tag(self._id, key, value)
        self.log({**summary, "kind": "summary"})
        self._client.set_terminated(self._id, "FINISHED")
