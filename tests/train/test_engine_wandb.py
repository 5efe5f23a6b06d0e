"""The wandb tracker in wandb's offline mode (no network): scalars, image grids, the resolved
recipe as config, and a resumed run logging into the same wandb run.

The offline run files (``RUN_DIR/wandb/offline-run-*/run-<id>.wandb``) are read back with a
small reader of their record format (a LevelDB-style log of ``wandb.proto`` ``Record`` messages:
a 7-byte file header, then 32 KiB blocks of records, each with a 7-byte header of checksum,
length and type; FULL = 1, FIRST = 2, MIDDLE = 3, LAST = 4)."""

from __future__ import annotations

import json
import time
from importlib.util import find_spec
from pathlib import Path

import pytest
from engine_helpers import load, quiet_console
from tiny_recipe import ENGINE, tiny_recipe, write_recipe

from flowrl.runlog import read_metrics
from flowrl.train import train

# found, not imported: importing it costs every collecting worker its import time
pytestmark = pytest.mark.skipif(find_spec("wandb") is None, reason="needs wandb (the 'wandb' extra)")

# offline by the recipe, not only by WANDB_MODE: wandb's settings are process-wide and an earlier
# test in the same process (another order under pytest-xdist) may have set them up without it
WANDB = [{"use": "wandb", "project": "flowrl-tests", "mode": "offline"}]


def wandb_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", "not a wandb run file"
    pos, records, pending = 7, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def finished_records(path: Path, timeout: float = 60.0) -> list:
    """The records of a finished run file. wandb's service writes the file in the background
    and may still be writing when ``run.finish()`` returns: wait for the run's exit record."""
    end = time.monotonic() + timeout
    while True:
        records = wandb_records(path) if path.is_file() else []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > end:
            return records
        time.sleep(0.2)


def history(records) -> list[dict]:
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item})
    return rows


def run_config(records) -> dict:
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    return {item.key: json.loads(item.value_json) for item in run.config.update}


@pytest.mark.slow
def test_wandb_offline_run_holds_scalars_images_config_and_resumes_into_the_same_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    text = tiny_recipe(ENGINE, log={"image_every": 1}, trackers=WANDB)
    path = write_recipe(tmp_path, text)
    run_dir = tmp_path / "run"
    train(load(path, f"run.output_dir={str(run_dir)!r}", "train.iterations=2"), console=quiet_console())

    run_id = json.loads((run_dir / "wandb_run.json").read_text())["id"]
    (first,) = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    records = finished_records(first / f"run-{run_id}.wandb")
    rows = history(records)
    scalars = [r for r in rows if "reward/area/mean" in r]
    assert [r["iteration"] for r in scalars] == [0, 1]
    metrics = read_metrics(run_dir)
    assert [r["reward/area/mean"] for r in scalars] == pytest.approx([m["reward/area/mean"] for m in metrics])
    assert all(r["speed/images_per_second"] > 0 for r in scalars)  # throughput goes to the trackers
    images = [r for r in rows if "group/_type" in r]
    assert [r["iteration"] for r in images] == [0, 1] and images[0]["group/_type"] == "image-file"
    assert (first / "files" / images[0]["group/path"]).is_file()
    config = run_config(records)
    assert config["train"]["lr"] == 3e-3 and config["model"]["use"] == "embedded"  # the resolved recipe

    # Resume with more iterations: the same wandb run continues (a second offline segment, same id).
    train(load(path, f"run.output_dir={str(run_dir)!r}", "train.iterations=3"), resume=run_dir, console=quiet_console())
    assert json.loads((run_dir / "wandb_run.json").read_text())["id"] == run_id
    segments = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(segments) == 2 and all(s.name.endswith(f"-{run_id}") for s in segments)
    resumed = history(finished_records(segments[-1] / f"run-{run_id}.wandb"))
    assert [r["iteration"] for r in resumed if "reward/area/mean" in r] == [2]
