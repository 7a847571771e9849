"""artrl's off-policy options and mismatch figures through the train call (backend.train, model.train).

The batch and the oracle are tests/test_train_call_update.py's: one group of two recorded turns whose sampled
logprobs are the policy's minus chosen log-ratios d (LOG_RATIOS), so the trainer/sampler ratio of every token,
and of each sequence, is known before the call: the figures a call reports are checked against them, and each
correction against the update without it on exactly on-policy data (d = 0).
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

import artrl as art
from artrl.errors import ConfigError
from artrl.run import storage
from artrl.train.trainer import Trainer
from artrl.models.loading import load_model
from artrl.train.call import run_call
from artrl.train.rl import prepare_rl
from artrl.config.model import InternalModelConfig
from artrl.types import TrainConfig
from offpolicy_rows import check_mismatch_row, pipelined_train_rows
from test_train_call_update import CASES, LOG_RATIOS, USER, check_call, live, spec  # noqa: F401 (live: fixture)

OFF_POLICY_OPTIONS = {"importance_sampling_correction", "off_policy_mask_threshold"}
ON_POLICY = tuple([0.0] * len(d) for d in LOG_RATIOS)
D = [x for d in LOG_RATIOS for x in d]  # the 9 tokens' trainer - sampled logprob
SUMS = [sum(d) for d in LOG_RATIOS]
MEANS = [sum(d) / len(d) for d in LOG_RATIOS]
TOL = dict(rel=1e-3, abs=1e-4)  # the trainer's packed forward against the oracle's plain one (seen: ~1e-6 in d)


@pytest.mark.parametrize("case", [c for c in CASES if set(CASES[c][0]) & OFF_POLICY_OPTIONS])
def test_each_correction_changes_nothing_on_on_policy_data(live, case):
    """Every ratio 1 (the record is the policy's own logprobs): the call with the option makes the update the
    oracle computes without it. (use_bias_correction_kl moves such an update by design: tests/test_offpolicy.py.)
    The record is the oracle's plain forward, the call's packed one differs by about a float32 ulp per token, so
    each weight is 1 within ~5e-7, not exactly 1: the loss figure is held to its terms' size (SUMMED there)."""
    check_call(live, CASES[case][0], spec(), {}, log_ratios=ON_POLICY)


def _expected(lo: float, hi: float) -> dict[str, float]:
    rho = [math.exp(x) for x in D]
    return {"offpolicy/sampler_kl": -sum(D) / 9, "offpolicy/sampler_kl_k3": sum(r - 1 - x for r, x in zip(rho, D)) / 9,
            "offpolicy/chi2_token": sum(r * r for r in rho) / 9 - 1,
            "offpolicy/chi2_sequence": sum(math.exp(2 * s) for s in SUMS) / 2 - 1,
            "offpolicy/ppl_ratio": sum(math.exp(-m) for m in MEANS) / 2,
            "offpolicy/token_above_max": sum(r > hi for r in rho) / 9,
            "offpolicy/token_below_min": sum(r < lo for r in rho) / 9,
            "offpolicy/sequence_above_max": sum(math.exp(s) > hi for s in SUMS) / 2,
            "offpolicy/sequence_below_min": sum(math.exp(s) < lo for s in SUMS) / 2,
            "offpolicy/geometric_above_max": sum(math.exp(m) > hi for m in MEANS) / 2,
            "offpolicy/geometric_below_min": sum(math.exp(m) < lo for m in MEANS) / 2,
            "offpolicy/clip_min": lo, "offpolicy/clip_max": hi, "offpolicy/mismatch_tokens": 9.0}


@pytest.mark.parametrize(("call", "bounds"), [
    ({}, (1 / 3, 3.0)),  # nothing set: measured at TRL's default bound and its inverse
    ({"importance_sampling_correction": "token_mask", "importance_sampling_clip_min": 0.6,
      "importance_sampling_clip_max": 2.0}, (0.6, 2.0)),
])
def test_a_calls_mismatch_figures_are_those_of_its_tokens(live, call, bounds):
    """The d of the batch: token ratios [1.42, 0.55, 1.05, 6.69, 0.64 | 0.74, 2.01, 0.30, 1.13], sequence
    ratios 3.49 and 0.51, geometric 1.28 and 0.84; each figure as train/offpolicy.py defines it. The shares are
    not all 0: 6.69 and 0.30 lie outside [1/3, 3], four tokens outside [0.6, 2]."""
    result = check_call(live, call, spec(**({"loss": dict(correction=_correction(call)), "precalculate": True}
                                            if call else {})), {})
    want = _expected(*bounds)
    assert {k: result.metrics[k] for k in want} == pytest.approx(want, **TOL)
    assert want["offpolicy/token_above_max"] > 0 and want["offpolicy/token_below_min"] > 0
    assert not any("/age" in k for k in result.metrics)  # no version recorded: no split


def _correction(call):
    from artrl.train.offpolicy import Correction

    return Correction(call["importance_sampling_correction"], call["importance_sampling_clip_min"],
                      call["importance_sampling_clip_max"])


def test_the_figures_split_by_policy_age_when_the_call_trains_two_versions(live):
    """The first trajectory's turn was sampled one version before the call's weights, the second by them: the
    row has each age's figures, over that trajectory's tokens."""
    start = live.checkpoints[live.step]
    batch = live.oracle.batch(start)
    groups = live.groups(batch)
    for trajectory, version in zip(groups[0].trajectories, (live.step - 1, live.step)):
        trajectory.messages_and_choices[-1].model_extra["policy_version"] = version
    result = live.train(groups, importance_sampling_correction="geometric_truncate",
                        importance_sampling_clip_max=1.1)
    for age, d in ((1, LOG_RATIOS[0]), (0, LOG_RATIOS[1])):
        assert result.metrics[f"offpolicy/age{age}/tokens"] == len(d)
        assert result.metrics[f"offpolicy/age{age}/sampler_kl"] == pytest.approx(-sum(d) / len(d), **TOL)
        assert result.metrics[f"offpolicy/age{age}/chi2_token"] == pytest.approx(
            sum(math.exp(2 * x) for x in d) / len(d) - 1, **TOL)
        assert result.metrics[f"offpolicy/age{age}/token_above_max"] == pytest.approx(
            sum(math.exp(x) > 1.1 for x in d) / len(d))


def test_model_train_takes_the_options_as_art_dev_train_config_and_logs_the_figures(live):
    """`_config=art.dev.TrainConfig(...)` reaches the loss (the bounds measured are the ones given) and the row
    that model.train writes (history.jsonl, hence W&B and TensorBoard) carries the offpolicy/ figures."""
    batch = live.oracle.batch(live.checkpoints[live.step])
    dev = art.dev.TrainConfig(importance_sampling_correction="sequence_mask", importance_sampling_clip_min=0.4,
                              importance_sampling_clip_max=4.0, off_policy_mask_threshold=0.1)
    asyncio.run(live.model.train(live.groups(batch), config=art.TrainConfig(learning_rate=1e-4), _config=dev))
    row = [r for r in storage.read_jsonl(live.model._run_dir() / storage.HISTORY_FILE)
           if r.get("split") == "train"][-1]
    assert (row["offpolicy/clip_min"], row["offpolicy/clip_max"]) == (0.4, 4.0)
    assert row["offpolicy/sampler_kl"] == pytest.approx(-sum(D) / 9, **TOL)
    # the second sequence: negative advantage, sampled - policy averages +0.17 > 0.1
    assert row["offpolicy/off_policy_masked_sequences"] == 0.5
    assert row["offpolicy/off_policy_masked_tokens"] == pytest.approx(4 / 9)


def test_a_refused_option_is_named_by_the_call(live):
    batch = live.oracle.batch(live.checkpoints[live.step])
    with pytest.raises(ConfigError, match="importance_sampling_clip_max=2.0 bounds the weights"):
        live.train(live.groups(batch), importance_sampling_clip_max=2.0)
    with pytest.raises(ConfigError, match="importance_sampling_correction='token_mask' contradicts loss='gspo'"):
        asyncio.run(live.model.train(live.groups(batch), _config=art.dev.TrainConfig(
            importance_sampling_correction="token_mask", loss="gspo")))


def test_a_correction_is_refused_on_a_call_without_sampled_logprobs(live):
    """A call none of whose trained tokens carries a sampled logprob would train as if the option were off."""
    batch = live.oracle.batch(live.checkpoints[live.step])
    for trajectory in (groups := live.groups(batch))[0].trajectories:
        trajectory.messages_and_choices[-1].logprobs = None  # turns without logprobs: trained as on-policy
    with pytest.raises(ConfigError, match=r"off_policy_mask_threshold=0.2 compares the trainer's logprobs with the "
                                          r"sampled ones, and none of this call's 9 trainable tokens"):
        live.train(groups, off_policy_mask_threshold=0.2)
    live.train(groups)  # without the option the call trains them, as on-policy


def test_a_call_of_several_steps_weighs_by_the_logprobs_of_its_starting_weights(tiny_path, make_choice):
    """In a call of two optimizer steps the loss's old logprobs are the trainer's at the call's start in both
    steps (recomputed before the first), and the sampled ones reach it as `original`; in a call of one step they
    are the first pass's own."""
    model, tok = load_model(str(tiny_path), InternalModelConfig(seed=0))
    trainer = Trainer(model, tok)
    groups = [art.TrajectoryGroup([art.Trajectory(messages_and_choices=[*USER, make_choice(c)], reward=r)
                                   for c, r in ((f"green {g}", 1.0), (f"pink {g}", 0.0))]) for g in range(2)]
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for per_step, steps in ((1, 2), (None, 1)):
        cfg = TrainConfig(learning_rate=5e-2, importance_sampling_correction="token_truncate",
                          groups_per_optimizer_step=per_step)
        call = prepare_rl(trainer.build_context(), groups, cfg)
        assert len(call.plan.steps) == steps and call.options.trainer_old_logprobs
        loss_fn = call.loss_fn

        def recording(tb, loss_fn=loss_fn):
            seen.append((tb.logprobs.detach().clone(), tb.old_logprobs.clone(), tb.original_logprobs.clone()))
            return loss_fn(tb)

        call.loss_fn = recording
        start = trainer.recompute_logprobs(call.packed, call.plan).logprobs[call.packed.trainable_mask]
        sampled = call.packed.logprobs[call.packed.trainable_mask]
        seen.clear()
        run_call(trainer, call, show_progress=False)
        old = torch.cat([o for _, o, _ in seen])
        assert torch.equal(torch.cat([s for _, _, s in seen]).cpu(), sampled)  # the record, as original
        if steps == 2:
            assert torch.allclose(old.cpu(), start, atol=1e-6)  # both steps: the call's starting weights
            assert not torch.allclose(seen[-1][0], seen[-1][1], atol=1e-4)  # the second step's weights moved
        else:
            assert torch.equal(old, torch.cat([n for n, _, _ in seen]))  # the first pass's own


@pytest.mark.parametrize(("train_kwargs", "bounds"), [
    ({}, (1 / 3, 3.0)),
    ({"importance_sampling_correction": "token_mask", "importance_sampling_clip_min": 0.5,
      "importance_sampling_clip_max": 2.0}, (0.5, 2.0)),
], ids=["none", "token_mask"])
def test_a_pipelined_runs_train_rows_carry_the_mismatch_figures(tmp_path, train_kwargs, bounds):
    """PipelineTrainer on LocalBackend (tests/test_pipeline_local.py's tiny run, staleness bound 2): every train row
    it writes has the call's offpolicy/ figures at the bounds the call measured, whatever is set; a call that
    trains only groups of the version it starts from measures no mismatch but float noise, one with stale groups
    (when the scheduling gives one) measures more; where a row splits by policy age, the ages' tokens add up to
    the call's."""
    from test_pipeline_local import open_model

    async def main() -> list[dict]:
        return await pipelined_train_rows(*await open_model(tmp_path), train_kwargs)

    rows = asyncio.run(main())
    assert rows
    for row in rows:  # fresh: every token sampled by the weights trained
        check_mismatch_row(row, bounds, fresh=row["train/staleness_max"] == 0, noise=1e-5, moved=1e-5)
