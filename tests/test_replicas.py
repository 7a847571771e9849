"""Rollouts on several built-in engine replicas, each a process, behind the real router (vllm-router).

One model on 3 replicas (`inference_replicas=3`) for the whole module, the tests in order: a rollout's
turns stay on one replica while rollouts spread; the token record is the same whichever replica serves; a
train call publishes on every replica; a replica killed mid-run is taken out, a rollout that was on it fails
clearly, and it rejoins with every retained version; PipelineTrainer runs on it unchanged and pruning unloads
everywhere. The README's loop runs unchanged on 2 replicas. Every wait is on an event or a condition with a
timeout (ReplicaSet.wait_for); no process is left behind (the last test checks)."""

from __future__ import annotations

import asyncio
import os
import signal

import openai
import pytest

import artrl as art
from artrl.client import affinity
from artrl.replicas.client import ReplicaClient

pytestmark = pytest.mark.slow

REPLICAS = 3
WAIT_S = 240.0  # a replica restarts by loading its own model: on a busy 2-core machine, tens of seconds


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = tmp_path_factory.mktemp("replicas")
    holder: dict = {}

    async def start():
        backend = art.LocalBackend(path=str(path), show_progress=False)
        model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny",
                                   _internal_config=art.InternalModelConfig(seed=0, max_length=128,
                                                                            inference_replicas=REPLICAS))
        await model.register(backend)
        holder.update(backend=backend, model=model)

    asyncio.run(start())
    backend, model = holder["backend"], holder["model"]
    yield backend, model, backend.replicas(model)
    pids = [r.process.pid for r in backend.replicas(model).replicas if r.process is not None]
    backend.close()
    for pid in pids:  # every replica process has ended
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def turns(model, k: int, n_turns: int = 3, seed: int | None = None) -> list[tuple[str, dict]]:
    """One rollout of `n_turns` turns through `model.openai_client()`: (replica, choice JSON) of each turn."""
    client = model.openai_client()
    messages = [{"role": "user", "content": f"rollout {k}"}]
    out = []
    for turn in range(n_turns):
        raw = await client.chat.completions.with_raw_response.create(
            model=model.get_inference_name(), messages=messages, max_tokens=4, seed=seed)
        choice = raw.parse().choices[0]
        out.append((raw.headers[affinity.REPLICA_HEADER], choice.model_dump()))
        messages += [{"role": "assistant", "content": choice.message.content or ""},
                     {"role": "user", "content": f"turn {turn}"}]
    return out


def test_a_rollouts_turns_stay_on_one_replica_and_rollouts_spread(served):
    backend, model, replicas = served
    assert len(replicas.in_service()) == REPLICAS and model.inference_base_url == replicas.base_url
    assert model.get_inference_name() == "m@0"

    async def main():
        async with asyncio.timeout(120):
            return await asyncio.gather(*(turns(model, k) for k in range(16)))

    rollouts = asyncio.run(main())
    for rollout in rollouts:
        assert len({replica for replica, _ in rollout}) == 1  # every turn on the rollout's replica
        for _, choice in rollout:  # the token record comes through the router unchanged
            assert choice["token_ids"] and choice["prompt_token_ids"] and choice["policy_version"] == 0
    assert len({rollout[0][0] for rollout in rollouts}) >= 2  # 16 sessions over 3 replicas: spread


def test_the_token_record_is_the_same_whichever_replica_serves(served):
    """The same seeded request to each replica directly: the same prompt ids, sampled ids, logprobs, version."""
    from artrl.replicas.client import http_call

    backend, model, replicas = served
    body = {"model": "m@0", "messages": [{"role": "user", "content": "same"}], "max_tokens": 6, "seed": 11}
    answers = [http_call(r.url, "POST", "/v1/chat/completions", body=body, api_key=model.inference_api_key).json()
               for r in replicas.in_service()]
    records = [(a["choices"][0]["prompt_token_ids"], a["choices"][0]["token_ids"], a["choices"][0]["policy_version"],
                [c["logprob"] for c in a["choices"][0]["logprobs"]["content"]]) for a in answers]
    assert len(records) == REPLICAS
    for record in records[1:]:
        assert record[:3] == records[0][:3]
        assert record[3] == pytest.approx(records[0][3], abs=1e-5)


def test_a_train_call_publishes_the_new_step_on_every_replica(served, make_choice):
    backend, model, replicas = served
    groups = [art.TrajectoryGroup([art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"},
                                                                        make_choice(f"answer {i}")], reward=float(i))
                                   for i in range(3)])]

    async def main():
        result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-3))
        assert result.step == 1 and model.get_inference_name() == "m@1"
        async with asyncio.timeout(120):
            return await asyncio.gather(*(turns(model, k, n_turns=1) for k in range(8)))

    rollouts = asyncio.run(main())
    assert {choice["policy_version"] for rollout in rollouts for _, choice in rollout} == {1}
    for replica in replicas.replicas:
        state = ReplicaClient(replica.url, model.inference_api_key).identity()["models"]["m"]
        assert state["live_step"] == 1 and {0, 1} <= set(state["loaded_steps"])
    assert replicas.published == 1 and sorted(replicas.versions) == [0, 1]


def test_a_killed_replica_is_taken_out_its_rollout_fails_clearly_and_it_rejoins_with_every_version(served):
    backend, model, replicas = served
    victim = replicas.replicas[0]
    pid, old_id = victim.process.pid, victim.id

    async def main():
        async with asyncio.timeout(WAIT_S):
            # a rollout whose first turn the victim served (sessions hash at random: try a few)
            on_victim = None
            for k in range(64):
                started = asyncio.Event()
                proceed = asyncio.Event()

                async def rollout(k=k, started=started, proceed=proceed):
                    first = await turns(model, 100 + k, n_turns=1)
                    started.set()
                    if first[0][0] != old_id:
                        return None
                    await proceed.wait()
                    return await turns(model, 100 + k, n_turns=1)  # the same task: the same session

                task = asyncio.create_task(rollout())
                await started.wait()
                if task.done():
                    continue
                on_victim = (task, proceed)
                break
            assert on_victim is not None, "no session landed on replica 0 in 64 tries"
            task, proceed = on_victim
            os.kill(pid, signal.SIGKILL)
            assert await asyncio.to_thread(replicas.wait_for, lambda: not victim.in_service, WAIT_S)
            proceed.set()
            with pytest.raises(openai.APIStatusError) as failed:
                await task
            assert failed.value.status_code == 410 and old_id in str(failed.value)
            # meanwhile new rollouts go to the others
            others = await asyncio.gather(*(turns(model, 200 + k, n_turns=1) for k in range(4)))
            assert old_id not in {r[0][0] for r in others}

    asyncio.run(main())
    assert replicas.wait_for(lambda: victim.in_service and victim.generation == 1, WAIT_S)
    assert victim.process.pid != pid
    state = ReplicaClient(victim.url, model.inference_api_key).identity()
    assert state["replica"] == victim.id != old_id
    assert state["models"]["m"]["live_step"] == replicas.published == 1
    assert set(replicas.versions) <= set(state["models"]["m"]["loaded_steps"])  # every retained version
    assert len(replicas.in_service()) == REPLICAS


def test_a_lease_keeps_its_version_on_every_replica_and_pruning_unloads_everywhere(served):
    backend, model, replicas = served

    def loaded() -> list[set[int]]:
        return [set(ReplicaClient(r.url, model.inference_api_key).identity()["models"]["m"]["loaded_steps"])
                for r in replicas.in_service()]

    async def main():
        async with backend.adapter_lease(model, 0):
            await backend.prune_model_adapters(model, retain_steps={1})
            assert all(0 in steps for steps in loaded())  # leased: kept everywhere
            assert (await turns(model, 300, n_turns=1))[0][1]["policy_version"] == 0  # `m@0` inside the lease
        await backend.prune_model_adapters(model, retain_steps={1})
        assert all(steps == {1} for steps in loaded())  # released: unloaded everywhere
        async with backend.adapter_lease(model, 0):  # leased again: loaded everywhere again first
            assert all(0 in steps for steps in loaded())

    asyncio.run(main())


def test_pipeline_trainer_runs_unchanged_on_replicas(served):
    from artrl.pipeline_trainer import PipelineTrainer
    from test_pipeline_local import GROUPS_PER_STEP, TRAIN, make_rollout, scenario_list

    backend, model, replicas = served
    start = replicas.published
    names: list[tuple[str, int]] = []

    async def main():
        trainer = PipelineTrainer(model, backend, make_rollout(names), scenario_list()[:2 * GROUPS_PER_STEP], None,
                                  num_rollout_workers=4, min_batch_size=GROUPS_PER_STEP, max_batch_size=GROUPS_PER_STEP,
                                  max_steps_off_policy=1, **TRAIN)  # two steps of two groups, however they arrive
        async with asyncio.timeout(600):
            await trainer.train(handle_signals=False)

    asyncio.run(main())
    assert replicas.published == start + 2 == model_step(model)
    assert {n for n, _ in names} <= {f"m@{v}" for v in range(start, start + 2)}  # leased versions, by name
    for replica in replicas.in_service():  # the trainer pruned: what it retains, everywhere
        state = ReplicaClient(replica.url, model.inference_api_key).identity()["models"]["m"]
        assert state["live_step"] == start + 2 and set(state["loaded_steps"]) == set(replicas.versions)
    assert set(replicas.versions) <= {start + 1, start + 2}


def model_step(model) -> int:
    return asyncio.run(model.get_step())


def test_the_readme_loop_runs_unchanged_on_replicas(tmp_path):
    """The README's loop, its model given `inference_replicas=2` and nothing else changed, for 2 steps."""
    import subprocess
    import sys

    from test_readme_loop import readme_loop

    code = readme_loop().replace(", 20):", ", 2):")
    model_line = 'base_model="artrl/tiny")'
    assert code.count(model_line) == 1
    code = code.replace(model_line, 'base_model="artrl/tiny",\n        '
                                    '_internal_config=art.InternalModelConfig(inference_replicas=2))')
    (tmp_path / "loop.py").write_text(code)
    run = subprocess.run([sys.executable, "loop.py"], cwd=tmp_path, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    assert [line.split(":")[0] for line in run.stdout.splitlines()] == ["step 1", "step 2"]
    assert run.stderr.count("published on 2 replicas") == 2  # each step on both replicas


def test_a_turn_in_flight_on_a_replica_that_dies_fails_its_trajectory_and_the_gather_goes_on(tmp_path):
    """Two paced scripted replicas (each turn takes 2 s): 12 rollouts send their second turn, then one replica
    is killed. The rollouts it was serving fail with an error (ART's gather rules count them), the others end
    normally, and nothing waits for ever."""
    from artrl.replicas.control import ReplicaSet

    cfg = art.InternalModelConfig(inference_replicas=2, inference_max_batch_size=16, device="cpu")
    replicas = ReplicaSet(name="s", base_model="artrl/tiny", cfg=cfg, run=tmp_path, api_key="k", engine="scripted",
                          engine_options=["--token-time-ms", "200", "--reply-tokens", "10"]).start()
    try:
        replicas.set_live_weights(str(tmp_path), 0)
        model = art.Model(name="s", project="p", inference_base_url=replicas.base_url, inference_api_key="k")
        victim = replicas.replicas[0]
        on: dict[int, str] = {}

        async def main():
            second_sent = asyncio.Semaphore(0)

            async def rollout(k: int) -> art.Trajectory:
                client = model.openai_client()
                messages = [{"role": "user", "content": f"r{k}"}]
                first = await client.chat.completions.with_raw_response.create(model="s", messages=messages)
                on[k] = first.headers[affinity.REPLICA_HEADER]
                messages += [{"role": "assistant", "content": first.parse().choices[0].message.content},
                             {"role": "user", "content": "again"}]
                second_sent.release()
                choice = (await client.chat.completions.create(model="s", messages=messages)).choices[0]
                return art.Trajectory(messages_and_choices=messages + [choice], reward=1.0)

            async with asyncio.timeout(120):
                gather = asyncio.ensure_future(art.gather_trajectories(
                    (rollout(k) for k in range(12)), max_exceptions=12))
                for _ in range(12):
                    await second_sent.acquire()
                victim_id = victim.id
                os.kill(victim.process.pid, signal.SIGKILL)  # every rollout is in its second turn
                trajectories = await gather
            return victim_id, trajectories

        victim_id, trajectories = asyncio.run(main())
        survivors = sum(1 for replica in on.values() if replica != victim_id)
        assert 0 < survivors < 12, on  # 12 sessions over 2 replicas: both served some
        ok = [t for t in trajectories if isinstance(t, art.Trajectory)]
        failed = [t for t in trajectories if not isinstance(t, art.Trajectory)]
        assert len(ok) == survivors, failed  # the victim's rollouts are the failed ones, the others whole
        assert all(isinstance(e, openai.APIError) for e in failed), failed
        print(sorted({f"{type(e).__name__}: {str(e)[:160]}" for e in failed}))
    finally:
        replicas.close()


def test_a_replica_killed_during_its_own_restart_has_one_restart_and_leaves_no_process(tmp_path):
    """The replica dies, and its new process dies too while that restart checks it: the same restart tries again
    (generation 2), no second restart starts beside it (which would stop the first one's process, or leave one
    running that nothing owns), and after `close` no replica process is left."""
    import threading

    import psutil

    from artrl.replicas.control import ReplicaSet

    cfg = art.InternalModelConfig(inference_replicas=1, device="cpu")
    replicas = ReplicaSet(name="s", base_model="artrl/tiny", cfg=cfg, run=tmp_path, api_key="k", engine="scripted",
                          engine_options=["--reply-tokens", "2"]).start()
    in_restart, proceed = threading.Event(), threading.Event()
    check_identity = replicas._check_identity

    def held_check(replica):  # the first restart's process is up; hold its check until the test killed it
        if replica.generation == 1:
            in_restart.set()
            assert proceed.wait(WAIT_S)
        check_identity(replica)

    replicas._check_identity = held_check

    def replica_processes() -> list[psutil.Process]:  # this set's (the module's fixture has its own)
        return [p for p in psutil.Process().children(recursive=True)
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                and "artrl.replicas.process" in (cmd := p.cmdline()) and str(tmp_path) in cmd]

    try:
        replicas.set_live_weights(str(tmp_path), 0)
        victim = replicas.replicas[0]
        first = victim.process
        first.kill()
        try:
            assert in_restart.wait(WAIT_S)
            restarted = victim.process
            assert restarted is not None and restarted is not first and not victim.in_service
            restarted.kill()  # killed during its own restart
            assert replicas.wait_for(lambda: victim.process is not restarted, WAIT_S)
        finally:
            proceed.set()
        assert replicas.wait_for(lambda: victim.in_service and not victim.restarting, WAIT_S)
        assert (victim.generation, victim.restarts) == (2, 2)
        assert [p.pid for p in replica_processes()] == [victim.process.pid]
        assert replicas.router.workers() == [victim.url]
        assert ReplicaClient(victim.url, "k").identity()["replica"] == victim.id == "r0.2"
    finally:
        replicas.close()
    assert replica_processes() == []
