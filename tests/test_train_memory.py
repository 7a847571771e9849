"""Device memory: the micro-batch token budget, and a train call that runs out of memory half-way.

No GPU here: the out-of-memory error is injected (torch.OutOfMemoryError raised from the trainer's forward
on the Nth pass) into a real `model.train_sft` / `model.train` call through LocalBackend on the tiny model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import artrl as art
from artrl.errors import ArtrlError, TrainOutOfMemoryError
from artrl.run import storage
from artrl.train import memory
from artrl.train.call import run_call
from artrl.train.totals import StepTotals
from artrl.train.trainer import Trainer

QWEN3_06B = SimpleNamespace(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                            head_dim=128, num_hidden_layers=28, vocab_size=151936)

SFT = [art.Trajectory(messages_and_choices=[{"role": "user", "content": f"Say {w}."},
                                            {"role": "assistant", "content": f"{w} and {w} and {w}"}], reward=0.0)
       for w in ("red", "blue", "green", "pink", "gold", "grey")]
PROBE = [{"role": "user", "content": "Say red."}]


# ----------------------------------------------------------------------------------------------- estimates

def test_the_per_token_estimate_errs_high_of_the_measured_peak_and_checkpointing_divides_it():
    without = memory.bytes_per_token(QWEN3_06B, torch.bfloat16, checkpointing=False)
    with_ = memory.bytes_per_token(QWEN3_06B, torch.bfloat16, checkpointing=True)
    # an H200 run measured 59.5 GB for 32,768 tokens of this shape without checkpointing (1.8 MB per token)
    assert 1.8e6 <= without <= 3.0e6
    assert with_ * 10 < without


@pytest.mark.parametrize("longest", [100, 5_000, 60_000, 400_000])
def test_the_budget_never_drops_a_sequence_and_checkpoints_only_when_needed(longest):
    budget = memory.budget_for(QWEN3_06B, torch.bfloat16, 1024, free=40 * 2**30)
    assert budget.tokens % memory.BUDGET_MULTIPLE == 0 and budget.tokens < budget.tokens_checkpointed
    tokens, on = budget.choose(longest, checkpointing=None)
    assert tokens >= longest  # what is trained never depends on the memory
    assert on == (longest > budget.tokens)
    assert tokens == max(budget.tokens_checkpointed if on else budget.tokens, longest)
    # a setting the user made is kept
    assert budget.choose(longest, checkpointing=False)[1] is False
    assert budget.choose(longest, checkpointing=True) == (max(budget.tokens_checkpointed, longest), True)


def test_the_budget_cuts_micro_batches_but_not_what_a_call_trains(tok):
    from artrl.train.sft import prepare_sft
    from artrl.train.trainer import BuildContext

    base = BuildContext(tokenizer=tok, end_ids=frozenset({tok.convert_tokens_to_ids("<|im_end|>")}),
                        max_length=4096, pad_id=0, device_type="cuda", optimizer_steps=0)
    small = memory.MemoryBudget(tokens=32, tokens_checkpointed=64, free_bytes=1)
    cfg = art.TrainSFTConfig(learning_rate=1e-3, batch_size=6)
    plain = prepare_sft(base, SFT, cfg)
    budgeted = prepare_sft(dataclasses.replace(base, memory_budget=small), SFT, cfg)
    assert plain.plan is not None and budgeted.plan is not None
    assert budgeted.plan.max_tokens_per_microbatch is not None
    assert all(mb.tokens <= budgeted.plan.max_tokens_per_microbatch for s in budgeted.plan.steps
               for mb in s.micro_batches)
    # the same tokens are trained, with the same step structure
    assert [s.trainable_tokens for s in budgeted.plan.steps] == [s.trainable_tokens for s in plain.plan.steps]
    assert budgeted.built.stats.dropped == plain.built.stats.dropped == 0
    # an explicit setting wins over the memory
    explicit = prepare_sft(dataclasses.replace(base, memory_budget=small), SFT,
                           art.TrainSFTConfig(learning_rate=1e-3, batch_size=6, per_device_train_batch_size=3))
    assert explicit.plan.max_tokens_per_microbatch is None and explicit.plan.per_device_train_batch_size == 3


def test_out_of_memory_errors_are_told_apart():
    assert memory.is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert memory.is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not memory.is_out_of_memory(RuntimeError("shape mismatch"))
    assert not memory.is_out_of_memory(ValueError("out of memory"))


def test_step_totals_add_on_the_device_and_read_once():
    t = StepTotals()
    t.add("loss", torch.tensor(1.5))
    t.add("loss", torch.tensor(2.0))
    t.add("loss", 0.5)
    t.add("delta_max", torch.tensor(0.25))
    t.add("delta_max", torch.tensor(0.75))
    t.add("delta_max", 0.5)
    assert t._pending  # nothing read yet
    assert t["loss"] == pytest.approx(4.0) and t["delta_max"] == pytest.approx(0.75)
    assert not t._pending and sorted(t) == sorted(t.as_dict())


# ----------------------------------------------------------------------------------------------- out of memory

def _files(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _adapter(backend: art.LocalBackend) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(backend._runs["m"].trainer.model).items()}


async def _register(path: Path) -> tuple[art.TrainableModel, art.LocalBackend]:
    # LoRA dropout draws from the trainer's RNG: a state not put back changes the next call's masks
    model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny",
                               _internal_config=art.InternalModelConfig(lora_dropout=0.1))
    backend = art.LocalBackend(path=str(path), show_progress=False)
    await model.register(backend)
    return model, backend


async def _reply(model: art.TrainableModel) -> list[float]:
    client = model.openai_client()
    resp = await client.chat.completions.create(model=model.get_inference_name(), messages=PROBE, max_tokens=6,
                                                temperature=0, logprobs=True)
    return [t.logprob for t in resp.choices[0].logprobs.content]


def _oom_on_pass(monkeypatch: pytest.MonkeyPatch, n: int) -> list[int]:
    """Make the trainer's Nth forward pass with gradients (counted from now) raise a CUDA out-of-memory error."""
    real = Trainer.forward_tokens
    seen = [0]

    def forward_tokens(self, mb, *, grad=True, **kw):
        if grad:
            seen[0] += 1
            if seen[0] == n:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB (injected)")
        return real(self, mb, grad=grad, **kw)

    monkeypatch.setattr(Trainer, "forward_tokens", forward_tokens)
    return seen


CFG = dict(learning_rate=5e-3, batch_size=2, per_device_train_batch_size=1)  # 3 optimizer steps


def test_an_oom_mid_call_leaves_checkpoint_history_and_served_model_untouched(tmp_path, monkeypatch):
    async def main():
        model, backend = await _register(tmp_path / "run")
        await model.train_sft(SFT[:2], config=art.TrainSFTConfig(learning_rate=5e-3))  # step 1, a real checkpoint
        run = storage.run_dir(tmp_path / "run", "p", "m")
        trainer = backend._runs["m"].trainer
        files, history = _files(run / storage.CHECKPOINTS_DIR), (run / storage.HISTORY_FILE).read_text()
        adapter, reply = _adapter(backend), await _reply(model)
        opt_steps, moments = trainer.optimizer_steps, {
            k: {n: v.clone() for n, v in s.items()} for k, s in trainer.optimizer.state_dict()["state"].items()}

        seen = _oom_on_pass(monkeypatch, 3)  # the call's third pass: after its first optimizer steps
        with pytest.raises(TrainOutOfMemoryError) as info:
            await model.train_sft(SFT, config=art.TrainSFTConfig(**CFG))
        assert seen[0] == 3 and isinstance(info.value, ArtrlError)
        message = str(info.value)
        assert "max_tokens_per_microbatch" in message and "per_device_train_batch_size" in message
        assert "gradient_checkpointing=True" in message and "unchanged" in message
        assert isinstance(info.value.__cause__, torch.OutOfMemoryError)

        assert await model.get_step() == 1
        assert _files(run / storage.CHECKPOINTS_DIR) == files
        assert (run / storage.HISTORY_FILE).read_text() == history
        after = _adapter(backend)
        assert after.keys() == adapter.keys()
        for k in adapter:
            torch.testing.assert_close(after[k], adapter[k], rtol=0, atol=0)
        assert trainer.optimizer_steps == opt_steps
        state = trainer.optimizer.state_dict()["state"]
        assert state.keys() == moments.keys()
        for k in moments:
            for name, value in moments[k].items():
                torch.testing.assert_close(state[k][name], value, rtol=0, atol=0)
        assert all(p.grad is None for p in trainer.params)
        assert await _reply(model) == reply

        monkeypatch.undo()
        result = await model.train_sft(SFT, config=art.TrainSFTConfig(**CFG))  # the next call works
        assert result.step == 2
        done = _adapter(backend)
        backend.close()
        return adapter, done, result.metrics["loss/train"]

    async def control():  # the same two calls, without the out-of-memory error in between
        model, backend = await _register(tmp_path / "control")
        await model.train_sft(SFT[:2], config=art.TrainSFTConfig(learning_rate=5e-3))
        before = _adapter(backend)
        result = await model.train_sft(SFT, config=art.TrainSFTConfig(**CFG))
        done = _adapter(backend)
        backend.close()
        return before, done, result.metrics["loss/train"]

    before, recovered, loss = asyncio.run(main())
    want_before, expected, want_loss = asyncio.run(control())
    # The rolled-back call changed nothing the next call depends on (weights, AdamW moments and step, the step
    # count that seeds the SFT shuffle, the RNG of the dropout masks): its update is the control's. Not bit for
    # bit: inference between calls (the replies above) moves later float32 CPU kernels by ~1e-7 even without a
    # failed call, and AdamW magnifies that where a gradient is near zero; a state not put back changes the
    # update by a large part of itself.
    assert loss == pytest.approx(want_loss, rel=1e-5)
    got = torch.cat([(recovered[k] - before[k]).flatten() for k in sorted(expected)])
    want = torch.cat([(expected[k] - want_before[k]).flatten() for k in sorted(expected)])
    assert torch.linalg.vector_norm(got - want) <= 1e-3 * torch.linalg.vector_norm(want)


def test_other_errors_pass_through_unchanged(tmp_path, monkeypatch):
    async def main():
        model, backend = await _register(tmp_path)

        def broken(self, *a, **kw):
            raise RuntimeError("a bug, not the memory")

        monkeypatch.setattr(Trainer, "forward_tokens", broken)
        with pytest.raises(RuntimeError, match="a bug, not the memory") as info:
            await model.train_sft(SFT[:2], config=art.TrainSFTConfig(learning_rate=1e-3))
        assert not isinstance(info.value, TrainOutOfMemoryError)
        backend.close()

    asyncio.run(main())


def test_a_call_turns_checkpointing_on_only_for_itself(tiny_path):
    from artrl.preprocess.plan import BatchPlan
    from artrl.train.memory import checkpointing_on
    from artrl.models.loading import load_model

    model, tok = load_model(str(tiny_path))  # loaded without checkpointing
    inner = model.get_base_model()
    assert not checkpointing_on(inner)
    trainer = Trainer(model, tok, art.InternalModelConfig(gradient_checkpointing=True))
    with trainer.call_memory(inner, BatchPlan()):
        assert checkpointing_on(inner)
    assert not checkpointing_on(inner)  # put back after the call
    auto = Trainer(model, tok, art.InternalModelConfig())  # None on a CPU: left as it is
    with auto.call_memory(inner, BatchPlan()):
        assert not checkpointing_on(inner)


def test_on_a_cpu_a_call_checkpoints_only_when_the_host_would_not_hold_it_without(tiny_path, make_choice,
                                                                                    monkeypatch):
    """gradient_checkpointing=None on a CPU: a call whose largest micro-batch would not fit the host's available
    memory without checkpointing turns it on for itself (train/memory.py); the usual call leaves it off."""
    from artrl.models import memory_plan
    from artrl.models.loading import load_model
    from artrl.train.memory import checkpointing_on
    from artrl.train.rl import prepare_rl

    model, tok = load_model(str(tiny_path))
    inner = model.get_base_model()
    trainer = Trainer(model, tok, art.InternalModelConfig())
    seen: list[bool] = []
    hook = trainer.backbone.register_forward_hook(lambda *a: seen.append(checkpointing_on(inner)))
    prompt = [{"role": "user", "content": "Pick a colour."}]
    # rows longer than the smallest token budget (train/memory.BUDGET_MULTIPLE, 256)
    group = art.TrajectoryGroup([art.Trajectory(messages_and_choices=prompt + [make_choice(c)], reward=r)
                                 for c, r in (("blue " * 300, 1.0), ("red " * 300, 0.0))])
    call = prepare_rl(trainer.build_context(), [group], art.TrainConfig(learning_rate=1e-4))
    try:
        run_call(trainer, call, show_progress=False)
        assert seen and not any(seen)  # plenty of host memory: off
        seen.clear()
        assert max(mb.tokens for step in call.plan.steps for mb in step.micro_batches) > memory.BUDGET_MULTIPLE
        # a host with room for it only with checkpointing (with none at all, the call is refused: test_long_context)
        largest = max(mb.tokens for step in call.plan.steps for mb in step.micro_batches)
        per = memory.bytes_per_token(trainer.model_config, trainer.dtype, checkpointing=True)
        room = memory.head_bytes(trainer.model_config, trainer.cfg.logprob_chunk_size) + 2 * largest * per
        monkeypatch.setattr(memory_plan, "host_available_bytes", lambda: int(room / memory.MEMORY_FRACTION))
        budget = trainer.memory_budget(host=True)
        assert budget.tokens < largest <= budget.tokens_checkpointed
        run_call(trainer, call, show_progress=False)
        assert seen and all(seen)
    finally:
        hook.remove()
    assert not checkpointing_on(inner)  # put back after the call
