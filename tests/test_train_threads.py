"""A train call computes on the process's torch thread count, whichever thread runs it.

The decode worker sets its own count (inference_cpu_threads=1) from its thread; a thread that starts after
that takes the same count at its first parallel op (OpenMP). A train call runs in an `asyncio.to_thread`
worker, so without artrl/runtime/threads.py it could compute on one core while the process has more.
"""

from __future__ import annotations

import asyncio
import threading

import torch

import artrl as art
from artrl.runtime import threads

USER = {"role": "user", "content": "Pick a colour."}


def test_a_train_call_after_decoding_runs_on_the_process_thread_count(tmp_path, monkeypatch):
    before = torch.get_num_threads()
    process = before + 1  # a count neither the decode worker (1) nor this thread holds
    monkeypatch.setattr(threads, "_process_threads", process)
    backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
    model = art.TrainableModel(name="thr", project="p", base_model="artrl/tiny",
                               _internal_config=art.InternalModelConfig(max_length=128, inference_cpu_threads=1))
    seen: list[tuple[str, int]] = []  # (thread, torch threads) of each training forward

    def record(*_: object) -> None:
        if torch.is_grad_enabled():
            seen.append((threading.current_thread().name, torch.get_num_threads()))

    try:
        asyncio.run(model.register(backend))
        trained = backend._runs["thr"].trainer.model
        layer = next(m for name, m in trained.named_modules() if name.endswith("layers.0.mlp"))
        hook = layer.register_forward_hook(record)

        async def loop() -> art.TrainResult:
            client = model.openai_client()
            groups = []
            for g in range(2):
                trajectories = []
                for k in range(2):  # sampled by the decode worker, which sets its count first
                    reply = await client.chat.completions.create(
                        model=model.get_inference_name(), messages=[USER], max_tokens=3, temperature=1.0,
                        seed=10 * g + k)
                    trajectories.append(art.Trajectory(messages_and_choices=[USER, reply.choices[0]],
                                                       reward=float(k)))
                groups.append(art.TrajectoryGroup(trajectories))
            return await model.train(groups, config=art.TrainConfig(learning_rate=1e-4))

        result = asyncio.run(loop())
        hook.remove()
    finally:
        backend.close()
        torch.set_num_threads(before)  # the train call set the process-wide default to `process`
    assert result.metrics["data/step_trainer_tokens"] > 0  # the call trained (distinct rewards)
    assert seen, "no training forward ran"
    assert {count for _, count in seen} == {process}, seen
    assert all(name != threading.current_thread().name for name, _ in seen)  # it ran in a worker thread
