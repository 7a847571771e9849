"""Training engine on the tiny model: invariances (batch size, packing) and learning."""

from __future__ import annotations

import math

import pytest
import torch

from artrl.preprocess.pack import pack
from artrl.preprocess.plan import plan_batches
from artrl.trajectories.tokenization import tokenize_groups
from artrl.train.call import run_call
from artrl.train.trainer import Trainer
from artrl.models.loading import load_model
from artrl.train.rl import _rl_loss, prepare_rl
from artrl.train.sft import prepare_sft
from artrl.trajectories import Trajectory, TrajectoryGroup
from artrl.config.model import InternalModelConfig
from artrl.types import TrainConfig, TrainSFTConfig


@pytest.fixture()
def trainer(tiny_path):
    model, tok = load_model(str(tiny_path), InternalModelConfig(seed=0))
    return Trainer(model, tok)


def rl_groups(make_choice, n_groups=3, per_group=4):
    groups = []
    for g in range(n_groups):
        prompt = [{"role": "system", "content": "You answer arithmetic questions."},
                  {"role": "user", "content": f"What is {g} plus {g + 1}? Explain briefly."}]
        trajs = [Trajectory(messages_and_choices=prompt + [make_choice(f"It is {2 * g + 1}." + " yes" * (t + g))],
                            reward=float(t % 2) + 0.1 * t) for t in range(per_group)]
        groups.append(TrajectoryGroup(trajs))
    return groups


def grads_of(trainer, packed, plan):
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.accumulate(packed, plan.steps[0], lambda tb: _rl_loss(tb, config=TrainConfig()))
    out = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.optimizer.zero_grad(set_to_none=True)
    return out


def test_gradient_is_the_same_for_batch_size_1_and_4(trainer, make_choice):
    with torch.no_grad():  # lora_B starts at zero, which leaves every lora_A gradient zero: move it off zero
        gen = torch.Generator().manual_seed(0)
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    tok_res = tokenize_groups(rl_groups(make_choice, n_groups=6), trainer.tokenizer)
    packed = pack(tok_res.groups, row_length=128, max_length=trainer.max_length)
    assert packed.num_rows >= 4
    one = plan_batches(packed, per_device_train_batch_size=1, grad_accumulation_sequences=None)
    four = plan_batches(packed, per_device_train_batch_size=4, grad_accumulation_sequences=None)
    assert len(one.steps[0].micro_batches) == packed.num_rows
    assert len(four.steps[0].micro_batches) == math.ceil(packed.num_rows / 4)
    g1, g4 = grads_of(trainer, packed, one), grads_of(trainer, packed, four)
    assert all(g.norm() > 0 for g in g4.values())
    for name in g1:  # relative to each tensor's gradient (float32 summation order: seen < 1e-6)
        error = float((g1[name] - g4[name]).norm() / g4[name].norm())
        assert error < 1e-5, f"{name}: |g1 - g4| / |g4| = {error:.2e}"


def test_packed_logprobs_equal_logprobs_alone(trainer, make_choice):
    tok_res = tokenize_groups(rl_groups(make_choice), trainer.tokenizer)
    packed = pack(tok_res.groups, max_length=trainer.max_length)
    assert packed.num_rows < len(packed.sequences)  # several sequences per row, prompts shared
    tb = trainer.forward_tokens(packed.select(range(packed.num_rows)), grad=False)
    sel = packed.trainable_mask
    b, t = sel.nonzero(as_tuple=True)
    seq_ids = packed.sequence_ids[b, t]
    model = trainer.model
    for gid, seq in enumerate(packed.sequences):
        ids = torch.tensor([seq.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)  # [seq, vocab]
        pos = torch.tensor([i for i, m in enumerate(seq.trainable_mask) if m])
        alone = logp[pos - 1, ids[0, pos]]
        torch.testing.assert_close(tb.logprobs[seq_ids == gid], alone, rtol=0, atol=1e-5)


def test_forward_sees_configured_rows_and_token_budget(trainer, make_choice):
    calls = []
    hook = trainer.backbone.register_forward_hook(lambda m, args, kw, out: calls.append(tuple(kw["input_ids"].shape)),
                                                  with_kwargs=True)
    try:
        groups = rl_groups(make_choice, n_groups=6)
        cfg = TrainConfig(per_device_train_batch_size=3, grad_accumulation_sequences=None, row_length=128,
                          learning_rate=1e-4)
        call = prepare_rl(trainer.build_context(), groups, cfg)
        run_call(trainer, call, show_progress=False)
        n = call.packed.num_rows
        assert n >= 4
        assert [c[0] for c in calls] == [3] * (n // 3) + ([n % 3] if n % 3 else [])
        calls.clear()
        cfg = TrainConfig(max_tokens_per_microbatch=200, grad_accumulation_sequences=None, row_length=128,
                          learning_rate=1e-4)
        run_call(trainer, prepare_rl(trainer.build_context(), groups, cfg), show_progress=False)
        assert calls and all(r * w <= 200 for r, w in calls)
    finally:
        hook.remove()


def test_rl_step_moves_probability_towards_positive_advantage(trainer, make_choice):
    prompt = [{"role": "user", "content": "Pick a colour."}]
    good, bad = make_choice("blue"), make_choice("red")
    group = TrajectoryGroup([Trajectory(messages_and_choices=prompt + [good], reward=1.0),
                             Trajectory(messages_and_choices=prompt + [bad], reward=0.0)])
    packed = pack(tokenize_groups([group], trainer.tokenizer).groups, max_length=trainer.max_length)

    def seq_logp():
        tb = trainer.forward_tokens(packed.select(range(packed.num_rows)), grad=False)
        b, t = packed.trainable_mask.nonzero(as_tuple=True)
        ids = packed.sequence_ids[b, t]
        return [float(tb.logprobs[ids == i].sum()) for i in range(len(packed.sequences))]

    base_params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    lora_params = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    before = seq_logp()
    run_call(trainer, prepare_rl(trainer.build_context(), [group], TrainConfig(learning_rate=5e-3)), show_progress=False)
    after = seq_logp()
    adv = [s.advantage for s in packed.sequences]
    for a, b0, b1 in zip(adv, before, after):
        assert (b1 > b0) if a > 0 else (b1 < b0)
    for n, p in trainer.model.named_parameters():
        if p.requires_grad:
            assert not torch.equal(p, lora_params[n]) or "lora_A" in n  # B moves first from zero init
        else:
            assert torch.equal(p, base_params[n]), f"base weight {n} changed"
    assert any(not torch.equal(p, lora_params[n]) for n, p in trainer.model.named_parameters() if "lora_B" in n)


def test_sft_learns_a_small_set_and_reproduces_answers(trainer):
    pairs = [("Say red", "red red"), ("Say blue", "blue blue"), ("Say green", "green green"),
             ("Say pink", "pink pink")]
    trajs = [Trajectory(messages_and_choices=[{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                        reward=0.0) for q, a in pairs]
    losses = []
    for _ in range(40):
        _, avg = run_call(trainer, prepare_sft(trainer.build_context(), trajs, TrainSFTConfig(learning_rate=1e-2, batch_size=4)),
                          show_progress=False)
        losses.append(avg["loss"])
    assert losses[-1] < 0.2 * losses[0]
    tok = trainer.tokenizer
    model = trainer.model.eval()
    for q, a in pairs:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        inp = tok(ids, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(input_ids=inp, attention_mask=torch.ones_like(inp), max_new_tokens=8,
                                 do_sample=False)
        assert tok.decode(out[0, inp.shape[1]:], skip_special_tokens=True).strip() == a


def test_sft_learning_rate_list_needs_one_value_per_step(trainer):
    trajs = [Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                        reward=0.0) for _ in range(5)]
    from artrl.errors import ConfigError

    with pytest.raises(ConfigError, match="has 2 values but this call makes 3 optimizer steps"):
        prepare_sft(trainer.build_context(), trajs, TrainSFTConfig(learning_rate=[1e-3, 1e-3], batch_size=2))
    call = prepare_sft(trainer.build_context(), trajs, TrainSFTConfig(learning_rate=[1e-3, 2e-3, 3e-3], batch_size=2))
    steps, _ = run_call(trainer, call, show_progress=False)
    assert [s["learning_rate"] for s in steps] == [1e-3, 2e-3, 3e-3]


def test_non_finite_loss_refuses_the_step(trainer, make_choice):
    groups = rl_groups(make_choice, n_groups=1)
    call = prepare_rl(trainer.build_context(), groups, TrainConfig(learning_rate=1e-3))
    call.packed.advantages[call.packed.trainable_mask] = float("nan")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    steps, avg = run_call(trainer, call, show_progress=False)
    assert avg["skipped_nonfinite_steps"] == len(steps) >= 1
    for n, p in trainer.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, before[n])


@pytest.mark.parametrize("impl", ["sdpa", "eager", pytest.param("flex_attention", marks=pytest.mark.slow)])
def test_attention_implementations_agree_with_tree_attention(tiny_path, make_choice, impl):
    """The dense boolean mask, the additive float mask and the flex BlockMask (the GPU path,
    compiled here on CPU) give the same logprobs as the CPU default (per-node SDPA)."""
    groups = tokenize_groups(rl_groups(make_choice, n_groups=3), load_model(str(tiny_path))[1]).groups
    out = {}
    for name in ("artrl_tree", impl):
        model, tok = load_model(str(tiny_path), InternalModelConfig(attn_implementation=name))
        tr = Trainer(model, tok)
        assert tr.attn_implementation == name
        packed = pack(groups, max_length=tr.max_length)
        out[name] = tr.forward_tokens(packed.select(range(packed.num_rows)), grad=False).logprobs
    torch.testing.assert_close(out[impl], out["artrl_tree"], rtol=0, atol=2e-5)


def test_per_device_train_batch_size_default_follows_the_device(trainer, make_choice):
    cfg = TrainConfig()
    assert cfg.per_device_train_batch_size is None
    resolved = cfg.resolved_per_device_train_batch_size
    assert resolved("cpu") == 1 and resolved("cuda") == 2
    assert resolved("cuda", rows_per_step=1) == 1  # never more than a step holds
    assert TrainConfig(per_device_train_batch_size=3).resolved_per_device_train_batch_size("cpu") == 3  # explicit
    assert TrainSFTConfig().resolved_per_device_train_batch_size("cpu") == 1
    call = prepare_rl(trainer.build_context(), rl_groups(make_choice, n_groups=3, per_group=4),
                      TrainConfig(learning_rate=1e-3, row_length=64))
    assert trainer.device.type == "cpu" and call.packed.num_rows > 1
    assert call.plan.max_rows_per_micro_batch == 1 and call.plan.num_micro_batches == call.packed.num_rows
    two = prepare_rl(trainer.build_context(), rl_groups(make_choice, n_groups=3, per_group=4),
                     TrainConfig(learning_rate=1e-3, row_length=64, per_device_train_batch_size=2))
    assert two.plan.max_rows_per_micro_batch == 2


def test_a_moving_kl_reference_keeps_a_bounded_number_of_adapters_loaded(trainer, tmp_path):
    """A reference that moves each step (kl_penalty_step_lag) loads a new frozen adapter per call; the trainer keeps
    the newest REFERENCE_ADAPTERS and drops older ones, so a long run does not grow by an adapter a step."""
    from artrl.train.trainer import REFERENCE_ADAPTERS

    names = []
    for k in range(REFERENCE_ADAPTERS + 2):
        path = tmp_path / f"ref{k}"
        trainer.model.save_pretrained(str(path))  # the trained adapter, saved as a checkpoint would be
        names.append(f"kl_ref_{k}")
        trainer.load_reference_adapter(names[-1], str(path / "default") if (path / "default").exists() else str(path))
    loaded = [n for n in trainer.model.peft_config if n.startswith("kl_ref_")]
    assert loaded == names[-REFERENCE_ADAPTERS:]
    assert trainer.model.active_adapter == "default"  # the trained adapter stays active
    trainer.load_reference_adapter(names[-2], "unused: already loaded")  # a name already there: nothing loads
    assert [n for n in trainer.model.peft_config if n.startswith("kl_ref_")] == names[-REFERENCE_ADAPTERS:]
