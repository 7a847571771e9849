"""How far the trainer's logprob of a sampled token is from the sampled one, per compute dtype (docs/models.md).

For each setting: `artrl/tiny` through the public API (TrainableModel + LocalBackend), 2 groups x 4 trajectories
of 3 turns sampled through the local server (seeded requests, temperature 1.0, logprobs=True), then one
`model.train` call (learning rate 1e-6). Prints one JSON line per setting with the train call's
`train/sampled_logprob_delta_max` and `_mean` (over the step's sampled tokens) and what the process computed in,
as observed while it ran: the dtypes that reached bitsandbytes' 4-bit matmul, the model's weight dtype, and the
LM head's. Each setting runs in its own process, one after the other:

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/record_dtype_delta.py [--setting NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from typing import Any

SETTINGS: dict[str, dict[str, Any]] = {
    "float32": {"dtype": "float32", "load_in_4bit": False},
    "bfloat16": {"dtype": "bfloat16", "load_in_4bit": False},
    "4bit-default": {"load_in_4bit": True},
    "4bit-bfloat16": {"load_in_4bit": True, "dtype": "bfloat16"},
    "4bit-float32": {"load_in_4bit": True, "dtype": "float32"},
}
GROUPS, PER_GROUP, TURNS, MAX_TOKENS, LEARNING_RATE = 2, 4, 3, 16, 1e-6
COMMAND = "OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/record_dtype_delta.py --setting {}"


async def measure(name: str) -> dict[str, Any]:
    import artrl as art  # first: it quiets bitsandbytes' import notice
    import bitsandbytes
    import torch

    from artrl.models.quantization import fast_cpu_matmul, quantized_modules
    from artrl.train import logprobs

    seen: dict[str, set[str]] = {"4bit_matmul_input": set(), "lm_head_compute": set()}
    matmul_4bit, head = bitsandbytes.matmul_4bit, logprobs._head

    def record_matmul(x: torch.Tensor, *a: Any, **k: Any) -> Any:  # what Linear4bit.forward multiplies in
        seen["4bit_matmul_input"].add(str(x.dtype))
        return matmul_4bit(x, *a, **k)

    def record_head(hidden: torch.Tensor, weight: torch.Tensor, bias: Any) -> Any:  # _head's own test, live
        upcast = weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16) \
            and not fast_cpu_matmul(weight.dtype)
        seen["lm_head_compute"].add("float32 (upcast slices)" if upcast else str(weight.dtype))
        return head(hidden, weight, bias)

    bitsandbytes.matmul_4bit, logprobs._head = record_matmul, record_head
    cfg = art.InternalModelConfig(**SETTINGS[name])
    model = art.TrainableModel(name="delta", project="bench", base_model="artrl/tiny", _internal_config=cfg)
    backend = art.LocalBackend(path=tempfile.mkdtemp(), show_progress=False)
    await model.register(backend)
    try:
        client = model.openai_client()

        async def rollout(g: int, k: int) -> art.Trajectory:
            messages: list[Any] = [{"role": "system", "content": "Answer briefly."},
                                   {"role": "user", "content": f"Question {g}.{k}?"}]
            items: list[Any] = list(messages)
            for turn in range(TURNS):
                reply = await client.chat.completions.create(
                    model=model.get_inference_name(), messages=messages, max_tokens=MAX_TOKENS, temperature=1.0,
                    logprobs=True, seed=1000 * g + 100 * k + turn)
                choice = reply.choices[0]
                follow_up = {"role": "user", "content": f"And then {turn}?"}
                messages += [{"role": "assistant", "content": choice.message.content}, follow_up]
                items += [choice, follow_up]
            return art.Trajectory(messages_and_choices=items, reward=float(k))

        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(g, k) for k in range(PER_GROUP)) for g in range(GROUPS)), pbar_desc=None)
        result = await model.train(groups, config=art.TrainConfig(learning_rate=LEARNING_RATE))
        net = backend._runs["delta"].trainer.model
        layers = quantized_modules(net)
        weights = {str(p.dtype) for n, p in net.named_parameters() if "lora_" not in n and p.dtype.is_floating_point}
    finally:
        backend.close()
    m = result.metrics
    return {
        "bench": "record_dtype_delta", "setting": name, "command": COMMAND.format(name),
        "config": SETTINGS[name], "model": "artrl/tiny",
        "rollouts": f"{GROUPS} groups x {PER_GROUP} trajectories x {TURNS} turns, {MAX_TOKENS} tokens a turn",
        "sampled_logprob_delta_max": m.get("train/sampled_logprob_delta_max"),
        "sampled_logprob_delta_mean": m.get("train/sampled_logprob_delta_mean"),
        "sampled_logprob_tokens": m.get("train/sampled_logprob_tokens"),
        "ran": {"4bit_layers": len(layers),
                "4bit_layer_compute_dtype": sorted({str(x.compute_dtype) for _, x in layers}),
                "4bit_matmul_input_dtypes": sorted(seen["4bit_matmul_input"]),
                "other_weights_dtypes": sorted(weights),
                "lm_head_compute": sorted(seen["lm_head_compute"]),
                "cpu_fast_bf16_matmul": fast_cpu_matmul(torch.bfloat16)},
        "cpu": _cpu_name(), "torch": torch.__version__, "bitsandbytes": bitsandbytes.__version__,
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--setting", choices=list(SETTINGS), help="one setting in this process (default: each in turn, "
                   "each in its own process)")
    args = p.parse_args()
    if args.setting:
        print(json.dumps(asyncio.run(measure(args.setting))), flush=True)
        return
    for name in SETTINGS:  # one process at a time
        subprocess.run([sys.executable, __file__, "--setting", name], check=True)


if __name__ == "__main__":
    main()
