"""What each train option does to one update, checked through `backend.train` against an independent computation.

ART's options are easy to accept and drop on the way to the loss; tests/test_loss_art_options.py checks the loss
function itself, this file checks that a train call's keywords reach it (and the optimizer). Each case makes ONE
train call on one group of two short trajectories, recorded as our server records them (prompt ids, sampled ids,
logprobs), with rewards 1 and 0: advantages +1 and -1 (population std 0.5). Each token's sampled logprob is the
policy's own logprob minus a chosen log-ratio d_t, so the importance ratios are exp(d_t), chosen outside every
clip range the options name:

    d = [0.35, -0.6, 0.05, 1.9, -0.45] (first trajectory), [-0.3, 0.7, -1.2, 0.12] (second)
    r = [1.42,  0.55, 1.05, 6.69, 0.64],                   [0.74, 2.01, 0.30, 1.13]

so ART's CISPO bounds [0, 5] clip one token, PPO's [0.8, 1.2] clip seven, and every ratio cap and mask bites.
The same d are the trainer/sampler log-ratios artrl's off-policy corrections read (train/offpolicy.py): the
sequences' sums are 1.25 and -0.68 (product ratios 3.49 and 0.51), their means 0.25 and -0.17 (geometric ratios
1.28 and 0.84), and sampled - policy averages -0.25 and +0.17 (the second sequence, of negative advantage, is the
one an off-policy sequence mask at 0.1 drops). On exactly on-policy data (every d 0) each correction must give
the update without it.

The expectation is computed without artrl's trainer: the checkpoint the call starts from is loaded with
transformers and peft, each trajectory goes through its own unpacked forward pass, `policy_loss` gets the
option as the loss function's own arguments (written out literally in the table below), then backward,
gradient clipping and one AdamW step from the checkpoint's optimizer state. The call must give the expected
loss, gradient norm, ratio and clip figures and write the expected adapter; and for every case the
expectation WITHOUT the option differs from the one with it by far more than the tolerance, so a call that
drops the option fails here.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from openai.types.chat.chat_completion import Choice
from peft import PeftModel, get_peft_model_state_dict, set_peft_model_state_dict
from peft.utils import load_peft_weights
from transformers import AutoModelForCausalLM, AutoTokenizer

import artrl as art
from artrl.metrics_taxonomy import TRAINER_TO_ART
# The internals this file reads, in one place: the loss function (the expectation's arithmetic), and the key of
# the optimizer state in a checkpoint's optimizer file (the AdamW state the call starts from).
from artrl.run.checkpoint import OPTIMIZER_KEY
from artrl.run.storage import OPTIMIZER_FILE
from artrl.train.loss import policy_loss
from artrl.train.offpolicy import Correction

USER = [{"role": "system", "content": "Answer with a colour."}, {"role": "user", "content": "Pick a colour."}]
ANSWERS = ("blue like the sky", "green grass")  # 5 and 4 sampled ids with the end of turn
REWARDS = (1.0, 0.0)
LOG_RATIOS = ([0.35, -0.6, 0.05, 1.9, -0.45], [-0.3, 0.7, -1.2, 0.12])
LR = 1e-3  # every call's learning rate unless the case sets one: large enough that the update is far above rounding

# ART's loss defaults (art/loss.py), literally: CISPO clips its detached weight to [1 - 1, 1 + 4], PPO to [0.8, 1.2]
CISPO = dict(kind="cispo", epsilon=1.0, epsilon_high=4.0)
PPO = dict(kind="ppo", epsilon=0.2, epsilon_high=0.2)
ADAM = dict(lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0, max_grad_norm=1.0)  # TrainConfig's defaults

RTOL = 1e-4  # call vs expectation (float32; packed tree attention vs one plain forward per sequence; seen: < 3e-6)
# The loss and policy_loss figures are sums of per-token terms that can nearly cancel (advantages +1 and -1): the
# call's forward differs from the oracle's by about one float32 ulp per logprob (~1e-6 at |logprob| ~ 8), an
# error of each TERM, so these two figures are held to RTOL of their terms' mean magnitude, not of their sum. Seen
# (tests/test_offpolicy_call.py, geometric_truncate on on-policy data, one torch thread, the call where training
# has brought the two sequences' sums to -33.7 and +33.5): weights exp(mean_t l_t) = 1 + 1.9e-7 and 1 - 4.8e-7
# from ulp-sized l_t, loss 0.0205903 against 0.0205877, 1.2e-4 of the loss but 3.4e-7 of the terms' 7.4.
SUMMED = ("loss", "policy_loss")
UPDATE_RTOL = 1e-4  # |actual - expected adapter| / |expected update| (seen: < 1.5e-6)
BITES = 20  # an option must move the expectation by at least this many tolerances


@dataclass
class Spec:
    """One expected computation: the loss function's arguments and what feeds them."""

    loss: dict[str, Any] = field(default_factory=lambda: dict(CISPO))
    advantages: tuple[float, float] | None = None  # None: +1, -1 (rewards 1, 0 scaled by the group std)
    precalculate: bool = False  # old logprobs := the policy's own, the sampled ones kept as `original`
    ref: str | None = None  # "base" (adapter off) or a checkpoint directory
    adam: dict[str, Any] = field(default_factory=lambda: dict(ADAM))
    trained: tuple[int, ...] = (0, 1)  # the trajectories whose turn is trained


def spec(loss: dict[str, Any] | None = None, **kw: Any) -> Spec:
    s = Spec(**kw)
    if loss is not None:
        s.loss = {**CISPO, **loss}
    return s


@contextlib.contextmanager
def one_thread():
    """torch on one thread while the oracle computes: a few-token forward is then milliseconds, where a loaded
    2-core machine makes torch's thread pool spin for seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class Oracle:
    """The update a call should make, computed with transformers + peft + torch only."""

    def __init__(self, base_path: str) -> None:
        self.tok = AutoTokenizer.from_pretrained(base_path)
        self.base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
        self.model: Any = None

    def load(self, checkpoint: str) -> None:
        if self.model is None:
            self.model = PeftModel.from_pretrained(self.base, checkpoint, is_trainable=True)
        else:
            set_peft_model_state_dict(self.model, load_peft_weights(checkpoint))
        self.model.train()

    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def adapter(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model).items()}

    def logprobs(self, prompt: list[int], sampled: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + sampled])  # [1, seq]
        logp = torch.log_softmax(self.model(input_ids=ids).logits[0, :-1].float(), -1)  # [seq - 1, vocab]
        pos = torch.arange(len(prompt) - 1, ids.shape[1] - 1)  # [sampled]: the positions that predict them
        return logp[pos, ids[0, pos + 1]]  # [sampled]

    def batch(self, checkpoint: str, log_ratios: tuple[list[float], ...] = LOG_RATIOS) \
            -> tuple[list[int], list[list[int]], list[list[float]]]:
        """The recorded turns: prompt ids, sampled ids, and sampled logprobs = policy logprob - d."""
        self.load(checkpoint)
        prompt = self.tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=True, return_dict=False)
        sampled = [self.tok(a + "<|im_end|>", add_special_tokens=False).input_ids for a in ANSWERS]
        out = []
        with torch.no_grad():
            for ids, d in zip(sampled, log_ratios):
                assert len(ids) == len(d), (ids, d)
                out.append((self.logprobs(prompt, ids) - torch.tensor(d)).tolist())
        return list(prompt), sampled, out

    def expect(self, checkpoint: str, batch: tuple, s: Spec) -> dict[str, Any]:
        """Loss figures, gradient norm and the adapter after one AdamW step, for spec `s`."""
        prompt, sampled, lps = batch
        sampled, lps = [sampled[i] for i in s.trained], [lps[i] for i in s.trained]
        self.load(checkpoint)
        self.model.zero_grad(set_to_none=True)
        adv = [(s.advantages or (0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6)))[i] for i in s.trained]
        ref = None
        if s.ref is not None:  # first: a reference checkpoint is swapped in and out of the same weights
            with torch.no_grad():
                ref = torch.cat([self._ref_logprobs(s.ref, prompt, ids) for ids in sampled])  # [n]
        new = torch.cat([self.logprobs(prompt, ids) for ids in sampled])  # [n]
        n = [len(ids) for ids in sampled]
        seq = torch.tensor([i for i, k in enumerate(n) for _ in range(k)])  # [n]
        advantages = torch.tensor([adv[i] for i in seq.tolist()])  # [n]
        sampled_lp = torch.tensor([x for lp in lps for x in lp])  # [n], nan: no sampled logprob (on-policy)
        old, original = (new.detach(), sampled_lp) if s.precalculate else (sampled_lp, None)
        unit = torch.ones_like(new, requires_grad=True)  # [n]: loss_sum's derivative by it is each token's term
        terms = policy_loss(new, old, advantages, unit, seq, torch.zeros_like(new), ref=ref,
                            original=original, **s.loss)
        per_token = torch.autograd.grad(terms.loss_sum, unit, retain_graph=True)[0]  # [n]
        (terms.loss_sum / terms.weight_sum).backward()
        adam = dict(s.adam)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params(), adam.pop("max_grad_norm") or math.inf))
        opt = torch.optim.AdamW(self.params(), **adam)
        state = torch.load(f"{checkpoint}/{OPTIMIZER_FILE}", weights_only=False)[OPTIMIZER_KEY]
        assert len(state["param_groups"][0]["params"]) == len(self.params())
        opt.load_state_dict(state)
        for g in opt.param_groups:
            g.update(adam)
        opt.step()
        w = terms.weight_sum
        return {"loss": float(terms.loss_sum.detach()) / w, "grad_norm": grad_norm, "mean_ratio": terms.ratio_sum / w,
                "clip_fraction": terms.clipped_tokens / w, "policy_loss": terms.policy_sum / w,
                "kl": terms.kl_sum / w, "kl_policy_ref": terms.kl_ref_sum / w, "learning_rate": adam["lr"],
                "term_scale": float(per_token.abs().sum()) / w,
                "adapter": self.adapter()}

    def _ref_logprobs(self, ref: str, prompt: list[int], ids: list[int]) -> torch.Tensor:
        if ref == "base":
            with self.model.disable_adapter():
                return self.logprobs(prompt, ids)
        own = self.adapter()
        set_peft_model_state_dict(self.model, load_peft_weights(ref))
        try:
            return self.logprobs(prompt, ids)
        finally:
            set_peft_model_state_dict(self.model, own)


def _choice(ids: list[int], prompt: list[int], logprobs: list[float], tok: Any) -> Choice:
    """A turn as our server returns it (docs/token-record.md): sampled ids, aligned logprobs, the prompt ids."""
    return Choice.model_validate({
        "index": 0, "finish_reason": "stop",
        "message": {"role": "assistant", "content": tok.decode(ids[:-1])},
        "logprobs": {"content": [{"token": tok.decode([i]), "logprob": lp, "bytes": None, "top_logprobs": []}
                                 for i, lp in zip(ids, logprobs)]},
        "token_ids": ids, "prompt_token_ids": prompt})


class Live:
    """A registered model, the checkpoints it wrote, and the oracle that predicts its next update."""

    def __init__(self, backend: Any, model: Any, oracle: Oracle) -> None:
        self.backend, self.model, self.oracle = backend, model, oracle
        self.checkpoints: dict[int, str] = {}  # step -> checkpoint directory, from each call's result

    @property
    def step(self) -> int:
        return max(self.checkpoints)

    def groups(self, batch: tuple, dict_answer: bool = False) -> list[art.TrajectoryGroup]:
        """The batch as trajectories; `dict_answer`: the second one's answer is a plain assistant message."""
        prompt, sampled, lps = batch
        turns = [_choice(ids, prompt, lp, self.oracle.tok) for ids, lp in zip(sampled, lps)]
        if dict_answer:
            turns[1] = {"role": "assistant", "content": ANSWERS[1]}
        return [art.TrajectoryGroup([art.Trajectory(messages_and_choices=[*USER, turn], reward=r)
                                     for turn, r in zip(turns, REWARDS)])]

    def train(self, groups: list[art.TrajectoryGroup], **kwargs: Any) -> art.LocalTrainResult:
        result = asyncio.run(self.backend.train(self.model, groups, **{"learning_rate": LR, **kwargs}))
        assert result.checkpoint_path is not None
        self.checkpoints[result.step] = result.checkpoint_path
        return result


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_path, make_choice):
    backend = art.LocalBackend(path=str(tmp_path_factory.mktemp("options")), show_progress=False)
    model = art.TrainableModel(name="opt", project="p", base_model="artrl/tiny",
                               _internal_config=art.InternalModelConfig(max_length=128))
    asyncio.run(model.register(backend))
    it = Live(backend, model, Oracle(str(tiny_path)))
    # move the adapter away from the base model (where every KL is 0) with data of its own: two checkpoints
    warm = [art.TrajectoryGroup([art.Trajectory(messages_and_choices=[*USER, make_choice(c)], reward=r)
                                 for c, r in (("green", 1.0), ("pink", 0.0))])]
    for _ in range(2):
        it.train(warm, learning_rate=5e-3)
    yield it
    backend.close()


def metric(result: Any, name: str) -> float:
    """A figure of the call under its history name (ART's `loss/...` where ART has one, else `train/...`)."""
    return result.metrics[TRAINER_TO_ART.get(name, f"train/{name}")]


FIGURES = ("loss", "grad_norm", "mean_ratio", "clip_fraction", "policy_loss", "learning_rate")
REF_FIGURES = ("kl", "kl_policy_ref")  # reported when the call computes reference logprobs


def _update_distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) \
        -> float:
    """|a - b| relative to how far b moved from `before`."""
    diff = sum(float((a[k] - b[k]).pow(2).sum()) for k in b) ** 0.5
    moved = sum(float((b[k] - before[k]).pow(2).sum()) for k in b) ** 0.5
    assert moved > 0
    return diff / moved


def _scale(want: dict[str, Any], name: str) -> float:
    """What figure `name`'s error is relative to: its terms' mean magnitude for a SUMMED one, else 0 (itself)."""
    return want["term_scale"] if name in SUMMED else 0.0


def _separation(want: dict[str, Any], other: dict[str, Any], before: dict[str, torch.Tensor]) -> float:
    """How far `other` is from `want`, in tolerances: the largest of the figures' and the update's."""
    figures = [abs(other[k] - want[k]) / (RTOL * max(abs(want[k]), _scale(want, k), 1e-3))
               for k in FIGURES + REF_FIGURES]
    return max(*figures, _update_distance(other["adapter"], want["adapter"], before) / UPDATE_RTOL)


def check_call(live: Live, call: dict[str, Any], want: Spec, without: dict[str, Spec], *,
               dict_answer: bool = False, log_ratios: tuple[list[float], ...] = LOG_RATIOS) -> art.LocalTrainResult:
    """Train one call with keywords `call` on the hand-made batch and compare it with the expectation `want`.

    `without` names, for each keyword under test, what the call would compute if that keyword were dropped on
    the way; each must be far (BITES tolerances) from `want`, so this check fails for a call that drops it.
    `dict_answer`: the second trajectory answers with an assistant message instead of a sampled turn;
    `log_ratios`: each token's policy - sampled logprob (LOG_RATIOS unless given).
    """
    start = live.checkpoints[live.step]
    with one_thread():
        batch = live.oracle.batch(start, log_ratios)
        if dict_answer:  # no sampled logprobs: trained, if at all, as on-policy
            batch = (batch[0], batch[1], [batch[2][0], [math.nan] * len(batch[1][1])])
        before = live.oracle.adapter()
        expected = live.oracle.expect(start, batch, want)
        for option, spec_without in without.items():
            other = live.oracle.expect(start, batch, spec_without)
            assert _separation(expected, other, before) > BITES, f"{option} does not change this batch's update"
    result = live.train(live.groups(batch, dict_answer), **call)
    assert result.metrics["data/step_trainer_tokens"] == sum(len(LOG_RATIOS[i]) for i in want.trained)
    for name in FIGURES + (REF_FIGURES if want.ref else ()):
        assert metric(result, name) == pytest.approx(expected[name], rel=RTOL,
                                                     abs=max(1e-6, RTOL * _scale(expected, name))), name
    written = load_peft_weights(result.checkpoint_path)
    distance = _update_distance({k: written[k] for k in expected["adapter"]}, expected["adapter"], before)
    assert distance < UPDATE_RTOL, f"the adapter written is {distance:.2e} of the update away from the expected one"
    return result


# Advantages of the batch: rewards 1 and 0, minus the mean, over the population std 0.5 (+ ART's 1e-6)
SCALED = (0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6))
# advantage_balance=0.5 on the unscaled (0.5, -0.5): the negative one halves, (0.5, -0.25), then both are scaled
# back to the mean |A| per token before (5 and 4 tokens): 0.5 / ((5 * 0.5 + 4 * 0.25) / 9) = 9 / 7
BALANCED = (0.5 * 9 / 7, -0.25 * 9 / 7)



def bounds(lo: float | None, hi: float | None) -> dict[str, float]:
    """The clip keywords of a correction case, those given."""
    return {k: v for k, v in (("importance_sampling_clip_min", lo), ("importance_sampling_clip_max", hi))
            if v is not None}


# One call per row: its keywords, what it must compute, and for each keyword what it would compute without it.
CASES: dict[str, tuple[dict[str, Any], Spec, dict[str, Spec]]] = {
    "defaults": (
        {}, spec(),
        {"ART's CISPO clip bounds": spec(dict(epsilon=0.2, epsilon_high=0.2))}),
    "ppo, epsilon, epsilon_high, mask_prob_ratio": (
        {"ppo": True, "epsilon": 0.5, "epsilon_high": 0.3, "mask_prob_ratio": True},
        spec(dict(PPO, epsilon=0.5, epsilon_high=0.3, mask_prob_ratio=True)),
        {"ppo": spec(dict(epsilon=0.5, epsilon_high=0.3, mask_prob_ratio=True)),
         "epsilon": spec(dict(PPO, epsilon_high=0.3, mask_prob_ratio=True)),
         "epsilon_high": spec(dict(PPO, epsilon=0.5, epsilon_high=0.5, mask_prob_ratio=True)),  # PPO: = epsilon
         "mask_prob_ratio": spec(dict(PPO, epsilon=0.5, epsilon_high=0.3))}),
    "epsilon, epsilon_high (CISPO)": (
        {"epsilon": 0.5, "epsilon_high": 0.3}, spec(dict(epsilon=0.5, epsilon_high=0.3)),
        {"epsilon": spec(dict(epsilon_high=0.3)), "epsilon_high": spec(dict(epsilon=0.5))}),
    "importance_sampling_level=sequence, max_negative_advantage_importance_sampling_weight, kimi_k2_tau": (
        {"importance_sampling_level": "sequence", "max_negative_advantage_importance_sampling_weight": 1.1,
         "kimi_k2_tau": 0.5},
        spec(dict(importance_sampling_level="sequence", max_ratio=1.1, kimi_k2_tau=0.5)),
        {"importance_sampling_level": spec(dict(max_ratio=1.1, kimi_k2_tau=0.5)),
         "max_negative_advantage_importance_sampling_weight": spec(dict(importance_sampling_level="sequence",
                                                                        kimi_k2_tau=0.5)),
         "kimi_k2_tau": spec(dict(importance_sampling_level="sequence", max_ratio=1.1))}),
    # ART 0.5.23: without precalculate_logprobs there is no trainer/sampler ratio, so truncated importance sampling
    # is skipped (one notice); the update is importance_sampling_level's alone
    "importance_sampling_level=average, truncated_importance_sampling skipped": (
        {"importance_sampling_level": "average", "truncated_importance_sampling": 1.2},
        spec(dict(importance_sampling_level="average")),
        {"importance_sampling_level": spec()}),
    "importance_sampling_level=geometric_average, scale_rewards, advantage_balance": (
        {"importance_sampling_level": "geometric_average", "scale_rewards": False, "advantage_balance": 0.5},
        spec(dict(importance_sampling_level="geometric_average"), advantages=BALANCED),
        {"importance_sampling_level": spec(advantages=BALANCED),
         "scale_rewards": spec(dict(importance_sampling_level="geometric_average"),
                               advantages=(SCALED[0] * 9 / 7, SCALED[1] / 2 * 9 / 7)),
         "advantage_balance": spec(dict(importance_sampling_level="geometric_average"), advantages=(0.5, -0.5))}),
    "precalculate_logprobs, truncated_importance_sampling": (
        {"precalculate_logprobs": True, "truncated_importance_sampling": 1.2},
        spec(dict(truncated_importance_sampling=1.2), precalculate=True),
        {"precalculate_logprobs": spec(dict(truncated_importance_sampling=1.2)),
         "truncated_importance_sampling": spec(precalculate=True)}),
    # artrl's off-policy corrections: the loss's old logprobs become the trainer's own (a one-step call's first
    # pass: the oracle's precalculate), the sampled ones weigh each token through the bounded ratio
    **{f"importance_sampling_correction={mode}, clip bounds {lo}, {hi}": (
        {"importance_sampling_correction": mode, **bounds(lo, hi)},
        spec(dict(correction=Correction(mode, lo, hi or 3.0)), precalculate=True),
        {"importance_sampling_correction": spec(),
         **({"importance_sampling_clip_min": spec(dict(correction=Correction(mode, None, hi or 3.0)), precalculate=True)}
            if lo is not None else {}),
         **({"importance_sampling_clip_max": spec(dict(correction=Correction(mode, lo, 3.0)), precalculate=True)}
            if hi is not None else {})})
       # each bound given bites on this batch (a mask's bounds one sequence each: both would mask everything)
       for mode, lo, hi in (("token_truncate", 0.6, 2.0), ("token_mask", 0.6, 2.0), ("sequence_truncate", 0.6, 2.5),
                            ("sequence_mask", None, 4.0), ("geometric_truncate", 0.9, 1.2),
                            ("geometric_mask", 0.9, None))},
    # ART's truncated_importance_sampling=c with precalculate_logprobs is token_truncate with clip_max c
    "importance_sampling_correction=token_truncate is ART's truncated importance sampling": (
        {"importance_sampling_correction": "token_truncate", "importance_sampling_clip_max": 1.2},
        spec(dict(truncated_importance_sampling=1.2), precalculate=True),
        {"importance_sampling_correction": spec()}),
    "off_policy_mask_threshold": (
        {"off_policy_mask_threshold": 0.1}, spec(dict(correction=Correction(mask_threshold=0.1))),
        {"off_policy_mask_threshold": spec()}),
    "use_bias_correction_kl": (
        {"use_bias_correction_kl": True, "beta": 0.5},
        spec(dict(beta=0.5, correction=Correction(bias_correction_kl=True)), ref="base"),
        {"use_bias_correction_kl": spec(dict(beta=0.5), ref="base")}),
    "learning_rate, num_trajectories_learning_rate_multiplier_power, optimizer settings": (
        {"learning_rate": 3e-4, "num_trajectories_learning_rate_multiplier_power": 1.0, "max_grad_norm": 3.0,
         "weight_decay": 2.0, "adam_beta1": 0.5, "adam_beta2": 0.9, "adam_epsilon": 1e-3},
        spec(adam=dict(lr=6e-4, betas=(0.5, 0.9), eps=1e-3, weight_decay=2.0, max_grad_norm=3.0)),  # 2 sequences
        {"learning_rate": spec(adam=dict(lr=LR * 2, betas=(0.5, 0.9), eps=1e-3, weight_decay=2.0, max_grad_norm=3.0)),
         "num_trajectories_learning_rate_multiplier_power": spec(adam=dict(lr=3e-4, betas=(0.5, 0.9), eps=1e-3,
                                                                           weight_decay=2.0, max_grad_norm=3.0)),
         "max_grad_norm": spec(adam=dict(lr=6e-4, betas=(0.5, 0.9), eps=1e-3, weight_decay=2.0, max_grad_norm=1.0)),
         "weight_decay": spec(adam=dict(lr=6e-4, betas=(0.5, 0.9), eps=1e-3, weight_decay=0.0, max_grad_norm=3.0)),
         "adam_beta1": spec(adam=dict(lr=6e-4, betas=(0.9, 0.9), eps=1e-3, weight_decay=2.0, max_grad_norm=3.0)),
         "adam_beta2": spec(adam=dict(lr=6e-4, betas=(0.5, 0.99), eps=1e-3, weight_decay=2.0, max_grad_norm=3.0)),
         "adam_epsilon": spec(adam=dict(lr=6e-4, betas=(0.5, 0.9), eps=1e-8, weight_decay=2.0, max_grad_norm=3.0))}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_option_reaches_the_update_as_it_says(live, case):
    call, want, without = CASES[case]
    check_call(live, call, want, without)


@pytest.mark.parametrize("loss", ["ppo", "gspo"])
def test_other_losses_and_kl_run(live, loss):
    """`loss=` picks PPO's clipped surrogate or GSPO's sequence ratio (ART's PPO bounds), and `beta` adds the k3
    term against the base model; the call's `kl` figure is that term's mean."""
    shape = dict(PPO, kind=loss)
    result = check_call(live, {"loss": loss, "beta": 0.5}, spec(dict(shape, beta=0.5), ref="base"),
                        {"loss": spec(dict(beta=0.5), ref="base"), "beta": spec(shape)})
    assert metric(result, "kl") > 1e-4


def test_kl_penalty_changes_the_update_and_beta_is_a_separate_knob(live):
    """ART's kl_penalty_coef shifts each token's advantage by coef * (step mean KL - token KL) against the base
    model; it adds no loss term (`kl` stays 0, `kl_policy_ref` reports the drift). `beta` is artrl's k3 loss
    term, a knob of its own; kl_penalty_reference_step and kl_ref_adapter_path name the reference checkpoint."""
    # one row per trajectory, one row per forward pass: the KL mean is the optimizer step's, not a pass's
    layout = {"row_length": 32, "share_prompts": False, "per_device_train_batch_size": 1}
    result = check_call(live, {"kl_penalty_coef": 2.0, **layout}, spec(dict(kl_penalty_coef=2.0), ref="base"),
                        {"kl_penalty_coef": spec()})
    assert result.metrics["train/micro_batches"] == 2
    assert metric(result, "kl") == 0.0 and metric(result, "kl_policy_ref") > 1e-3
    both = dict(kl_penalty_coef=2.0, beta=0.5)
    ref = live.step - 1  # the checkpoint before the current one: the adapter has moved since
    result = check_call(live, {**both, "kl_penalty_reference_step": ref},
                        spec(both, ref=live.checkpoints[ref]),
                        {"kl_penalty_coef": spec(dict(beta=0.5), ref=live.checkpoints[ref]),
                         "beta": spec(dict(kl_penalty_coef=2.0), ref=live.checkpoints[ref]),
                         "kl_penalty_reference_step": spec(both, ref="base")})
    assert metric(result, "kl") > 0.0
    path = live.checkpoints[ref]  # an adapter directory wins over the reference step (ART's precedence)
    check_call(live, {**both, "kl_ref_adapter_path": path, "kl_penalty_reference_step": live.step},
               spec(both, ref=path),
               {"kl_ref_adapter_path": spec(both, ref=live.checkpoints[live.step])})


def test_kl_penalty_source_and_step_lag(live):
    """ART 0.5.23: kl_penalty_source="sample" shapes the advantages by the rollout policy's drift from the
    reference (old - ref) instead of the learner's; kl_penalty_step_lag makes the reference the checkpoint that
    many steps back."""
    result = check_call(live, {"kl_penalty_coef": 2.0, "kl_penalty_source": "sample"},
                        spec(dict(kl_penalty_coef=2.0, kl_source="sample"), ref="base"),
                        {"kl_penalty_source": spec(dict(kl_penalty_coef=2.0), ref="base")})
    assert metric(result, "kl_policy_ref") != 0.0
    lagged = live.checkpoints[live.step - 1]
    check_call(live, {"kl_penalty_coef": 2.0, "kl_penalty_step_lag": 1}, spec(dict(kl_penalty_coef=2.0), ref=lagged),
               {"kl_penalty_step_lag": spec(dict(kl_penalty_coef=2.0), ref="base")})


def test_allow_training_without_logprobs_trains_an_assistant_message_on_policy(live):
    """ART's meaning: a plain assistant message of an RL trajectory is trained too, with ratio 1 (its template
    rendering: the same ids as the sampled turn it replaces); without the option only the sampled turn trains."""
    result = check_call(live, {"allow_training_without_logprobs": True}, spec(), {
        "allow_training_without_logprobs": spec(trained=(0,))}, dict_answer=True)
    assert result.metrics["data/rendered_turns"] == 1
