"""How much Python one `model.train` call runs through before its first forward pass.

Two groups of two rollouts through the local server on the tiny model, one warm-up
train call, then a second call measured up to the first forward of the backbone:

* `stack_*`: the frames on the stack at that forward, from `model.train` down (the
  awaiting coroutines, then the worker thread's frames); `*_artrl` counts artrl's own;
* `calls_*`: every Python function call made in between, in any thread (`threading.setprofile`);
* `calls_by_function`: artrl's calls per function (validations, config checks, packing...).

Counts only, no timing; runs against whichever artrl is on the path, so it compares versions:

    PYTHONPATH=src python benchmarks/train_frames.py
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import sys
import tempfile
import threading
from typing import Any

import artrl as art


def _where(code: Any) -> str:
    path = code.co_filename
    path = path.split("site-packages/")[-1].split("/src/")[-1]
    return f"{path}:{code.co_name}"


async def measure() -> dict[str, Any]:
    model = art.TrainableModel(name="frames", project="bench", base_model="artrl/tiny")
    backend = art.LocalBackend(path=tempfile.mkdtemp(prefix="artrl-frames-"), show_progress=False)
    try:
        await model.register(backend)
        client = model.openai_client()
        groups = []
        for question in ("Name a colour.", "Name a fruit."):
            trajectories = []
            for seed in range(2):
                messages = [{"role": "user", "content": question}]
                reply = await client.chat.completions.create(model=model.get_inference_name(), messages=messages,
                                                             max_tokens=4, seed=seed)
                trajectories.append(art.Trajectory(messages_and_choices=[*messages, reply.choices[0]],
                                                   reward=float(seed)))
            groups.append(art.TrajectoryGroup(trajectories))
        config = art.TrainConfig(learning_rate=1e-5)
        await model.train(groups, config=config)  # warm-up: lazy imports and first-call caches

        session = backend._runs[model.name]
        inner = session.trainer.model.get_base_model()
        backbone = getattr(inner, inner.base_model_prefix)
        seen: dict[str, Any] = {}
        calls: dict[str, int] = {}
        task: dict[str, asyncio.Task] = {}

        def at_forward(module: Any, args: Any, kwargs: Any) -> None:
            if "stack" in seen:
                return
            frames, frame = [], sys._getframe(1)
            while frame is not None:
                frames.append(_where(frame.f_code))
                frame = frame.f_back
            seen["stack"] = frames[::-1]
            chain, coro = [], task["train"].get_coro()
            while coro is not None and hasattr(coro, "cr_frame"):
                if coro.cr_frame is not None:
                    chain.append(_where(coro.cr_frame.f_code))
                coro = coro.cr_await
            seen["coroutines"] = chain

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and "stack" not in seen:
                name = _where(frame.f_code)
                calls[name] = calls.get(name, 0) + 1

        hook = backbone.register_forward_pre_hook(at_forward, with_kwargs=True)
        asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor())  # profiled threads
        threading.setprofile(profile)
        sys.setprofile(profile)
        try:
            task["train"] = asyncio.ensure_future(model.train(groups, config=config))
            await task["train"]
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
            hook.remove()
    finally:
        backend.close()
    coroutines = seen["coroutines"][seen["coroutines"].index("artrl/model.py:train"):]
    stack = seen["stack"]
    thread = stack[next(i for i, s in enumerate(stack) if s.startswith("artrl/")):]
    frames = coroutines + thread
    own = {k: v for k, v in sorted(calls.items()) if k.startswith("artrl/")}
    return {"artrl": art.__file__, "stack_frames": len(frames),
            "stack_frames_artrl": sum(f.startswith("artrl/") for f in frames),
            "calls": sum(calls.values()), "calls_artrl": sum(own.values()), "stack": frames,
            "calls_by_function": own}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(measure()), indent=1))
