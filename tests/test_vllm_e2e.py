"""ART's loop with vLLM serving the rollouts (inference_engine="vllm", vLLM's CPU build).

The same loop as tests/test_e2e.py and tests/test_token_record.py, through the HTTP server
and the real openai client: rollouts, two RL steps and one SFT call; after a train call the
served model's greedy replies are the new checkpoint's (a transformers + peft forward of it)
while `name@step` still serves the old weights and the base model's name the base weights;
a restart resumes from the latest checkpoint and serves it, and multi-turn, tool-calling
rollouts after it train on exactly the tokens vLLM sampled (`train/sampled_logprob_delta_max`).
"""

from __future__ import annotations

import asyncio
import pathlib
from typing import Any

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

import artrl as art
from artrl.run import storage

from offpolicy_rows import check_mismatch_row, pipelined_train_rows
from test_token_record import CALL, SYSTEM, TOOLS, check_record, rank_rewards, rollout as tool_rollout

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VLLM = {"inference_engine": "vllm"}
PROMPTS = ["Name a colour.", "Say a number."]
PROBE = [{"role": "user", "content": "Name a colour."}]


async def rollout(model: art.TrainableModel, client: Any, prompt: str) -> art.Trajectory:
    messages = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": prompt}]
    response = await client.chat.completions.create(model=model.get_inference_name(), messages=messages,
                                                    max_tokens=8, temperature=1.0)
    choice = response.choices[0]
    return art.Trajectory(messages_and_choices=messages + [choice], reward=float(len(choice.message.content or "") % 3))


CORRECTION = {"importance_sampling_correction": "token_mask", "importance_sampling_clip_min": 0.5,
              "importance_sampling_clip_max": 2.0}
# vLLM's CPU build against the trainer, both float32: |KL| under this on fresh groups; k3 over this on stale ones
VLLM_NOISE = {"noise": 1e-4, "moved": 1e-6}


def weights(tiny_path: pathlib.Path, checkpoint: pathlib.Path | None) -> Any:
    base = AutoModelForCausalLM.from_pretrained(str(tiny_path), dtype=torch.float32)
    return (PeftModel.from_pretrained(base, str(checkpoint)) if checkpoint is not None else base).eval()


def reference(model: Any, prompt: list[int], sampled: list[int]) -> tuple[list[int], list[float]]:
    """(greedy ids for as many steps as `sampled`, raw logprobs of `sampled`) from a plain forward."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in sampled:
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        logits = model(input_ids=torch.tensor([prompt + sampled])).logits[0].float()  # [seq, vocab]
    logprobs = logits[len(prompt) - 1 : -1].log_softmax(-1)[torch.arange(len(sampled)), torch.tensor(sampled)]
    return ids[len(prompt):], logprobs.tolist()


async def probe(model: art.TrainableModel, name: str) -> tuple[list[int], list[int], list[float]]:
    response = await model.openai_client().chat.completions.create(model=name, messages=PROBE, max_tokens=6,
                                                                   temperature=0)
    choice = response.choices[0]
    return (response.model_extra["prompt_token_ids"], choice.model_extra["token_ids"],
            [t.logprob for t in choice.logprobs.content])


def served_by(model: Any, answer: tuple[list[int], list[int], list[float]]) -> bool:
    """Whether `answer` (a greedy reply) is what `model` answers: the same ids and logprobs."""
    prompt, sampled, logprobs = answer
    greedy, expected = reference(model, prompt, sampled)
    return greedy == sampled and max(abs(a - b) for a, b in zip(logprobs, expected)) < 1e-4


def test_the_loop_on_vllm_rollouts_rl_sft_a_restart_and_tool_calls(tmp_path: pathlib.Path,
                                                                    tiny_path: pathlib.Path) -> None:
    """One run, two sessions (each starts vLLM once: the CI time of the vLLM tests is bounded)."""
    run = storage.run_dir(tmp_path, "vllm", "agent")

    async def first_session() -> None:
        model = art.TrainableModel(name="agent", project="vllm", base_model=str(tiny_path), _internal_config=VLLM)
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        try:
            await model.register(backend)
            session = backend._runs["agent"]
            assert type(session.engine).__name__ == "VLLMEngine"
            client = model.openai_client()
            for step in range(2):
                groups = await art.gather_trajectory_groups(
                    (art.TrajectoryGroup(rollout(model, client, p) for _ in range(4)) for p in PROMPTS),
                    pbar_desc=None)
                before = await probe(model, model.get_inference_name())
                # the second call with an off-policy correction (docs/off-policy.md): accepted on vLLM's rollouts
                dev = art.dev.TrainConfig(**CORRECTION) if step else art.dev.TrainConfig()
                result = await model.train(groups, config=art.TrainConfig(learning_rate=5e-3), _config=dev)
                assert result.step == step + 1 and storage.is_complete(storage.checkpoint_dir(run, step + 1))
                # vLLM sampled what the trainer computes: the call measured every sampled token
                assert result.metrics["train/sampled_logprob_delta_max"] < 1e-3, result.metrics
                row = [r for r in storage.read_jsonl(run / storage.HISTORY_FILE) if r.get("split") == "train"][-1]
                check_mismatch_row(row, (0.5, 2.0) if step else (1 / 3, 3.0), fresh=True, **VLLM_NOISE)
                after = await probe(model, model.get_inference_name())
                assert after[2] != before[2], "the live name serves the new checkpoint once train returns"
                assert served_by(weights(tiny_path, storage.checkpoint_dir(run, step + 1)), after)
                old = await probe(model, model.get_inference_name(step))  # name@step: the old weights
                assert old[1] == before[1] and old[2] == pytest.approx(before[2], abs=1e-5)
            base = await probe(model, str(tiny_path))
            assert served_by(weights(tiny_path, None), base)  # the base model's name: no adapter
            sft = [art.Trajectory(messages_and_choices=[*PROBE, {"role": "assistant", "content": "blue"}],
                                  reward=0.0)]
            result = await model.train_sft(sft, config=art.TrainSFTConfig(learning_rate=1e-3))
            assert result.step == 3
            assert served_by(weights(tiny_path, storage.checkpoint_dir(run, 3)),
                             await probe(model, model.get_inference_name()))
        finally:
            backend.close()

    async def restarted() -> None:
        """The restart resumes at step 3 and serves it; the loop goes on with multi-turn, tool-calling rollouts,
        which train on exactly the tokens vLLM sampled (test_token_record.check_record)."""
        model = art.TrainableModel(name="agent", project="vllm", base_model=str(tiny_path), _internal_config=VLLM)
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        try:
            await model.register(backend)
            assert await model.get_step() == 3
            live = await probe(model, model.get_inference_name())
            assert served_by(weights(tiny_path, storage.checkpoint_dir(run, 3)), live)
            assert (await probe(model, model.get_inference_name(3)))[1] == live[1]

            lesson = art.Trajectory(messages_and_choices=[SYSTEM, {"role": "user", "content": "Add 1 and 2."},
                                                          {"role": "assistant", "content": CALL}],
                                    tools=TOOLS, reward=0.0)
            await model.train_sft([lesson] * 30, config=art.TrainSFTConfig(learning_rate=1e-2, batch_size=1))
            client = model.openai_client()
            groups = await art.gather_trajectory_groups(
                (art.TrajectoryGroup(tool_rollout(model, client, task, member, turns=4) for member in range(3))
                 for task in (1, 2)), pbar_desc=None)
            rank_rewards(groups)
            calls = sum(bool(m.message.tool_calls) for g in groups for t in g for m in t.messages_and_choices
                        if not isinstance(m, dict))
            assert calls > 0  # the rollouts are tool-calling ones
            honest = await check_record(model, groups)
            assert honest["train/sampled_logprob_delta_max"] < 1e-3
        finally:
            backend.close()

    asyncio.run(first_session())
    asyncio.run(restarted())


def test_4bit_weights_on_vllms_cpu_build_are_one_clear_error_at_register(tmp_path: pathlib.Path,
                                                                          tiny_path: pathlib.Path) -> None:
    """vLLM's CPU build cannot serve bitsandbytes weights: registering says so (naming the ways out) before vLLM
    starts, and the run directory is left as it was."""

    async def main() -> None:
        model = art.TrainableModel(name="agent", project="vllm4", base_model=str(tiny_path),
                                   _internal_config={**VLLM, "load_in_4bit": True})
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        with pytest.raises(art.ConfigError, match="CPU build has no bitsandbytes") as e:
            await model.register(backend)
        assert "inference_engine='builtin'" in str(e.value)
        backend.close()

    asyncio.run(main())
    assert not storage.run_dir(tmp_path, "vllm4", "agent").exists()


def test_a_mixture_of_experts_model_on_vllms_cpu_build_is_one_clear_error_at_register(tmp_path: pathlib.Path) -> None:
    """vLLM's CPU build has no Triton for a mixture-of-experts model's LoRA kernels: registering says so."""
    from artrl.models.tiny import TINY_MOE_NAME, tiny_model_path

    async def main() -> None:
        model = art.TrainableModel(name="agent", project="vllm-moe", base_model=str(tiny_model_path(name=TINY_MOE_NAME)),
                                   _internal_config=VLLM)
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        with pytest.raises(art.ConfigError, match="inference_engine='builtin'"):
            await model.register(backend)
        backend.close()

    asyncio.run(main())
    assert not storage.run_dir(tmp_path, "vllm-moe", "agent").exists()


def test_a_pipelined_run_on_vllm_writes_the_mismatch_figures_in_every_train_row(tmp_path: pathlib.Path,
                                                                                  tiny_path: pathlib.Path) -> None:
    """PipelineTrainer with vLLM serving (tests/test_pipeline_local.py's tiny run, staleness bound 2, a correction
    on every call): each train row has the call's offpolicy/ figures at the correction's bounds; a call of groups
    all sampled by the weights it starts from measures float noise, a stale one more."""

    async def main() -> list[dict]:
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        model = art.TrainableModel(name="eq", project="p", base_model=str(tiny_path),
                                   _internal_config={**VLLM, "seed": 0, "max_length": 128})
        await model.register(backend)
        assert type(backend._runs["eq"].engine).__name__ == "VLLMEngine"
        return await pipelined_train_rows(backend, model, CORRECTION)

    rows = asyncio.run(main())
    assert rows
    for row in rows:
        check_mismatch_row(row, (0.5, 2.0), fresh=row["train/staleness_max"] == 0, **VLLM_NOISE)
