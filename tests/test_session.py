"""The training session: it owns its randomness, and restoring tells bad files from bugs."""

from __future__ import annotations

import asyncio
import random

import peft
import pytest
import torch

import artrl as art
from artrl.errors import CheckpointError
from artrl.models.loading import load_model
from artrl.train.trainer import Trainer

SFT_DATA = [art.Trajectory(messages_and_choices=[{"role": "user", "content": f"Say {w}."},
                                                 {"role": "assistant", "content": w}], reward=0.0)
            for w in ("red", "green", "blue", "yellow")]


async def _register(path, **internal):
    backend = art.LocalBackend(path=str(path), show_progress=False)
    model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny",
                               _internal_config=art.InternalModelConfig(max_length=128, **internal))
    await model.register(backend)
    return model, backend


def test_register_and_train_leave_the_process_rngs_alone(tmp_path):
    async def main():
        random.seed(7)
        torch.manual_seed(7)
        py, pt = random.getstate(), torch.get_rng_state()
        model, backend = await _register(tmp_path / "a", lora_dropout=0.1)
        await model.train_sft(SFT_DATA, config=art.TrainSFTConfig(learning_rate=1e-3, batch_size=2))
        backend.close()
        assert random.getstate() == py
        assert torch.equal(torch.get_rng_state(), pt)
        # and a resumed model (its trainer RNG restored from the checkpoint) leaves them alone too
        model, backend = await _register(tmp_path / "a", lora_dropout=0.1)
        await model.train_sft(SFT_DATA, config=art.TrainSFTConfig(learning_rate=1e-3, batch_size=2))
        backend.close()
        assert random.getstate() == py
        assert torch.equal(torch.get_rng_state(), pt)

    asyncio.run(main())


def test_two_trainers_draw_from_their_own_streams(tiny_path):
    cfg = art.InternalModelConfig(lora_dropout=0.3, seed=1)
    a = Trainer(*load_model(str(tiny_path), cfg), cfg)
    b = Trainer(*load_model(str(tiny_path), cfg), cfg)
    assert torch.equal(a.rng_state()["cpu"], b.rng_state()["cpu"])
    with b._own_rng():
        torch.rand(1000)  # b draws; a's stream must not move
    assert not torch.equal(a.rng_state()["cpu"], b.rng_state()["cpu"])
    c = Trainer(*load_model(str(tiny_path), cfg), cfg)
    assert torch.equal(a.rng_state()["cpu"], c.rng_state()["cpu"])


def test_a_bug_while_restoring_is_not_called_a_corrupt_checkpoint(tmp_path, monkeypatch):
    async def first():
        model, backend = await _register(tmp_path / "run")
        await model.train_sft(SFT_DATA, config=art.TrainSFTConfig(learning_rate=1e-3))
        backend.close()

    asyncio.run(first())

    def broken(*args, **kwargs):
        raise AttributeError("'LoraModel' object has no attribute 'simulated_api_change'")

    monkeypatch.setattr(peft, "set_peft_model_state_dict", broken)
    with pytest.raises(AttributeError, match="simulated_api_change") as info:
        asyncio.run(_register(tmp_path / "run"))
    assert not isinstance(info.value, CheckpointError)
    monkeypatch.undo()
    model, backend = asyncio.run(_register(tmp_path / "run"))  # the files were fine all along
    assert asyncio.run(model.get_step()) == 1
    backend.close()
