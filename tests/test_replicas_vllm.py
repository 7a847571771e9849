"""A vLLM replica and a built-in engine replica behind one router serve one run (vLLM's CPU build).

Two replica processes (replicas/process.py), one on each engine, given to the model as
`inference_endpoints`: rollouts reach both, every choice carries the same token record whichever
engine sampled it, a train call on rollouts from both publishes the new step on both, and the
trainer's logprobs of what each engine sampled stay close to the sampled ones."""

from __future__ import annotations

import asyncio
import json
import pathlib
import sys

import pytest

import artrl as art
from artrl.client import affinity
from artrl.replicas.client import ReplicaClient
from artrl.replicas.process import READY_PREFIX
from artrl.replicas.spawn import ChildProcess, child_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

KEY = "k-mixed"
START_S = 600.0


def test_a_vllm_replica_and_a_builtin_replica_serve_one_run(tmp_path: pathlib.Path, tiny_path: pathlib.Path) -> None:
    base = str(tiny_path)
    cfg = {"seed": 0, "max_length": 256, "device": "cpu"}
    env = child_env(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1")
    children = [ChildProcess(f"mixed-{engine}", [sys.executable, "-m", "artrl.replicas.process", "--base-model", base,
                                                 "--name", "agent", "--replica", engine, "--config", json.dumps(cfg),
                                                 "--engine", engine, "--api-key", KEY],
                             ready_prefix=READY_PREFIX.strip(), env=env).start() for engine in ("builtin", "vllm")]
    try:
        urls = [f"http://127.0.0.1:{child.wait_ready(START_S)['port']}" for child in children]
        engines = [ReplicaClient(url, KEY).identity()["engine"] for url in urls]
        assert engines == ["builtin", "vllm"]

        async def rollout(model: art.TrainableModel, k: int) -> tuple[str, art.Trajectory]:
            client = model.openai_client()
            messages = [{"role": "user", "content": f"Name a colour, {k}."}]
            raw = await client.chat.completions.with_raw_response.create(
                model=model.get_inference_name(), messages=messages, max_tokens=6, temperature=1.0)
            choice = raw.parse().choices[0]
            return raw.headers[affinity.REPLICA_HEADER], art.Trajectory(
                messages_and_choices=messages + [choice], reward=float(len(choice.message.content or "") % 3) + k / 100)

        async def main() -> None:
            backend = art.LocalBackend(path=str(tmp_path), api_key=KEY, show_progress=False)
            model = art.TrainableModel(name="agent", project="mixed", base_model=base,
                                       _internal_config=art.InternalModelConfig(
                                           seed=0, max_length=256, inference_endpoints=urls))
            await model.register(backend)
            async with asyncio.timeout(300):
                served = await asyncio.gather(*(rollout(model, k) for k in range(16)))
            assert {replica for replica, _ in served} == {"builtin", "vllm"}  # 16 sessions reach both
            for _, trajectory in served:
                extra = trajectory.messages_and_choices[-1].model_extra
                assert extra["token_ids"] and extra["prompt_token_ids"] and extra["policy_version"] == 0
            groups = [art.TrajectoryGroup([t for _, t in served[i:i + 4]]) for i in range(0, 16, 4)]
            result = await model.train(groups, config=art.TrainConfig(learning_rate=1e-3))
            assert result.step == 1 and result.metrics["train/sampled_logprob_delta_max"] < 1e-3, result.metrics
            for url in urls:  # published on both engines
                assert ReplicaClient(url, KEY).identity()["models"]["agent"]["live_step"] == 1
            async with asyncio.timeout(300):
                after = await asyncio.gather(*(rollout(model, 100 + k) for k in range(16)))
            assert {replica for replica, _ in after} == {"builtin", "vllm"}
            assert {t.messages_and_choices[-1].model_extra["policy_version"] for _, t in after} == {1}
            backend.close()

        asyncio.run(main())
    finally:
        for child in children:
            child.stop(timeout=60.0)
