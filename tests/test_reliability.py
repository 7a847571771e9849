"""Crash safety and exact resume of a run directory (issue 6, points 1 and 2).

* The kill test forks a training process per trial and SIGKILLs it at random
  points, most of them inside `storage.write_checkpoint`; the next trial is a new
  process that must resume at the latest complete checkpoint with a history
  that has exactly one train record per step. Its pipelined variant
  (PipelineTrainer) also checks that no scenario is ever trained twice.
* Torn JSONL lines (a crash mid-append) are skipped and reported, never parsed.
* A resumed run reproduces the uninterrupted run's next step (loss and adapter
  weights) for SFT, RL, and a run that switches between them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import artrl as art
from artrl.run import storage

from model_kinds import vision_content

# --------------------------------------------------------------------------- the kill test

KILL_DRIVER = textwrap.dedent('''
    """Kill-test driver. Imports everything once, then forks one training process per trial.

    A forked trial process imports nothing from its predecessors and keeps no state from
    them: it registers the model from the run directory, reports what it resumed, then
    trains and logs until the driver SIGKILLs it. No torch op runs in the driver itself,
    so forking it is safe.
    """
    import asyncio, json, os, random, select, signal, statistics, sys, time, traceback

    import artrl as art
    import artrl.local.backend, artrl.serve, artrl.train.call, artrl.train.trainer, artrl.models.loading  # noqa
    import artrl.train.rl, artrl.train.sft, peft, transformers  # noqa
    from transformers import Qwen3ForCausalLM  # noqa: load the lazy module before forking
    from artrl.run import storage

    ROOT, MIN_TRIALS, MIN_IN_WRITE, MAX_TRIALS, SEED = sys.argv[1], *map(int, sys.argv[2:6])
    INTERNAL = json.loads(sys.argv[6])  # the model's InternalModelConfig fields
    BASE_MODEL = sys.argv[7]
    RUN = storage.run_dir(ROOT, "kill", "m")
    DATA = [art.Trajectory(messages_and_choices=[{"role": "user", "content": f"Say {w}."},
                                                 {"role": "assistant", "content": f"{w} {w}"}], reward=0.0)
            for w in ("red", "blue", "green")]


    def temporaries():
        logs = RUN / storage.TRAJECTORIES_DIR
        roots = [RUN, RUN / storage.CHECKPOINTS_DIR, *(logs.iterdir() if logs.is_dir() else [])]
        return sum(1 for r in roots if r.is_dir() for p in r.iterdir() if p.name.startswith(storage.TMP_PREFIX))


    def unreadable_trajectory_logs():
        import pyarrow.parquet as pq

        bad = 0
        for p in (RUN / storage.TRAJECTORIES_DIR).rglob("*" + storage.TRAJECTORY_LOG_SUFFIX):
            if p.name.startswith(storage.TMP_PREFIX):
                continue
            try:
                pq.read_table(p)
            except Exception:
                bad += 1
        return bad


    def child(wfd, trial, final):
        def say(**msg):
            os.write(wfd, (json.dumps(msg) + "\\n").encode())

        expected = storage.latest_checkpoint(RUN)
        tmp_before = temporaries()
        original = storage.write_checkpoint

        def traced(run, step, write_files, marker):
            say(ev="enter", step=step)
            t0 = time.monotonic()
            path = original(run, step, write_files, marker)
            say(ev="exit", step=step, seconds=time.monotonic() - t0)
            return path

        storage.write_checkpoint = traced

        async def main():
            model = art.TrainableModel(name="m", project="kill", base_model=BASE_MODEL,
                                       _internal_config=art.InternalModelConfig(**INTERNAL))
            backend = art.LocalBackend(path=ROOT, show_progress=False)
            await model.register(backend)
            step = await model.get_step()
            records, torn = storage.scan_jsonl(RUN / storage.HISTORY_FILE)
            train_steps = sorted(r["step"] for r in records if r.get("split") == "train" and "kind" in r)
            traj_bad = unreadable_trajectory_logs()
            say(ev="resumed", step=step, expected=expected, tmp_before=tmp_before, tmp_after=temporaries(),
                torn_history_lines=len(torn), train_steps=train_steps, unreadable_trajectory_logs=traj_bad,
                checkpoints=storage.list_checkpoints(RUN))
            if final:
                backend.close()
                return
            while True:
                await model.log(DATA[:2], split="val")  # a history line and a trajectory log
                await model.train_sft(DATA, config=art.TrainSFTConfig(learning_rate=1e-3))

        asyncio.run(main())


    def run_trial(trial, mode, estimate, rng, final=False):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the trial process
            os.close(r)
            code = 0
            try:
                child(w, trial, final)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        os.close(w)
        events, buf, kill_at, killed = [], b"", None, False
        deadline = time.monotonic() + 180
        enters_to_skip = rng.randrange(3)
        while time.monotonic() < deadline:
            timeout = 0.5 if kill_at is None else max(0.0, kill_at - time.monotonic())
            ready, _, _ = select.select([r], [], [], timeout)
            if kill_at is not None and time.monotonic() >= kill_at:
                os.kill(pid, signal.SIGKILL)
                killed = True
                break
            if not ready:
                continue
            chunk = os.read(r, 65536)
            if not chunk:
                break  # the trial process exited by itself
            buf += chunk
            *lines, buf = buf.split(b"\\n")
            for line in lines:
                ev = json.loads(line)
                events.append(ev)
                if final or kill_at is not None:
                    continue
                if mode == "anywhere" and ev["ev"] == "resumed":
                    kill_at = time.monotonic() + rng.uniform(0.0, 1.5)
                elif mode == "in_write" and ev["ev"] == "enter" and ev["step"] > 0:
                    if enters_to_skip:
                        enters_to_skip -= 1
                    else:
                        kill_at = time.monotonic() + rng.uniform(0.0, estimate())
        if not killed and not final:
            os.kill(pid, signal.SIGKILL)  # timed out: count it as a failed trial below
        _, status = os.waitpid(pid, 0)
        while True:  # what the process wrote before it died
            chunk = os.read(r, 65536)
            if not chunk:
                break
            buf += chunk
        os.close(r)
        for line in buf.split(b"\\n"):
            if line.strip():
                events.append(json.loads(line))
        last_write = [e for e in events if e["ev"] in ("enter", "exit")]
        return {
            "trial": trial, "mode": mode, "killed": killed, "status": status,
            "resumed": next((e for e in events if e["ev"] == "resumed"), None),
            "entered": max((e["step"] for e in events if e["ev"] == "enter"), default=None),
            "exited": max((e["step"] for e in events if e["ev"] == "exit"), default=None),
            "in_write": killed and bool(last_write) and last_write[-1]["ev"] == "enter",
            "write_seconds": [e["seconds"] for e in events if e["ev"] == "exit"],
        }


    def main():
        rng = random.Random(SEED)
        durations = []

        def estimate():  # how long a checkpoint write takes here, from the writes seen so far
            return 1.2 * statistics.median(durations) if durations else 0.1

        trials = []
        while len(trials) < MAX_TRIALS and (
                len(trials) < MIN_TRIALS or sum(t["in_write"] for t in trials) < MIN_IN_WRITE):
            mode = "anywhere" if len(trials) % 4 == 3 else "in_write"
            t = run_trial(len(trials), mode, estimate, rng)
            durations += t["write_seconds"]
            trials.append(t)
        trials.append(run_trial(len(trials), "final", estimate, rng, final=True))
        print(json.dumps(trials))


    main()
''')


def _kill_trials(tmp_path: Path, min_trials: int, min_in_write: int, max_trials: int,
                 internal: dict | None = None, base_model: str = "artrl/tiny") -> list[dict]:
    script = tmp_path / "kill_driver.py"
    script.write_text(KILL_DRIVER)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "runs"), str(min_trials), str(min_in_write),
                           str(max_trials), "20260", json.dumps(internal or {}), base_model], capture_output=True,
                          text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# The model kinds the kill test runs on: the tiny model; 4-bit base weights with 8-bit optimizer states
# (lora_rank 32 makes the adapter's larger tensors reach bitsandbytes' 4096-element minimum for 8-bit state) and
# the tiny mixture-of-experts model, on fewer trials.
KILL_KINDS = {"dense": ("artrl/tiny", {}, 20, 12), "4bit-8bit-states": (
    "artrl/tiny", {"load_in_4bit": True, "dtype": "float32", "optim": "paged_adamw_8bit", "lora_rank": 32}, 8, 5),
    "moe": ("artrl/tiny-moe", {}, 8, 5)}


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(KILL_KINDS))
def test_sigkill_during_checkpoint_writes_never_loses_more_than_the_step_in_progress(tmp_path, kind):
    base_model, internal, min_trials, min_in_write = KILL_KINDS[kind]
    trials = _kill_trials(tmp_path, min_trials=min_trials, min_in_write=min_in_write, max_trials=3 * min_trials,
                          internal=internal, base_model=base_model)
    killed = [t for t in trials if t["killed"]]
    assert len(killed) >= min_trials and sum(t["in_write"] for t in killed) >= min_in_write
    previous = None
    for t in trials:
        r = t["resumed"]
        assert r is not None, f"trial {t['trial']} did not come up after the previous kill: {t}"
        # it resumed at the latest complete checkpoint on disk, and every leftover temporary is gone
        assert r["step"] == (r["expected"] or 0), t
        assert r["tmp_after"] == 0 and r["checkpoints"][-1] == r["step"], t
        assert r["unreadable_trajectory_logs"] == 0, t
        # exactly one train record per completed step; torn lines are counted, never read as data
        assert r["train_steps"] == list(range(1, r["step"] + 1)), t
        if previous is not None and previous["entered"] is not None:
            # a crash costs at most the step in progress: at least the last finished write survives,
            # nothing newer than the last started write appears
            low = previous["exited"] if previous["exited"] is not None else 0
            assert low <= r["step"] <= previous["entered"], (previous, t)
        previous = t
    assert trials[-1]["resumed"]["step"] >= min_trials // 2, "the run should have made progress across the kills"
    run = storage.run_dir(tmp_path / "runs", "kill", "m")
    records = storage.read_jsonl(run / storage.HISTORY_FILE)
    assert [r["step"] for r in records if "kind" in r] == list(range(1, trials[-1]["resumed"]["step"] + 1))
    summary = {"kill_trials": len(killed), "kills_inside_checkpoint_write": sum(t["in_write"] for t in killed),
               "temporaries_found_on_resume": sum(t["resumed"]["tmp_before"] for t in trials),
               "torn_history_lines": max(t["resumed"]["torn_history_lines"] for t in trials),
               "final_step": trials[-1]["resumed"]["step"]}
    print("kill test:", json.dumps(summary))


# --------------------------------------------------------------------------- the kill test, pipelined

PIPELINE_KILL_DRIVER = textwrap.dedent('''
    """Kill-test driver for a pipelined run: forks one process per trial, each resumes the run and trains
    with PipelineTrainer (rollouts through the server, leased checkpoints) until it is SIGKILLed. Before each
    train call the process reports the call's step and scenarios; the driver learns which calls took effect
    from the step the next trial resumes at."""
    import asyncio, json, os, random, select, signal, sys, time, traceback

    import artrl as art
    import artrl.local.backend, artrl.serve, artrl.train.call, artrl.train.trainer, artrl.models.loading  # noqa
    import artrl.train.rl, peft, transformers, openai  # noqa
    from transformers import Qwen3ForCausalLM  # noqa: load the lazy module before forking
    from artrl.pipeline_trainer import PipelineTrainer
    from artrl.run import storage

    ROOT, TRIALS, SEED = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    RUN = storage.run_dir(ROOT, "killpipe", "m")


    def temporaries():
        roots = [RUN, RUN / storage.CHECKPOINTS_DIR]
        return sum(1 for r in roots if r.is_dir() for p in r.iterdir() if p.name.startswith(storage.TMP_PREFIX))


    def child(wfd, final):
        def say(**msg):
            os.write(wfd, (json.dumps(msg) + "\\\\n").encode())

        expected, tmp_before = storage.latest_checkpoint(RUN), temporaries()

        async def rollout(model, scenario, config):
            i = scenario["metadata"]["scenario_id"]

            async def one(j):
                msgs = [{"role": "user", "content": f"Count to {i % 7}."}]
                resp = await model.openai_client().chat.completions.create(
                    model=model.get_inference_name(), messages=msgs, max_tokens=4, logprobs=True, seed=i * 10 + j)
                choice = art.choice_from_completion(resp)
                return art.Trajectory(messages_and_choices=msgs + [choice], reward=len(choice.message.content) + j)

            return art.TrajectoryGroup(await asyncio.gather(one(0), one(1)))

        async def main():
            model = art.TrainableModel(name="m", project="killpipe", base_model="artrl/tiny")
            backend = art.LocalBackend(path=ROOT, show_progress=False)
            await model.register(backend)
            state = (model.read_state() or {}).get("_pipeline_trainer", {})
            say(ev="resumed", step=await model.get_step(), expected=expected, tmp_before=tmp_before,
                tmp_after=temporaries(), checkpoints=storage.list_checkpoints(RUN),
                offset=state.get("scenario_offset", 0))
            if final:
                backend.close()
                return
            real = backend.train

            async def spy(model, groups, **kwargs):
                say(ev="train", step=await model.get_step(), scenarios=[g.metadata["scenario_id"] for g in groups])
                return await real(model, groups, **kwargs)

            backend.train = spy
            scenarios = [{"metadata": {"scenario_id": i}} for i in range(100000)]
            trainer = PipelineTrainer(model, backend, rollout, scenarios, None, num_rollout_workers=3,
                                      min_batch_size=2, max_steps_off_policy=1, learning_rate=1e-4,
                                      eval_fn=None, log_interval_seconds=3600)
            await trainer.train(handle_signals=False)

        asyncio.run(main())


    def run_trial(rng, final):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            code = 0
            try:
                child(w, final)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        os.close(w)
        events, buf, kill_at, trains_before_kill = [], b"", None, rng.randrange(1, 4)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            timeout = 0.5 if kill_at is None else max(0.0, kill_at - time.monotonic())
            ready, _, _ = select.select([r], [], [], timeout)
            if kill_at is not None and time.monotonic() >= kill_at:
                break
            if not ready:
                continue
            chunk = os.read(r, 65536)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\\\\n")
            for line in lines:
                ev = json.loads(line)
                events.append(ev)
                if not final and kill_at is None and ev["ev"] == "train":
                    trains_before_kill -= 1
                    if trains_before_kill == 0:  # somewhere in this call, its checkpoint write, or the next rollouts
                        kill_at = time.monotonic() + rng.uniform(0.0, 1.5)
        if not final:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
        return events


    rng = random.Random(SEED)
    print(json.dumps([run_trial(rng, final=t == TRIALS) for t in range(TRIALS + 1)]))
''')


@pytest.mark.slow
def test_sigkill_during_a_pipelined_run_resumes_without_training_a_scenario_twice(tmp_path):
    script = tmp_path / "kill_pipeline_driver.py"
    script.write_text(PIPELINE_KILL_DRIVER)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "runs"), "6", "20261"], capture_output=True,
                          text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    trials = json.loads(proc.stdout.strip().splitlines()[-1])
    trained: list[int] = []  # every scenario whose train call produced a step that a later trial resumed from
    steps: list[int] = []  # the step each call that took effect trained from
    for before, after in zip(trials, trials[1:]):
        resumed = next(e for e in after if e["ev"] == "resumed")
        # it resumed at the latest complete checkpoint on disk; leftovers of a killed write are gone
        assert resumed["step"] == (resumed["expected"] or 0) and resumed["checkpoints"][-1] == resumed["step"]
        assert resumed["tmp_after"] == 0
        calls = [e for e in before if e["ev"] == "train"]
        assert calls, f"a trial trained nothing before it was killed: {before}"
        trained += [s for e in calls if e["step"] < resumed["step"] for s in e["scenarios"]]
        steps += [e["step"] for e in calls if e["step"] < resumed["step"]]
        # every scenario of a call that took effect was counted as pulled in the saved state
        assert all(s < resumed["offset"] for e in calls if e["step"] < resumed["step"] for s in e["scenarios"])
    assert len(trained) == len(set(trained)), f"scenarios trained twice: {sorted(trained)}"
    final = next(e for e in trials[-1] if e["ev"] == "resumed")
    assert final["step"] >= 6 and steps == list(range(final["step"]))  # one call per step, none lost or repeated
    print("pipelined kill test:", json.dumps({"trials": len(trials) - 1, "final_step": final["step"],
                                              "scenarios_trained": len(trained),
                                              "temporaries_found_on_resume": sum(
                                                  next(e for e in t if e["ev"] == "resumed")["tmp_before"]
                                                  for t in trials)}))


# --------------------------------------------------------------------------- torn lines, partial checkpoints


def test_a_torn_last_line_is_skipped_at_every_cut_and_the_next_append_starts_clean(tmp_path, caplog):
    path = tmp_path / storage.HISTORY_FILE
    good = [{"step": 1, "split": "train", "loss/train": 1.25}, {"step": 2, "split": "val", "val/reward": 0.5}]
    last = json.dumps({"step": 3, "split": "train", "kind": "sft", "loss/train": 0.75}, sort_keys=True)
    for cut in range(1, len(last)):  # every way a crash can tear the last append
        path.unlink(missing_ok=True)
        for rec in good:
            storage.append_jsonl(path, rec)
        with open(path, "a") as fh:
            fh.write(last[:cut])
        with caplog.at_level(logging.WARNING, logger="artrl.run.storage"):
            caplog.clear()
            assert storage.read_jsonl(path) == good
        assert "torn or corrupt" in caplog.text
        storage.append_jsonl(path, {"step": 3, "split": "train", "kind": "sft"})
        records, torn = storage.scan_jsonl(path)
        assert records == [*good, {"step": 3, "split": "train", "kind": "sft"}] and torn == [3]


def test_a_checkpoint_write_that_fails_midway_leaves_nothing_that_looks_like_a_checkpoint(tmp_path):
    run = tmp_path / "run"

    def write_ok(d: Path) -> None:
        (d / storage.ADAPTER_WEIGHTS_FILE).write_bytes(b"weights")

    storage.write_checkpoint(run, 1, write_ok, {"base_model": "b"})

    def write_dies(d: Path) -> None:
        (d / storage.ADAPTER_WEIGHTS_FILE).write_bytes(b"half")
        raise KeyboardInterrupt  # stands in for a crash mid-write

    with pytest.raises(KeyboardInterrupt):
        storage.write_checkpoint(run, 2, write_dies, {"base_model": "b"})
    assert storage.list_checkpoints(run) == [1]
    # what a SIGKILL leaves (no cleanup ran): a temporary directory and a half-written step directory
    (run / storage.CHECKPOINTS_DIR / f"{storage.TMP_PREFIX}0002-dead").mkdir()
    (run / storage.CHECKPOINTS_DIR / "0002").mkdir()
    (run / f"{storage.TMP_PREFIX}model.json").write_text("{")
    assert storage.latest_checkpoint(run) == 1
    assert storage.clean_temporaries(run) == 2
    # rewriting step 2 replaces the incomplete directory
    storage.write_checkpoint(run, 2, write_ok, {"base_model": "b"})
    assert storage.list_checkpoints(run) == [1, 2]
    assert storage.read_marker(storage.checkpoint_dir(run, 2))["step"] == 2


SFT_DATA = [art.Trajectory(messages_and_choices=[{"role": "user", "content": f"Say {w}."},
                                                 {"role": "assistant", "content": f"{w} and {w}"}], reward=0.0)
            for w in ("red", "blue", "green", "pink")]


async def _register(path: Path, base_model: str = "artrl/tiny", **internal) -> tuple[art.TrainableModel,
                                                                                    art.LocalBackend]:
    model = art.TrainableModel(name="m", project="p", base_model=base_model,
                               _internal_config=art.InternalModelConfig(**internal))
    backend = art.LocalBackend(path=str(path), show_progress=False)
    await model.register(backend)
    return model, backend


def test_training_through_backend_train_leaves_no_history_row_after_restarts(tmp_path, make_choice):
    """backend.train writes no history row (ART's); reopening the run must not add one per restart."""
    user = {"role": "user", "content": "Pick a colour."}
    groups = [art.TrajectoryGroup([art.Trajectory(messages_and_choices=[user, make_choice(c)], reward=r)
                                   for c, r in (("blue", 1.0), ("red", 0.0))])]

    async def main():
        model, backend = await _register(tmp_path)
        await model.train_sft(SFT_DATA[:2], config=art.TrainSFTConfig(learning_rate=1e-3))  # step 1: one row
        result = await backend.train(model, groups, learning_rate=1e-4)  # step 2: no row, by design
        assert result.step == 2
        backend.close()
        history = storage.run_dir(tmp_path, "p", "m") / storage.HISTORY_FILE
        rows = history.read_text().splitlines()
        for _ in range(2):
            model, backend = await _register(tmp_path)
            assert await model.get_step() == 2
            backend.close()
        assert history.read_text().splitlines() == rows
        assert [json.loads(x)["step"] for x in rows] == [1]

    asyncio.run(main())


def test_a_lost_history_line_is_restored_from_the_checkpoint_on_resume(tmp_path):
    async def main():
        model, backend = await _register(tmp_path)
        await model.train_sft(SFT_DATA[:2], config=art.TrainSFTConfig(learning_rate=1e-3))
        result = await model.train_sft(SFT_DATA[:2], config=art.TrainSFTConfig(learning_rate=1e-3))
        backend.close()
        history = storage.run_dir(tmp_path, "p", "m") / storage.HISTORY_FILE
        lines = history.read_text().splitlines()
        assert [json.loads(x)["step"] for x in lines] == [1, 2]  # one train row per step
        # as if killed after checkpoint 2 was renamed into place, before its history line was appended
        history.write_text("\n".join(lines[:-1]) + "\n")
        model, backend = await _register(tmp_path)
        assert await model.get_step() == 2
        rows = [json.loads(x) for x in history.read_text().splitlines()]
        assert rows[0] == json.loads(lines[0])
        # the restored row is the checkpoint's: the trainer's metrics of that step (no wall clock, no totals)
        assert (rows[1]["step"], rows[1]["split"], rows[1]["kind"]) == (2, "train", "sft")
        assert rows[1]["loss/train"] == result.metrics["loss/train"]
        assert {k: v for k, v in rows[1].items() if k not in ("step", "split", "kind")} == result.metrics
        backend.close()
        model, backend = await _register(tmp_path)  # nothing more to restore
        assert len(history.read_text().splitlines()) == 2
        backend.close()

    asyncio.run(main())


def test_delete_checkpoints_never_deletes_the_only_complete_checkpoint(tmp_path):
    async def main():
        model, backend = await _register(tmp_path)
        run = storage.run_dir(tmp_path, "p", "m")
        assert await model.delete_checkpoints() == [] and storage.list_checkpoints(run) == [0]
        for reward in (0.9, 0.1):
            await model.train_sft(SFT_DATA[:2], config=art.TrainSFTConfig(learning_rate=1e-3))
            await model.log(metrics={"reward": reward}, split="val")
        # a newer directory without its COMPLETE marker (a crash mid-write) is not a checkpoint
        (run / storage.CHECKPOINTS_DIR / "0003").mkdir()
        assert await model.delete_checkpoints() == [0]
        assert storage.list_checkpoints(run) == [1, 2]
        assert await model.delete_checkpoints("val/no-such-metric") == [1]
        assert storage.list_checkpoints(run) == [2]
        assert await model.delete_checkpoints() == [] and storage.list_checkpoints(run) == [2]
        backend.close()
        model, backend = await _register(tmp_path)
        assert await model.get_step() == 2
        backend.close()

    asyncio.run(main())


# --------------------------------------------------------------------------- exact resume

LRS = art.schedules.cosine(2e-2, 4, warmup=1)  # the user's schedule, indexed by the model's step


def _rl_groups(make_choice, images: bool = False):
    groups = []
    for g, question in enumerate(("Pick a colour.", "Pick a number.")):
        prompt = [{"role": "user", "content": vision_content(question, ["red", "blue"][g]) if images else question}]
        trajs = [art.Trajectory(messages_and_choices=prompt + [make_choice(f"answer {g} {t}" + " yes" * t)],
                                reward=float(t % 2) + 0.25 * t) for t in range(4)]
        groups.append(art.TrajectoryGroup(trajs))
    return groups


VISION_SFT_DATA = [art.Trajectory(messages_and_choices=[{"role": "user", "content": vision_content("Colour?", w)},
                                                        {"role": "assistant", "content": f"{w} and {w}"}], reward=0.0)
                   for w in ("red", "blue", "green", "yellow")]


async def _step(model: art.TrainableModel, kind: str, groups) -> art.TrainResult:
    lr = LRS[await model.get_step()]
    if kind == "sft":
        data = VISION_SFT_DATA if model.base_model == "artrl/tiny-vl" else SFT_DATA
        return await model.train_sft(data, config=art.TrainSFTConfig(learning_rate=lr, batch_size=2))
    return await model.train(groups, config=art.TrainConfig(learning_rate=lr, grad_accumulation_sequences=4))


def _adapter(backend: art.LocalBackend) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(backend._runs["m"].trainer.model).items()}


def _reseed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)


# 4-bit base weights with 8-bit optimizer states (lora_rank 32: the larger adapter tensors reach bitsandbytes'
# 4096-element minimum for 8-bit state, the smaller keep float32 state)
QUANTIZED = {"load_in_4bit": True, "dtype": "float32", "optim": "adamw_8bit", "lora_rank": 32}


MOE = {"base_model": "artrl/tiny-moe", "lora_dropout": 0.0}  # peft puts no dropout on an adapter of the experts
VISION = {"base_model": "artrl/tiny-vl"}  # image-bearing data (_rl_groups, VISION_SFT_DATA)


@pytest.mark.parametrize("kinds,extra", [(("sft", "sft", "sft"), {}), (("rl", "rl", "rl"), {}),
                                         (("sft", "rl", "sft", "rl"), {}), (("rl", "sft", "rl"), QUANTIZED),
                                         (("rl", "sft", "rl"), MOE), (("rl", "sft", "rl", "sft"), VISION)],
                         ids=["sft", "rl", "sft-then-rl", "4bit-8bit-states", "moe", "vision"])
def test_resume_reproduces_the_uninterrupted_next_step(tmp_path, make_choice, kinds, extra):
    """Optimizer moments, the trainer's RNG (LoRA dropout draws from it), step and schedule position are
    restored; the process-wide RNGs play no part (reseeded differently before the resumed step)."""
    groups = _rl_groups(make_choice, images=extra == VISION)
    k = len(kinds) - 1
    internal = {"lora_dropout": 0.1, **extra}

    async def main():
        _reseed(0)
        model, backend = await _register(tmp_path / "straight", **internal)
        straight = [await _step(model, kind, groups) for kind in kinds]
        want = _adapter(backend)
        backend.close()

        _reseed(0)
        model, backend = await _register(tmp_path / "resumed", **internal)
        for kind in kinds[:k]:
            await _step(model, kind, groups)
        backend.close()
        _reseed(12345)  # whatever the process did meanwhile must not matter
        model, backend = await _register(tmp_path / "resumed", **internal)
        assert await model.get_step() == k
        resumed = await _step(model, kinds[k], groups)
        got = _adapter(backend)
        if extra.get("optim") == "adamw_8bit":  # the states really are 8-bit where bitsandbytes keeps them so
            state = backend._runs["m"].trainer.optimizer.state.values()
            assert any(s["state1"].dtype == torch.uint8 for s in state), "no 8-bit optimizer state"
        backend.close()

        a, b = straight[k].metrics, resumed.metrics
        assert resumed.step == straight[k].step == k + 1
        assert b["loss/learning_rate"] == a["loss/learning_rate"]
        assert b["loss/train"] == pytest.approx(a["loss/train"], rel=1e-6, abs=1e-7)
        assert b["loss/grad_norm"] == pytest.approx(a["loss/grad_norm"], rel=1e-5)
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-8, msg=name)

        if kinds[k] == "sft":
            # the check has teeth: with another trainer RNG state, the dropout masks (and the loss) differ
            _reseed(0)
            model, backend = await _register(tmp_path / "resumed-again", **internal)
            for kind in kinds[:k]:
                await _step(model, kind, groups)
            trainer = backend._runs["m"].trainer
            trainer.set_rng_state(trainer._seeded_rng_state(999))
            other = await _step(model, kinds[k], groups)
            backend.close()
            assert other.metrics["loss/train"] != pytest.approx(a["loss/train"], rel=1e-6, abs=1e-7)

    asyncio.run(main())
