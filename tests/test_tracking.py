"""report_metrics: W&B (offline, no account) and TensorBoard receive every history row; failures never stop logging."""

from __future__ import annotations

import asyncio
import json
import struct
import time
from pathlib import Path

import pytest

import artrl as art
from artrl.run import storage


def traj(reward: float) -> art.Trajectory:
    return art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"},
                                                {"role": "assistant", "content": "a"}], reward=reward)


def wandb_records(run_file: Path) -> list:
    """The protobuf records of an offline W&B run file (LevelDB log format: 32 KiB blocks of chunks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, pending, out = run_file.read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def test_wandb_offline_receives_every_history_row_and_the_run_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    (tmp_path / "wb").mkdir()
    model = art.Model(name="openai/gpt-4o", project="p", base_path=str(tmp_path / "runs"), report_metrics=["wandb"])
    model.update_wandb_config({"experiment": {"lr": 0.1}})
    asyncio.run(model.log([traj(0.25), traj(0.75)], split="val", step=0))
    asyncio.run(model.log(split="train", step=1, metrics={"loss/train": 1.5, "costs/train/judge": 0.01}))
    asyncio.run(model.log([traj(1.0)], split="val", step=1))
    with pytest.raises(ValueError, match="immutable"):
        model.update_wandb_config({"experiment": {"lr": 0.2}})
    model.finish_tracking()

    (run_file,) = (tmp_path / "wb").glob("wandb/offline-run-*/run-*.wandb")
    assert run_file.name == "run-openai-gpt-4o.wandb"  # ART's id (the model name), made W&B-safe
    deadline = time.monotonic() + 300  # bounds a hung test only
    while True:  # W&B's writer process may still be flushing when finish() returns; its last record is "exit"
        records = wandb_records(run_file)
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        assert time.monotonic() < deadline, "W&B's writer never wrote its exit record"
        time.sleep(0.05)
    logged = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
              for r in records if r.WhichOneof("record_type") == "history"]
    history = [json.loads(x) for x in (storage.run_dir(tmp_path / "runs", "p", "openai/gpt-4o") /
                                       storage.HISTORY_FILE).read_text().splitlines()]
    assert len(logged) == len(history) == 3
    for sent, row in zip(logged, history):
        numeric = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        assert {k: sent[k] for k in numeric} == pytest.approx(numeric)
    assert logged[1]["loss/train"] == 1.5 and logged[1]["training_step"] == 1
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in run.config.update}
    assert config["experiment"] == {"lr": 0.1} and config["model"] == "openai/gpt-4o" and run.project == "p"


def test_tensorboard_needs_no_account_and_gets_every_scalar(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = art.Model(name="m", project="p", base_path=str(tmp_path), report_metrics=["tensorboard"])
    for step, reward in enumerate((0.2, 0.6, 0.9)):
        asyncio.run(model.log([traj(reward)], split="val", step=step))
    model.finish_tracking()
    events = EventAccumulator(str(model._run_dir() / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("val/reward")] == [(0, 0.2), (1, 0.6), (2, 0.9)]
    assert "data/step_num_trajectories" in events.Tags()["scalars"]


def test_a_failing_tracker_is_reported_once_and_logging_goes_on(tmp_path, caplog):
    pytest.importorskip("tensorboard")
    run = storage.run_dir(tmp_path, "p", "m")
    run.mkdir(parents=True)
    (run / "tensorboard").write_text("a file where the log directory should be")
    model = art.Model(name="m", project="p", base_path=str(tmp_path), report_metrics=["tensorboard", "mlflow"])
    with caplog.at_level("WARNING", logger="artrl.run.tracking"):
        for step in range(3):
            asyncio.run(model.log([traj(0.5)], split="val", step=step))
    failures = [r for r in caplog.records if "TensorBoard" in r.getMessage()]
    assert len(failures) == 1 and "Training is not affected" in failures[0].getMessage()
    assert sum("'mlflow' has no effect here" in r.getMessage() for r in caplog.records) == 1
    assert len((run / storage.HISTORY_FILE).read_text().splitlines()) == 3


def test_wandb_without_a_key_or_offline_mode_is_refused_once_without_stopping(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    model = art.Model(name="m", project="p", base_path=str(tmp_path), report_metrics=["wandb"])
    with caplog.at_level("WARNING", logger="artrl.run.tracking"):
        asyncio.run(model.log([traj(0.5)], split="val"))
        asyncio.run(model.log([traj(0.5)], split="val"))
    assert sum("WANDB_API_KEY is not set" in r.getMessage() for r in caplog.records) == 1
    assert model._get_wandb_run() is None
    # the default (None) follows ART: W&B only when WANDB_API_KEY is set
    assert art.Model(name="m2", project="p", base_path=str(tmp_path))._get_wandb_run() is None
