"""The whole loop through the HTTP server with the real openai client: rollouts, RL, SFT, resume."""

from __future__ import annotations

import asyncio
import logging
import json

import pytest
import torch

import artrl as art
from artrl.run import storage
from artrl.preprocess.pack import pack
from artrl.trajectories.tokenization import tokenize_groups

PROMPTS = ["Name a colour.", "Say a number."]


async def rollout(model, client, prompt, temperature=1.0):
    msgs = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": prompt}]
    resp = await client.chat.completions.create(model=model.get_inference_name(), messages=msgs, max_tokens=8,
                                                temperature=temperature, logprobs=True)
    choice = art.choice_from_completion(resp)
    return art.Trajectory(messages_and_choices=msgs + [choice], reward=float(len(choice.message.content or "") % 3))


def history(model_dir):
    return [json.loads(line) for line in (model_dir / storage.HISTORY_FILE).read_text().splitlines()]


def test_register_rollout_train_serve_resume(tmp_path):
    async def main():
        model = art.TrainableModel(name="agent-001", project="e2e", base_model="artrl/tiny")
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        await model.register(backend)
        run = storage.run_dir(tmp_path, "e2e", "agent-001")
        assert await model.get_step() == 0 and storage.list_checkpoints(run) == [0]
        client = model.openai_client()

        groups = await art.gather_trajectory_groups(
            (art.TrajectoryGroup(rollout(model, client, p) for _ in range(4)) for p in PROMPTS), pbar_desc=None)
        assert all(len(g.trajectories) == 4 for g in groups)

        # sampled logprobs from the server equal the trainer's logprobs of the same tokens (tokens in, tokens out)
        state = backend._runs["agent-001"]
        tok = tokenize_groups(groups, state.trainer.tokenizer, scale_rewards=False)
        assert tok.stats.retokenized_turns == 0
        packed = pack(tok.groups, max_length=state.trainer.max_length)
        tb = state.trainer.forward_tokens(packed.select(range(packed.num_rows)), grad=False)
        assert tb.logprobs.numel() > 0
        torch.testing.assert_close(tb.logprobs, tb.old_logprobs, rtol=0, atol=1e-4)

        probe = [{"role": "user", "content": "Name a colour."}]
        before = await client.chat.completions.create(model=model.get_inference_name(), messages=probe,
                                                      max_tokens=4, temperature=0, logprobs=True)

        result = await model.train(groups, config=art.TrainConfig(learning_rate=5e-3))
        assert result.step == 1 and await model.get_step() == 1
        assert storage.is_complete(storage.checkpoint_dir(run, 1))
        assert result.metrics["data/step_trainer_tokens"] > 0 and result.metrics["data/rows"] >= 1

        after = await client.chat.completions.create(model=model.get_inference_name(), messages=probe,
                                                     max_tokens=4, temperature=0, logprobs=True)
        lp_before = [t.logprob for t in before.choices[0].logprobs.content]
        lp_after = [t.logprob for t in after.choices[0].logprobs.content]
        assert lp_before != lp_after, "the server must answer with the new weights after train returns"
        old = await client.chat.completions.create(model=model.get_inference_name(0), messages=probe,
                                                   max_tokens=4, temperature=0, logprobs=True)
        assert [t.logprob for t in old.choices[0].logprobs.content] == pytest.approx(lp_before, abs=1e-5)

        sft = [art.Trajectory(messages_and_choices=[{"role": "user", "content": "Name a colour."},
                                                    {"role": "assistant", "content": "blue"}], reward=0.0)]
        result = await model.train_sft(sft, config=art.TrainSFTConfig(learning_rate=1e-3))
        assert result.step == 2
        await model.log(groups, split="val")
        backend.close()

        hist = history(run)
        # one train row per step (rl, then sft), written at the step the call produced, as ART does
        assert [(h["step"], h["split"], h.get("kind")) for h in hist] == [(1, "train", "rl"), (2, "train", "sft"),
                                                                         (2, "val", None)]
        assert hist[0]["train/reward"] == pytest.approx(sum(t.reward for g in groups for t in g) / 8)
        assert "loss/train" in hist[0] and "loss/train" in hist[1] and "val/reward" in hist[2]
        assert hist[0]["data/step_num_groups_submitted"] == 2

        model2 = art.TrainableModel(name="agent-001", project="e2e", base_model="artrl/tiny")
        backend2 = art.LocalBackend(path=str(tmp_path), show_progress=False)
        await model2.register(backend2)
        assert await model2.get_step() == 2
        again = await model2.openai_client().chat.completions.create(
            model=model2.get_inference_name(), messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=4, temperature=0, logprobs=True)
        ref = await model2.openai_client().chat.completions.create(
            model=model2.get_inference_name(2), messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=4, temperature=0, logprobs=True)
        assert [t.logprob for t in again.choices[0].logprobs.content] == pytest.approx(
            [t.logprob for t in ref.choices[0].logprobs.content], abs=1e-5)
        backend2.close()

    asyncio.run(main())


def test_delete_checkpoints_keeps_latest_and_best(tmp_path):
    async def main():
        model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny")
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        await model.register(backend)
        run = storage.run_dir(tmp_path, "p", "m")
        sft = [art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"},
                                                    {"role": "assistant", "content": "a"}], reward=0.0)]
        for vals in [[0.1], [0.9, 0.1], [0.3]]:  # steps 1, 2, 3; step 2 logs two rows (mean 0.5, as ART)
            await model.train_sft(sft, config=art.TrainSFTConfig(learning_rate=1e-4))
            for val in vals:
                await model.log(metrics={"reward": val}, split="val")
        assert storage.list_checkpoints(run) == [0, 1, 2, 3]
        deleted = await model.delete_checkpoints()
        assert deleted == [0, 1] and storage.list_checkpoints(run) == [2, 3]
        # a missing metric keeps only the latest, never deletes the last checkpoint
        assert await model.delete_checkpoints("val/nope") == [2]
        assert storage.list_checkpoints(run) == [3]
        assert await model.delete_checkpoints() == []
        backend.close()

    asyncio.run(main())


def test_checkpoint_from_another_base_model_is_refused(tmp_path):
    async def main():
        run = storage.run_dir(tmp_path, "p", "m")
        run.mkdir(parents=True)
        storage.write_json_atomic(run / storage.MODEL_FILE, {"base_model": "Qwen/Qwen3-8B"})
        model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny")
        with pytest.raises(art.CheckpointError, match="belongs to base model 'Qwen/Qwen3-8B'"):
            await model.register(art.LocalBackend(path=str(tmp_path)))

    asyncio.run(main())


def test_delete_checkpoints_warns_once_per_run_about_a_missing_metric(tmp_path, caplog):
    """A loop calls delete_checkpoints every step; the 'no logged step has val/reward' warning came every step."""
    async def main():
        model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny")
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        await model.register(backend)
        sft = [art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"},
                                                    {"role": "assistant", "content": "a"}], reward=0.0)]
        with caplog.at_level(logging.WARNING, logger="artrl"):
            for _ in range(3):
                await model.train_sft(sft, config=art.TrainSFTConfig(learning_rate=1e-4))
                await model.delete_checkpoints()
        backend.close()

    asyncio.run(main())
    warned = [r for r in caplog.records if "no logged step has 'val/reward'" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in warned]
