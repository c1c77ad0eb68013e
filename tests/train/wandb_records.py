"""Read back a W&B offline run: the records of its run-<id>.wandb file, through wandb's own protobuf.

Offline, wandb writes neither wandb-summary.json nor config.yaml (those come from a sync), and
wandb.Api needs the server; the .wandb file is a LevelDB-style log (a 7-byte file header, then
32 KiB blocks of records with a 7-byte header: CRC32, length, type) of wandb_internal_pb2.Record.
"""

from __future__ import annotations

import json
from pathlib import Path

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    position, parts = 7, b""
    while position + HEADER <= len(data):
        left = BLOCK - position % BLOCK
        length, kind = int.from_bytes(data[position + 4 : position + 6], "little"), data[position + 6]
        if left < HEADER or (kind == 0 and length == 0):  # the block's zero padding
            position += left
            continue
        parts += data[position + HEADER : position + HEADER + length]
        position += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def offline_run(run_dir: Path) -> dict:
    """{'project', 'name', 'config', 'history': [{key: value}], 'summary'} of the one offline run under run_dir."""
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    run = {"config": {}, "history": [], "summary": {}}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(project=record.run.project, name=record.run.display_name)
            run["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            run["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            run["history"].append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            )
        elif kind == "summary":
            run["summary"].update(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.summary.update}
            )
    return run
