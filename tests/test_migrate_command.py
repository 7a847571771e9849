"""`artrl migrate` (ART's `art migrate`): JSONL trajectory logs of ART's layout to Parquet, for a model, project or
trajectories directory; a dry run changes nothing; running it twice, with or without `--keep-jsonl`, or again
after the process was killed mid-write, never adds a log's groups twice."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import artrl as art
from artrl import cli
from artrl.run import trajectory_logs as tl
from artrl.run.migration import trajectory_to_dict


def trajectory(reward: float) -> art.Trajectory:
    return art.Trajectory(messages_and_choices=[{"role": "user", "content": "2+2?"},
                                                {"role": "assistant", "content": f"answer {reward}"}],
                          reward=reward, metadata={"scenario_id": f"s{reward}"})


def write_art_jsonl(path: Path, rewards: list[list[float]]) -> None:
    """ART's JSONL log: one group per line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"trajectories": [trajectory_to_dict(trajectory(r)) for r in group]}) + "\n"
                            for group in rewards))


def rewards_of(parquet: Path) -> list[list[float]]:
    return [[t.reward for t in g.trajectories] for g in tl.read_trajectory_groups_parquet(parquet)]


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """An ART project: two models, one with a train and a val log, one with a train log."""
    root = tmp_path / "my-project"
    write_art_jsonl(root / "models" / "a" / "trajectories" / "train" / "0001.jsonl", [[1.0, 0.0], [0.5, 0.5]])
    write_art_jsonl(root / "models" / "a" / "trajectories" / "val" / "0001.jsonl", [[0.25]])
    write_art_jsonl(root / "models" / "b" / "trajectories" / "train" / "0003.jsonl", [[0.75, 0.0]])
    return root


def test_a_dry_run_says_what_it_would_do_and_changes_nothing(project, capsys):
    before = files(project)
    assert cli.main(["migrate", str(project), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"Migrating project directory: {project}" in out and "[DRY RUN] Would migrate 3 files" in out
    assert files(project) == before


def test_a_project_migrates_to_parquet_beside_each_log_and_a_second_run_changes_nothing(project, capsys):
    assert cli.main(["migrate", str(project), "-v"]) == 0
    out = capsys.readouterr().out
    assert "Processing model: a" in out and "Processing model: b" in out and "Migrated 3 files" in out
    assert list(project.rglob("*.jsonl")) == []
    a = project / "models" / "a" / "trajectories"
    assert rewards_of(a / "train" / "0001.parquet") == [[1.0, 0.0], [0.5, 0.5]]
    assert rewards_of(a / "val" / "0001.parquet") == [[0.25]]
    assert rewards_of(project / "models" / "b" / "trajectories" / "train" / "0003.parquet") == [[0.75, 0.0]]
    after = files(project)
    assert cli.main(["migrate", str(project)]) == 0
    assert "Migrated 0 files" in capsys.readouterr().out and files(project) == after


def test_keep_jsonl_keeps_the_logs_and_migrating_them_again_adds_nothing(project, capsys):
    model = project / "models" / "a"
    assert cli.main(["migrate", str(model), "--keep-jsonl"]) == 0
    assert "Migrating model directory" in capsys.readouterr().out
    log = model / "trajectories" / "train" / "0001.jsonl"
    assert log.exists() and rewards_of(log.with_suffix(".parquet")) == [[1.0, 0.0], [0.5, 0.5]]
    assert cli.main(["migrate", str(model / "trajectories"), "--keep-jsonl"]) == 0
    out = capsys.readouterr().out
    assert "Migrating trajectories directory" in out and "Skipped 2 files (already in their Parquet file)" in out
    assert rewards_of(log.with_suffix(".parquet")) == [[1.0, 0.0], [0.5, 0.5]]  # not twice
    # without --keep-jsonl, a log already in its Parquet file is deleted and its groups still not added again
    assert cli.main(["migrate", str(model)]) == 0
    assert not log.exists() and rewards_of(log.with_suffix(".parquet")) == [[1.0, 0.0], [0.5, 0.5]]


def test_a_steps_parquet_log_keeps_its_groups_and_a_changed_jsonl_is_migrated_again(tmp_path):
    d = tmp_path / "trajectories" / "train"
    tl.write_trajectory_groups_parquet([art.TrajectoryGroup([trajectory(0.1)])], d / "0002.parquet")
    write_art_jsonl(d / "0002.jsonl", [[0.2]])
    assert cli.main(["migrate", str(tmp_path), "--keep-jsonl"]) == 0
    assert rewards_of(d / "0002.parquet") == [[0.1], [0.2]]
    write_art_jsonl(d / "0002.jsonl", [[0.3]])  # another log under the same name: its groups are new
    assert cli.main(["migrate", str(tmp_path)]) == 0
    assert rewards_of(d / "0002.parquet") == [[0.1], [0.2], [0.3]]
    # a later append (a run logging at that step again) keeps what the file records of its migrated logs
    tl.append_trajectory_groups_parquet([art.TrajectoryGroup([trajectory(0.4)])], d / "0002.parquet")
    assert len(tl.migrated_sources(d / "0002.parquet")) == 2


def test_killed_mid_write_nothing_is_half_written_and_the_next_run_finishes(project):
    model = project / "models" / "a"
    # the process dies (SIGKILL) when the first Parquet file is written in full, before it is renamed into place
    script = textwrap.dedent(f"""
        import os, signal
        import artrl.runtime.fs as fs
        from artrl.run.migration import migrate_model_dir
        fs.os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
        migrate_model_dir({str(model)!r})
    """)
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    assert sorted(p.name for p in model.rglob("*.jsonl")) == ["0001.jsonl", "0001.jsonl"]  # both logs kept
    assert list(model.rglob("[0-9]*.parquet")) == []  # no Parquet file under a log's name
    assert cli.main(["migrate", str(model)]) == 0
    assert list(model.rglob("*.jsonl")) == []
    assert rewards_of(model / "trajectories" / "train" / "0001.parquet") == [[1.0, 0.0], [0.5, 0.5]]


def test_a_log_that_cannot_be_read_fails_the_run_and_is_kept(tmp_path, capsys):
    d = tmp_path / "m" / "trajectories" / "val"
    write_art_jsonl(d / "0001.jsonl", [[0.5]])
    (d / "0002.jsonl").write_text("not json{{{\n" + json.dumps({"trajectories": []}) + "\n")
    assert cli.main(["migrate", str(tmp_path / "m")]) == 1
    captured = capsys.readouterr()
    assert "Migrated 1 files" in captured.out and "Errors (1):" in captured.err and "0002.jsonl" in captured.err
    assert (d / "0002.jsonl").exists() and not (d / "0002.parquet").exists()


def test_a_path_that_is_none_of_the_three_or_missing_is_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli.main(["migrate", str(tmp_path / "empty")]) == 1
    assert "cannot tell what" in capsys.readouterr().err
    assert cli.main(["migrate", str(tmp_path / "missing")]) == 1
    assert "path does not exist" in capsys.readouterr().err
