"""PipelineTrainer's behaviour over a fake backend (the model adds nothing to these properties).

Every run is under `asyncio.timeout` and ends with no task left running. Interleavings come from
`asyncio.sleep(0)` yields and events, never from wall-clock sleeps.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from pathlib import Path

import pytest

import artrl as art
from artrl.pipeline_trainer import PipelineTrainer, make_group_rollout_fn
from artrl.run import storage
from artrl.types import TrainResult

USER = {"role": "user", "content": "hi"}


class FakeBackend(art.Backend):
    """Trains nothing: records each call's groups (scenario, initial version) and the step it started from,
    writes an (empty) complete checkpoint per step, and can run a hook inside a call."""

    def __init__(self) -> None:
        self.step = 0
        self.calls: list[tuple[int, list[tuple[int, int]]]] = []
        self.kwargs: list[dict] = []
        self.during_train = None  # async hook(from_step)
        self.stepped = asyncio.Condition()
        self.kept: list[list[int]] = []
        self.run: Path | None = None

    async def register(self, model) -> None:
        self.run = Path(model._get_output_dir())
        storage.write_checkpoint(self.run, 0, lambda d: None, {})

    async def _get_step(self, model) -> int:
        return self.step

    def _model_inference_name(self, model, step=None) -> str:
        return model.name if step is None else f"{model.name}@{step}"

    async def train(self, model, groups, **kwargs):
        self.kwargs.append(kwargs)
        self.calls.append((self.step, [(g.metadata["scenario_id"], min(t.initial_policy_version for t in g.trajectories))
                                       for g in groups]))
        if self.during_train is not None:
            await self.during_train(self.step)
        await asyncio.sleep(0)
        self.step += 1
        storage.write_checkpoint(self.run, self.step, lambda d: None, {})
        async with self.stepped:
            self.stepped.notify_all()
        return TrainResult(step=self.step, metrics={"loss/train": 0.5})

    async def _delete_checkpoint_files(self, model, steps_to_keep) -> None:
        self.kept.append(sorted(steps_to_keep))
        for s in storage.list_checkpoints(self.run):
            if s not in steps_to_keep:
                storage.delete_checkpoint(self.run, s)

    def trained(self) -> list[int]:
        return [s for _, groups in self.calls for s, _ in groups]


def scenarios(n: int, start: int = 0) -> list[dict]:
    return [{"metadata": {"scenario_id": i}} for i in range(start, n)]


def group(scenario, rewards=(0.0, 1.0)) -> art.TrajectoryGroup:
    return art.TrajectoryGroup([art.Trajectory(messages_and_choices=[USER], reward=r) for r in rewards])


async def make_model(tmp_path, backend) -> art.TrainableModel:
    model = art.TrainableModel(name="pipe", project="t", base_model="artrl/tiny", base_path=str(tmp_path),
                               report_metrics=[])
    await model.register(backend)
    return model


async def run(trainer: PipelineTrainer, *, handle_signals: bool = False, seconds: float = 30) -> None:
    """Run the pipeline under a timeout (a deadlock fails the test) and check it leaves no task behind."""
    try:
        async with asyncio.timeout(seconds):
            await trainer.train(handle_signals=handle_signals)
    finally:
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task() and not t.done()]
        assert left == [], f"tasks left running: {left}"


def history(model) -> list[dict]:
    return storage.read_jsonl(Path(model._get_output_dir()) / storage.HISTORY_FILE)


def train_rows(model) -> list[dict]:
    return [r for r in history(model) if r.get("split") == "train"]


# ---------------------------------------------------------------------------------------------- the bound


@pytest.mark.parametrize("bound", [0, 1, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_trained_group_is_within_the_bound_and_discards_are_exact(tmp_path, bound, seed):
    async def main():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)
        rng = random.Random(seed)
        delays = {i: rng.choice([0, 1, 3, 10, 40, 200]) for i in range(40)}

        async def rollout(model, scenario, config):
            for _ in range(delays[scenario["metadata"]["scenario_id"]]):
                await asyncio.sleep(0)
            return group(scenario)

        async def slow_trainer(step):
            for _ in range(rng.choice([0, 5, 50])):
                await asyncio.sleep(0)

        backend.during_train = slow_trainer
        trainer = PipelineTrainer(model, backend, rollout, scenarios(40), None, num_rollout_workers=7,
                                  min_batch_size=3, max_batch_size=5, max_steps_off_policy=bound, eval_fn=None)
        await run(trainer)
        trained = backend.trained()
        for from_step, groups in backend.calls:
            for scenario, version in groups:
                assert 0 <= from_step - version <= bound, (scenario, version, from_step)
        assert len(trained) == len(set(trained))  # no scenario twice
        discarded = trainer.state.discarded_stale_groups
        assert len(trained) + discarded == 40  # every group is trained or counted as stale, exactly
        assert train_rows(model)[-1]["train/discarded_stale_groups"] == discarded
        for row, (from_step, groups) in zip(train_rows(model), backend.calls):
            off = [from_step - version for _, version in groups]
            assert row["train/staleness"] == pytest.approx(sum(off) / len(off))
            assert row["train/staleness_max"] == max(off) <= bound
            # ART's figure counts from the step the call produced: one more
            assert row["train/steps_off_policy"] == pytest.approx(sum(off) / len(off) + 1)
        if bound == 0:  # admission: exactly one step's groups per version, in scenario order
            assert discarded == 0
            assert [g for _, gs in backend.calls for g in gs] == [(i, i // 3) for i in range(39)] + [(39, 13)]

    asyncio.run(main())


def test_a_group_older_than_the_bound_is_discarded_and_counted(tmp_path):
    async def main():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)

        async def rollout(model, scenario, config):
            if scenario["metadata"]["scenario_id"] == 2:  # started on version 0, returns once step 2 exists
                async with backend.stepped:
                    await backend.stepped.wait_for(lambda: backend.step >= 2)
            return group(scenario)

        trainer = PipelineTrainer(model, backend, rollout, scenarios(10), None, num_rollout_workers=4,
                                  min_batch_size=2, max_batch_size=2, max_steps_off_policy=1)
        await run(trainer)
        assert 2 not in backend.trained()
        assert trainer.state.discarded_stale_groups == 1
        assert sorted(backend.trained()) == [0, 1, 3, 4, 5, 6, 7, 8, 9]
        assert train_rows(model)[-1]["train/discarded_stale_groups"] == 1

    asyncio.run(main())


def test_a_rollout_that_never_returns_does_not_stop_training(tmp_path):
    async def main():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)
        never = asyncio.Event()

        async def rollout(model, scenario, config):
            if scenario["metadata"]["scenario_id"] == 1:
                await never.wait()
            return group(scenario)

        trainer = PipelineTrainer(model, backend, rollout, scenarios(100), None, num_rollout_workers=4,
                                  min_batch_size=2, max_steps_off_policy=1, max_steps=6)
        await run(trainer)  # the hung rollout is cancelled when training ends
        assert backend.step == 6 and 1 not in backend.trained()

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------- failures


def test_a_rollout_that_raises_is_counted_and_the_pipeline_goes_on(tmp_path, caplog):
    async def main():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)

        async def rollout(model, scenario, config):
            if scenario["metadata"]["scenario_id"] == 3:
                raise ValueError("tool exploded")
            return group(scenario)

        trainer = PipelineTrainer(model, backend, rollout, scenarios(9), None, num_rollout_workers=3,
                                  min_batch_size=2, max_steps_off_policy=0)
        await run(trainer)
        assert sorted(backend.trained()) == [0, 1, 2, 4, 5, 6, 7, 8]
        assert trainer.state.failed_rollouts == 1 and trainer._status.errored == 1

    asyncio.run(main())
    assert "rollout of scenario 3 failed" in caplog.text and "tool exploded" in caplog.text


def test_a_group_whose_rollouts_all_failed_raises(tmp_path):
    async def single(model, scenario, config):
        if scenario["metadata"]["scenario_id"] == 1:
            raise ConnectionError("server gone")
        return art.Trajectory(messages_and_choices=[USER], reward=random.random())

    async def main():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)
        trainer = PipelineTrainer(model, backend, make_group_rollout_fn(single, n=2), scenarios(8), None,
                                  num_rollout_workers=2, min_batch_size=2, max_steps_off_policy=0)
        with pytest.raises(ExceptionGroup) as info:
            await run(trainer)
        assert info.group_contains(RuntimeError, match=r"All 2 rollouts in group failed.*ConnectionError.*server gone")

    asyncio.run(main())


def test_groups_without_reward_spread_are_set_aside_then_collapse_stops_training(tmp_path, caplog):
    async def main():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)

        async def rollout(model, scenario, config):
            return group(scenario, rewards=(1.0, 1.0))

        trainer = PipelineTrainer(model, backend, rollout, scenarios(50), None, num_rollout_workers=2,
                                  min_batch_size=2, discard_queue_multiplier=3)
        await run(trainer)
        assert backend.calls == [] and trainer._status.zero_var == 6

    asyncio.run(main())
    assert "MODEL COLLAPSE DETECTED" in caplog.text


# ---------------------------------------------------------------------------------------------- stopping


@pytest.mark.parametrize("how", ["request_stop", "SIGINT"])
def test_a_stop_during_a_train_call_ends_after_that_step(tmp_path, how):
    async def main():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)

        async def rollout(model, scenario, config):
            return group(scenario)

        trainer = PipelineTrainer(model, backend, rollout, scenarios(100), None, num_rollout_workers=4,
                                  min_batch_size=2, max_steps_off_policy=1)

        async def stop_in_step_1(step):
            if step == 1:
                if how == "SIGINT":
                    os.kill(os.getpid(), signal.SIGINT)
                    await asyncio.sleep(0)  # the loop runs its signal handler
                else:
                    trainer.request_stop()

        backend.during_train = stop_in_step_1
        await run(trainer, handle_signals=how == "SIGINT")
        assert backend.step == 2 and len(backend.calls) == 2
        assert train_rows(model)[-1]["step"] == 2
        assert model.read_state()["_pipeline_trainer"]["training_step"] == 2

    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN in a background job
    asyncio.run(main())
    assert signal.getsignal(signal.SIGINT) is before  # the handler is put back


def test_the_signal_handlers_a_process_had_are_put_back(tmp_path):
    """A SIGINT the process ignores (nohup, a background job) stays ignored after a run that handled signals."""
    async def main():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)

        async def rollout(model, scenario, config):
            return group(scenario)

        trainer = PipelineTrainer(model, backend, rollout, scenarios(4), None, num_rollout_workers=2,
                                  min_batch_size=2, max_steps_off_policy=1)
        await run(trainer, handle_signals=True)
        assert backend.step >= 1  # it trained

    def mine(signum, frame):
        raise AssertionError("not called")

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN), signal.signal(signal.SIGTERM, mine)
    try:
        asyncio.run(main())
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])


# ---------------------------------------------------------------------------------------------- resume


def test_resume_never_trains_a_scenario_twice_and_counts_scenarios_when_pulled(tmp_path):
    """Run 1 crashes inside its third train call after the step advanced (like a kill after the checkpoint,
    before the state's second write); run 2 resumes from the saved state."""
    async def main():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)

        async def rollout(model, scenario, config):
            return group(scenario)

        on_disk = {}

        async def crash(step):
            if step == 2:
                backend.step += 1
                on_disk.update(model.read_state())  # what a SIGKILL here would leave in state.json
                raise SystemError("killed")

        backend.during_train = crash
        # fewer workers than groups per step: some of a call's scenarios are pulled after the previous
        # step's state was written, so only the write before each call keeps them from being trained twice
        first = PipelineTrainer(model, backend, rollout, scenarios(30), None, num_rollout_workers=2,
                                min_batch_size=4, max_steps_off_policy=0)
        with pytest.raises(ExceptionGroup):
            await run(first)
        model.overwrite_state(on_disk)  # undo what the crash's clean-up wrote: as after a SIGKILL
        trained_before = set(backend.trained())  # includes the crashed call's groups (their step exists)
        offset = model.read_state()["_pipeline_trainer"]["scenario_offset"]
        assert offset >= max(trained_before) + 1  # every trained scenario was counted when pulled

        backend.during_train, backend.calls = None, []
        second = PipelineTrainer(model, backend, rollout, scenarios(30), None, num_rollout_workers=2,
                                 min_batch_size=4, max_steps_off_policy=0)
        await run(second)
        trained_after = backend.trained()
        assert trained_before.isdisjoint(trained_after)
        assert min(trained_after) == offset  # pulled-but-untrained scenarios of run 1 are not retried (ART)
        assert backend.calls[0][0] == 3  # the resumed run starts at the backend's step

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------- eval, retention, rows


def test_eval_stage_retention_and_history_keys(tmp_path):
    async def main():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)
        release_first_eval = asyncio.Event()
        evaluated = []

        async def rollout(model, scenario, config):
            return group(scenario)

        async def eval_fn(model, step, config):
            evaluated.append((step, model.get_inference_name()))
            if step == 0:  # holds a lease on checkpoint 0 until training is well past it
                await release_first_eval.wait()
            return [art.Trajectory(messages_and_choices=[USER], reward=0.25)]

        async def after_step_3(step):
            if step == 4:
                release_first_eval.set()

        backend.during_train = after_step_3
        trainer = PipelineTrainer(model, backend, rollout, scenarios(100), None, eval_fn=eval_fn,
                                  num_rollout_workers=3, min_batch_size=2, max_steps_off_policy=1, max_steps=6,
                                  eval_every_n_steps=3, checkpoint_retention_strategy=lambda ctx: set())
        await run(trainer)
        assert [s for s, _ in evaluated] == [0, 3, 6]
        # while the eval of step 0 held its lease, retention kept checkpoint 0 (the strategy keeps nothing)
        assert all(0 in kept for kept in backend.kept[:3])
        # once the evals have ended, a last pass applies the strategy: only the current step stays
        assert storage.list_checkpoints(backend.run) == [6]
        rows = train_rows(model)
        for key in ("train/steps_off_policy", "train/staleness", "train/staleness_max", "train/discarded_stale_groups",
                    "time/step_wall_s", "throughput/step_trainer_idle_s", "time/step_trainer_s", "time/step_actor_s",
                    "loss/train"):
            assert all(key in r for r in rows), key
        val = [r for r in history(model) if r.get("split") == "val"]
        assert len(val) == 3 and all("time/step_eval_s" in r for r in val)
        saved = [r for r in history(model) if r.get("checkpoint/saved")]
        assert [r["step"] for r in saved] == [1, 2, 3, 4, 5, 6]
        state = model.read_state()["_pipeline_trainer"]
        assert state["completed_eval_steps"] == [0, 3, 6] and state["training_step"] == 6

    asyncio.run(main())


def test_slots_freed_by_dropped_groups_go_to_scenarios_already_waiting(tmp_path):
    """Every worker has already pulled its next scenario when the first groups are dropped (no reward spread);
    their freed slots must reach those waiting scenarios, or nothing would ever train."""
    async def main():
        backend = FakeBackend()
        model = await make_model(tmp_path, backend)

        async def rollout(model, scenario, config):
            flat = scenario["metadata"]["scenario_id"] < 4
            return group(scenario, rewards=(1.0, 1.0) if flat else (0.0, 1.0))

        trainer = PipelineTrainer(model, backend, rollout, scenarios(40), None, num_rollout_workers=4,
                                  min_batch_size=2, max_steps_off_policy=1, max_steps=3)
        await run(trainer)
        assert backend.step == 3 and not {0, 1, 2, 3} & set(backend.trained())
        assert trainer._status.zero_var == 4

    asyncio.run(main())
