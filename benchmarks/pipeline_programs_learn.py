"""Do ART 0.5.23's pipeline programs learn on artrl, and as much as the synchronous loop over the same steps?

For each program of examples/art_pipeline_0523/ (yes/no/maybe; binary prefix with a tool call), each replicate
and each arm, the same start (the tiny model primed for the program's answer format, benchmarks/harness/primed_tiny.py,
built once) and the same sizes (environment variables the programs read, SIZES below) are run for MAX_STEPS
train steps:

* `pipeline`: the program itself, as a subprocess (`python examples/art_pipeline_0523/<program>.py`);
* `in_flight`: the same with ROLLOUT_WEIGHT_UPDATE_MODE=in_flight_lora (the programs' one added hook), i.e.
  `InternalModelConfig(rollout_weight_update_mode="in_flight_lora")`: running rollouts move to each new version;
* `in_flight_start_logprobs`: in-flight rollouts, but each train call is handed every sampled token's logprob
  under the version its rollout *started* on (recomputed, StartLogprobs below) instead of the version that
  sampled it: the importance ratios step_lora's record would give those tokens, so against `in_flight` it
  separates what in-flight's data does from what its fresher ratios do; `pipeline_start_logprobs` is its
  control, step_lora with the same recompute (its values are the record's, its cost is the same);
* `in_flight_grammar_ratios` / `pipeline_grammar_ratios`: in-flight / step_lora rollouts, each train call handed
  every sampled token's logprob rewritten so that its importance ratio (at the weights the call trains from) is
  the ratio *within the tool call's grammar* the reply was sampled under, not the raw one (GrammarRatios below):
  whether the grammar's drift in the raw ratios is what costs in-flight its gain;
* `sync_free_tokens` / `pipeline_free_tokens` / `in_flight_free_tokens`: the synchronous loop / step_lora /
  in-flight, with the tokens the grammar forced (one allowed token at their place: the call's fixed text) left
  out of the loss (FreeTokens below). Under the grammar those tokens are no choice: the masked policy gives
  each logprob 0 under every version, so no gradient and ratio 1, where the raw loss pushes them with each
  reply's advantage and weighs them by the drift of their raw probability;
* `--corrections NAME ...` (CORRECTIONS below): each of the arms `sync`, `pipeline`, `in_flight` run once per
  named off-policy correction, its TrainConfig fields added to every train call of the program (CorrectedBackend
  below; `none` adds nothing and runs the program as it is); `--sampler-dtype bfloat16` makes the built-in
  engine decode under bf16 autocast while the trainer stays float32 (a bf16 sampler's kernel mismatch, as vLLM
  serving bf16 weights has), `--sampler-dtype nf4` makes it decode with its linear layers' base weights rounded
  to bitsandbytes' 4-bit NF4 (a 4-bit base served against a float32 trainer; SAMPLER_DTYPES below). A run
  counts as collapsed (COLLAPSE_GAIN) when it stopped before MAX_STEPS (ART's model-collapse stop) or its
  held-out gain is below COLLAPSE_GAIN;
* `sync`: the same program in a subprocess with its `PipelineTrainer` replaced by `SyncLoop` below, a plain
  synchronous loop over the program's own scenarios, rollout function, reward, model, learning rate, loss and
  groups per step (`min_batch_size`): take that many scenarios, `art.gather_trajectory_groups` of the program's
  rollout function on them, train, repeat. Swapping the class, rather than copying the rollout, keeps every part
  the program builds (the binary-prefix program's rollout is a closure inside its `main`) the same object.

**Gain.** A held-out evaluation, identical for every arm: the program's own prompts and reward, sampled at the
rollouts' temperature, `--eval-samples` replies per prompt from seeded requests (the same seeds before and
after), on the primed model (before: step 0, one figure per program and replicate, shared by its arms) and on
the run's last checkpoint (after). gain = after - before. The train rows' `train/reward` per step is recorded
too (`step_rewards`, with `step_gain`: mean of the last WINDOW steps minus the first WINDOW), but it is not the
same measure in every arm: the pipeline logs only groups whose rewards spread (it sets the others aside) and
its groups were sampled up to `max_steps_off_policy` versions earlier.

The programs' own requests are not seeded (ART's programs set no seed), so a replicate is a rerun, not a
reproduction; its number seeds only the evaluation's requests.

One JSON line per (program, arm, replicate) on stdout, with the command:

    PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/pipeline_programs_learn.py --seeds 0 1 \\
        >> benchmarks/results/2026-12-03-cpu/pipeline-programs-learn.jsonl

`--table FILE[:ARM,...]...` prints docs/pipeline.md's table from such files (of the arms named, where named),
in-flight's gain minus the pipeline's with its standard error and Welch's t, and how gain follows the trained
tokens' mean policy age (where recorded).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Final

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: benchmarks.harness

ROOT: Final = Path(__file__).resolve().parents[1]
PROGRAMS_DIR: Final = ROOT / "examples" / "art_pipeline_0523"
PROGRAMS: Final = {"yes_no_maybe": "yes_no_maybe_pipeline.py", "binary_prefix": "binary_prefix_tool_pipeline.py"}
ARMS: Final = ("sync", "pipeline", "in_flight", "pipeline_start_logprobs", "in_flight_start_logprobs",
               "pipeline_grammar_ratios", "in_flight_grammar_ratios", "sync_free_tokens", "pipeline_free_tokens",
               "in_flight_free_tokens")
START_LOGPROBS_ARMS: Final = {"pipeline_start_logprobs": "pipeline", "in_flight_start_logprobs": "in_flight"}
"""Arms whose trainer is handed each token's logprob under the version its rollout started on (StartLogprobs),
by the arm whose rollouts they run."""
GRAMMAR_RATIO_ARMS: Final = {"pipeline_grammar_ratios": "pipeline", "in_flight_grammar_ratios": "in_flight"}
"""Arms whose trainer is handed logprobs that make each token's ratio the one within the grammar (GrammarRatios),
by the arm whose rollouts they run."""
RESCORED_ARMS: Final = {**START_LOGPROBS_ARMS, **GRAMMAR_RATIO_ARMS}
FREE_TOKEN_ARMS: Final = {"sync_free_tokens": "sync", "pipeline_free_tokens": "pipeline",
                          "in_flight_free_tokens": "in_flight"}
"""Arms that train only the tokens the grammar left a choice at (FreeTokens), by the arm they otherwise are."""
FREE_TOKENS_FILE: Final = "free_tokens.json"
START_LOGPROBS_FILE: Final = "start_logprobs.jsonl"
GRAMMAR_RATIOS_FILE: Final = "grammar_ratios.jsonl"
CORRECTIONS: Final = {
    # name -> TrainConfig fields added to every train call (docs/off-policy.md); bounds [0.5, 2] for every ratio
    "none": {},
    "token_truncate": {"importance_sampling_correction": "token_truncate", "importance_sampling_clip_min": 0.5,
                       "importance_sampling_clip_max": 2.0},
    "token_mask": {"importance_sampling_correction": "token_mask", "importance_sampling_clip_min": 0.5,
                   "importance_sampling_clip_max": 2.0},
    "sequence_mask": {"importance_sampling_correction": "sequence_mask", "importance_sampling_clip_min": 0.5,
                      "importance_sampling_clip_max": 2.0},
    "geometric_mask": {"importance_sampling_correction": "geometric_mask", "importance_sampling_clip_min": 0.5,
                       "importance_sampling_clip_max": 2.0},
    "off_policy_mask": {"off_policy_mask_threshold": 0.5},  # TRL's example value of DeepSeek-V3.2's delta
    "sequence_truncate": {"importance_sampling_correction": "sequence_truncate", "importance_sampling_clip_min": 0.5,
                          "importance_sampling_clip_max": 2.0},
    "geometric_truncate": {"importance_sampling_correction": "geometric_truncate",
                           "importance_sampling_clip_min": 0.5, "importance_sampling_clip_max": 2.0},
    # ART's truncated_importance_sampling and TRL's usual token_truncate: an upper bound only, small ratios kept
    "token_truncate_upper": {"importance_sampling_correction": "token_truncate", "importance_sampling_clip_max": 2.0},
    # a KL term against the base model (TRL's former default beta), alone and with DeepSeek-V3.2's bias correction
    "kl_beta": {"beta": 0.04},
    "kl_beta_bias_corrected": {"beta": 0.04, "use_bias_correction_kl": True},
}
CORRECTION_ENV: Final = "ARTRL_BENCH_TRAIN_FIELDS"
SAMPLER_DTYPE_ENV: Final = "ARTRL_BENCH_SAMPLER_DTYPE"
SAMPLER_DTYPES: Final = {
    # --sampler-dtype -> what the built-in engine's serving copy computes in (the trainer stays float32)
    "float32": "the trainer's own weights and kernels",
    "bfloat16": "bf16 autocast over the same weights (bf16 matmuls)",
    "nf4": "every linear layer's base weight but the output head's quantised to bitsandbytes' NF4 (blocksize 64) "
           "and dequantised: the values a 4-bit base computes with; the LoRA adapter stays float32",
}
NF4_BLOCKSIZE: Final = 64
COLLAPSE_GAIN: Final = 0.1
"""A run collapsed when it stopped early or its held-out gain is below this (fixed before the correction runs;
docs/pipeline.md's two collapsed in-flight runs at 1e-2 gained +0.018 and stopped at step 2)."""
WINDOW: Final = 3
"""Steps averaged at each end of `step_rewards` for `step_gain`."""
EVAL_CONCURRENCY: Final = 16

SIZES: Final = {
    # the program's defaults but for: steps, learning rate (ART's 5e-5 moves the tiny model's LoRA too little in
    # a few steps), and its own eval kept small (it does not train; the benchmark evaluates every arm alike)
    "yes_no_maybe": {"MAX_STEPS": "16", "ROLLOUTS_PER_SCENARIO": "8", "LEARNING_RATE": "1e-2",
                     "EVAL_TRAJECTORY_COUNT": "4"},
    # the program's defaults (4 groups a step, 8 workers, 8 rollouts a group, bound 6, temperature 1) but for:
    # steps, learning rate, MAX_TOKENS (a 30-bit guess in its JSON call fits in 60 tokens; the tiny model would
    # otherwise run on to 300), no eval at start. At 3e-3 and above the synchronous loop's tiny model learnt "10"
    # for a few steps, then lost the format within a step or two (guesses of words, calls cut at MAX_TOKENS)
    "binary_prefix": {"MAX_STEPS": "10", "LEARNING_RATE": "2e-3", "MAX_TOKENS": "60", "EVAL_AT_START": "0",
                      "SCENARIO_COUNT": "1000"},
}

# ------------------------------------------------------------------ the synchronous arm

PIPELINE_ONLY: Final = frozenset({
    # scheduling, staleness, eval, logging and resume: what the synchronous loop has no use for
    "eval_fn", "eval_every_n_steps", "eval_at_start", "max_steps_off_policy", "limit_mean_steps_off_policy",
    "log_interval_seconds", "status_ewa_alpha", "total_scenarios", "resume", "save_checkpoint",
    "discard_queue_multiplier", "optimizer_save_interval", "checkpoint_retention_strategy",
    "checkpoint_retention_interval", "score_reference_groups_per_step", "score_reference_rollouts_per_group",
    "num_rollout_workers", "max_batch_size", "queue_maxsize"})


class SyncLoop:
    """The synchronous loop in `PipelineTrainer`'s place, for `SyncLoop.train()` where the program calls
    `trainer.train()`: each step takes `min_batch_size` scenarios, gathers the program's rollout function on
    all of them (`art.gather_trajectory_groups`, every rollout from the newest weights), trains them, repeats.

    The train call is the pipeline's own (`backend.train` with its keywords) followed by the train row
    (`model.log`, as `model.train` writes it), with the pipeline's staleness keys at their on-policy values, so
    the program's own history summary reads the same, and `sample_efficiency/accepted_groups_per_step` counting
    the groups whose rewards spread (the others have no advantage; the pipeline sets them aside uncounted).
    A keyword that would change what is trained and that this loop does not honour is refused; the
    pipeline-only ones (PIPELINE_ONLY) are accepted and unused."""

    def __init__(self, model: Any, backend: Any, rollout_fn: Any, scenarios: Iterable | AsyncIterator, config: Any,
                 eval_fn: Any = None, *, pipeline: Any = None, min_batch_size: int | None = None,
                 learning_rate: float = 1e-5, loss_fn: str = "cispo", loss_fn_config: dict | None = None,
                 normalize_advantages: bool = True, adam_params: object | None = None, max_steps: int | None = None,
                 **pipeline_only: Any) -> None:
        from artrl.pipeline_trainer import PipelineRuntimeConfig

        unknown = set(pipeline_only) - PIPELINE_ONLY
        if unknown:
            raise TypeError(f"SyncLoop does not honour {sorted(unknown)}; extend it before comparing")
        if max_steps is None:
            raise ValueError("SyncLoop needs max_steps (the arms are compared over the same steps)")
        del eval_fn
        self.model, self.backend, self.rollout_fn, self.config = model, backend, rollout_fn, config
        self.scenarios = scenarios
        self.groups_per_step = min_batch_size or (pipeline or PipelineRuntimeConfig()).min_batch_size
        self.train_kwargs = {"learning_rate": learning_rate, "loss_fn": loss_fn, "loss_fn_config": loss_fn_config,
                             "normalize_advantages": normalize_advantages, "adam_params": adam_params}
        self.max_steps = max_steps

    async def _take(self, n: int) -> list:
        taken: list = []
        if hasattr(self.scenarios, "__anext__"):
            async for scenario in self.scenarios:
                taken.append(scenario)
                if len(taken) == n:
                    break
        else:
            it = iter(self.scenarios)
            self.scenarios = it
            for scenario in it:
                taken.append(scenario)
                if len(taken) == n:
                    break
        return taken

    async def train(self) -> None:
        import artrl as art

        for _ in range(self.max_steps):
            scenarios = await self._take(self.groups_per_step)
            if not scenarios:
                break
            groups = await art.gather_trajectory_groups(
                (self.rollout_fn(self.model, s, self.config) for s in scenarios), pbar_desc=None)
            result = await self.backend.train(self.model, groups, **self.train_kwargs)
            # the groups with an advantage (rewards that spread): what the pipeline's figure of that name counts
            spread = sum(len({t.reward for t in g.trajectories}) > 1 for g in groups)
            metrics = {**result.metrics, "discarded_stale_groups": 0.0, "steps_off_policy": 1.0, "staleness": 0.0,
                       "staleness_max": 0.0, "sample_efficiency/accepted_groups_per_step": float(spread)}
            await self.model.log(groups, split="train", step=int(result.step), metrics=metrics)


def load_program(path: Path) -> ModuleType:
    """The program at `path` as a module (its `if __name__ == "__main__"` not run)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def reply_logprobs(model: Any, prompt: list[int], reply: list[int]) -> Any:
    """log pi(. | prompt, reply[:t]) for each t: the [reply, vocab] float32 tensor of one forward, no cache."""
    import torch

    ids = torch.tensor([prompt + reply])  # [1, seq]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()  # [reply, vocab]
    return torch.log_softmax(logits, -1)


def token_logprobs(model: Any, prompt: list[int], reply: list[int]) -> list[float]:
    """log pi(reply[t] | prompt, reply[:t]) for each t, one forward, no cache."""
    import torch

    return reply_logprobs(model, prompt, reply).gather(-1, torch.tensor(reply)[:, None])[:, 0].tolist()


def model_with_checkpoints(base_model: str, run: Path) -> Any:
    """The base model (float32, eval mode) with the adapter of every complete checkpoint of run directory `run`
    loaded, as `v<step>`: `set_adapter(f"v{step}")` selects one."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from artrl.run import storage

    base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    model = None
    for step in storage.list_checkpoints(run):
        path, name = str(storage.checkpoint_dir(run, step)), f"v{step}"
        if model is None:
            model = PeftModel.from_pretrained(base, path, adapter_name=name)
        else:
            model.load_adapter(path, adapter_name=name)
    if model is None:
        raise FileNotFoundError(f"{run} has no complete checkpoint to load")
    return model.eval()


def tool_call_grammar(base_model: str, program: ModuleType) -> tuple[Any, int]:
    """(the binary-prefix program's forced tool call compiled as the server compiles it, the model's vocabulary
    size): what every one of its replies was sampled within."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from artrl.chat.format import end_of_turn_ids
    from artrl.serve.structured import GrammarCompiler, structured_output
    from artrl.serve.tool_calls import tool_call_syntax

    tokenizer = AutoTokenizer.from_pretrained(base_model)
    config = AutoConfig.from_pretrained(base_model)
    try:  # what a loaded model's `generation_config` is: its file, else the model config's
        generation: Any = GenerationConfig.from_pretrained(base_model)
    except OSError:
        generation = config
    grammar = GrammarCompiler(tokenizer, config.vocab_size, end_of_turn_ids(tokenizer, generation)).compile(
        structured_output(None, program.TOOLS, program.TOOL_CHOICE, None, tool_call_syntax(tokenizer)))
    return grammar, config.vocab_size


def allowed_tokens(grammar: Any, vocab: int, reply: list[int]) -> Any:
    """[reply, vocab] bool: the grammar's allowed tokens at each position of `reply`, as the server masked them;
    None when a sampled token is outside the grammar."""
    import torch

    from artrl.serve.structured import bitmask_words

    bit = torch.arange(32, dtype=torch.int32)
    row, words, allowed = grammar.row(), torch.zeros(bitmask_words(vocab), dtype=torch.int32), []
    for token in reply:
        row.fill_bitmask(words)
        allowed.append(((words[:, None] >> bit) & 1).flatten()[:vocab].bool())
        if not row.accept(token):
            return None
    return torch.stack(allowed)


def sampled_replies(groups: Iterable[Any]) -> Iterator[tuple[int, list[int], list[int], list[Any], list[dict]]]:
    """(start version, prompt ids, reply ids, its logprob records, its policy spans) of every recorded choice of
    the groups' trajectories; a reply without spans is its start version's whole. The records are the choice's
    own objects: a rewrite sets their `logprob`."""
    for group in groups:
        for trajectory in group.trajectories:
            start = trajectory.initial_policy_version
            for choice in trajectory.messages_and_choices:
                extra = getattr(choice, "model_extra", None)
                if not extra or choice.logprobs is None or not choice.logprobs.content:
                    continue
                if start is None:
                    raise RuntimeError("a trained trajectory has no initial_policy_version to rescore under")
                reply = extra["token_ids"]
                spans = extra.get("policy_token_spans") or [
                    {"start_token": 0, "end_token": len(reply), "policy_version": start}]
                yield start, extra["prompt_token_ids"], reply, choice.logprobs.content, spans


def picked_and_mass(lp: Any, reply: list[int], allowed: Any) -> tuple[list[float], list[float]]:
    """From one version's [reply, vocab] logprobs: each sampled token's logprob, and the log of the mass on the
    tokens `allowed` ([reply, vocab] bool) at its place."""
    import torch

    picked = lp.gather(-1, torch.tensor(reply)[:, None])[:, 0].tolist()
    return picked, torch.logsumexp(lp.masked_fill(~allowed, -float("inf")), -1).tolist()


def append_row(log: Path | None, row: dict[str, Any]) -> None:
    """One JSON line on `log` (None: nowhere)."""
    if log is not None:
        with log.open("a") as f:
            f.write(json.dumps(row) + "\n")


class StartLogprobs:
    """Rewrites the groups of a train call so that every sampled token's logprob is the one under the version
    its trajectory's rollout started on (`initial_policy_version`), recomputed with the base model and that
    checkpoint's adapter (float32, one forward a reply, no cache: what the server recorded to ~1e-5,
    benchmarks/experiments/in_flight_diagnose.py). The spans are left as recorded, so the token-age figures still say which
    version sampled each token. `score(version, prompt_ids, reply_ids)` is the recompute (injectable for tests).

    Per call it appends one line to `log`: tokens rewritten (sampled by a newer version than the start), the
    mean recomputed-minus-recorded logprob on them, and the largest |recomputed - recorded| on tokens the start
    version sampled itself (the recompute's own error: should stay near 1e-5)."""

    def __init__(self, score: Any, log: Path | None = None) -> None:
        self.score, self.log = score, log

    def rewrite(self, groups: Iterable[Any]) -> dict[str, Any]:
        own_err, shift = 0.0, []
        for start, prompt, reply, content, spans in sampled_replies(groups):
            values = self.score(start, prompt, reply)
            for span in spans:
                for i in range(span["start_token"], span["end_token"]):
                    if span["policy_version"] == start:
                        own_err = max(own_err, abs(values[i] - content[i].logprob))
                    else:
                        shift.append(values[i] - content[i].logprob)
            for lp, value in zip(content, values, strict=True):
                lp.logprob = min(value, 0.0)
        row = {"tokens_rewritten": len(shift), "mean_shift": statistics.fmean(shift) if shift else None,
               "own_version_abs_err_max": own_err}
        append_row(self.log, row)
        return row


class GrammarRatios:
    """Rewrites the groups of a train call so that each sampled token's importance ratio, at the weights the call
    trains from (version `trained_from`), is its ratio within the grammar the reply was sampled under rather than
    the raw one: the token sampled by version v at position i is handed

        log pi_v(a_i) - log Z_v(i) + log Z_from(i),    Z_u(i) = version u's mass on the tokens allowed at i,

    so that exp(log pi_from(a_i) - handed) = [pi_from(a_i) / Z_from(i)] / [pi_v(a_i) / Z_v(i)]. The gradient stays
    the raw logprob's (the trainer has no mask); only the weights change. A reply the grammar does not replay
    keeps its record (counted). `score(version, prompt, reply)` -> [reply, vocab] logprobs and `allowed(reply)` ->
    [reply, vocab] bool or None are injectable for tests.

    Per call it appends one line to `log`: tokens rewritten, the mean handed-minus-recorded logprob (the mean
    log(Z_from / Z_v) the raw ratios carried), replies refused, and the largest |recomputed - recorded| logprob
    (the recompute's own error)."""

    def __init__(self, score: Any, allowed: Any, log: Path | None = None) -> None:
        self.score, self.allowed, self.log = score, allowed, log

    def rewrite(self, groups: Iterable[Any], trained_from: int) -> dict[str, Any]:
        own_err, shift, refused = 0.0, [], 0
        for _, prompt, reply, content, spans in sampled_replies(groups):
            allowed = self.allowed(reply)
            if allowed is None:
                refused += 1
                continue
            picked, mass = {}, {}
            for v in {sp["policy_version"] for sp in spans} | {trained_from}:
                picked[v], mass[v] = picked_and_mass(self.score(v, prompt, reply), reply, allowed)
            for span in spans:
                v = span["policy_version"]
                for i in range(span["start_token"], span["end_token"]):
                    own_err = max(own_err, abs(picked[v][i] - content[i].logprob))
                    handed = min(picked[v][i] - mass[v][i] + mass[trained_from][i], 0.0)
                    shift.append(handed - content[i].logprob)
                    content[i].logprob = handed
        row = {"trained_from": trained_from, "tokens_rewritten": len(shift),
               "mean_shift": statistics.fmean(shift) if shift else None, "replies_refused": refused,
               "recompute_abs_err_max": own_err}
        append_row(self.log, row)
        return row


class FreeTokens:
    """Leaves the tokens a grammar forced out of the loss: patched into the tokenizer's `_extend` (which appends a
    sampled turn to the sequence it is trained in), each sampled turn is replayed through the grammar from its
    first token (`allowed(ids)` -> [ids, vocab] bool, or None where the grammar refuses the turn: kept whole,
    counted), and the positions with exactly one allowed token lose their trainable flag. `counts` says how many
    tokens were kept and left out, and turns refused; `install()` patches, `save(path)` writes the counts."""

    def __init__(self, allowed: Any) -> None:
        self.allowed = allowed
        self.counts = {"free": 0, "forced": 0, "turns": 0, "turns_refused": 0}

    def forced(self, ids: list[int]) -> list[bool] | None:
        allowed = self.allowed(ids)
        return None if allowed is None else (allowed.sum(-1) == 1).tolist()

    def install(self) -> None:
        import math

        from artrl.trajectories import sequences as tokenize

        extend = tokenize._extend

        def patched(seq: Any, context: Any, sampled: Any, logprobs: Any, *args: Any, **kwargs: Any) -> None:
            start = len(seq.token_ids) + len(context)
            extend(seq, context, sampled, logprobs, *args, **kwargs)
            self.counts["turns"] += 1
            forced = self.forced(list(sampled))
            if forced is None:
                self.counts["turns_refused"] += 1
                self.counts["free"] += len(sampled)
                return
            for i, f in enumerate(forced):
                if f:
                    seq.trainable_mask[start + i] = False
                    seq.logprobs[start + i] = math.nan
            self.counts["forced"] += sum(forced)
            self.counts["free"] += len(forced) - sum(forced)

        tokenize._extend = patched

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.counts))


def run_free_tokens_child(program_path: Path, base_arm: str) -> None:
    """In a child process: the program's `main` (with SyncLoop in its PipelineTrainer's place for "sync") training
    only the tokens its tool call's grammar left a choice at (FreeTokens); the counts go to FREE_TOKENS_FILE."""
    import atexit

    program = load_program(program_path)
    grammar, vocab = tool_call_grammar(os.environ["BASE_MODEL"], program)
    free = FreeTokens(lambda ids: allowed_tokens(grammar, vocab, ids))
    free.install()
    atexit.register(free.save, Path(os.environ["ART_PATH"]) / FREE_TOKENS_FILE)
    if base_arm == "sync":
        program.PipelineTrainer = SyncLoop
    asyncio.run(program.main())


def free_tokens_summary(art_path: Path) -> dict[str, Any]:
    """FreeTokens' counts over a run (empty for the other arms)."""
    path = art_path / FREE_TOKENS_FILE
    return {f"free_tokens_{k}": v for k, v in json.loads(path.read_text()).items()} if path.exists() else {}


def checkpoint_scorer(base_model: str, run: Path, scores: Any = None) -> Any:
    """score(version, prompt, reply) under the base model with the adapter of run directory `run`'s checkpoint of
    that step, each adapter loaded once, when first asked for (the run writes them as it goes): `scores(model,
    prompt, reply)`'s value, by default `token_logprobs` (each sampled token's logprob; `reply_logprobs` gives
    the [reply, vocab] tensor)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from artrl.run import storage

    state: dict[str, Any] = {"model": None, "loaded": set()}

    def score(version: int, prompt: list[int], reply: list[int]) -> list[float]:
        name = f"v{version}"
        if name not in state["loaded"]:
            if version not in storage.list_checkpoints(run):
                raise FileNotFoundError(f"{run} has no complete checkpoint of version {version} to rescore under")
            path = storage.checkpoint_dir(run, version)
            if state["model"] is None:
                base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
                state["model"] = PeftModel.from_pretrained(base, str(path), adapter_name=name).eval()
            else:
                state["model"].load_adapter(str(path), adapter_name=name)
            state["loaded"].add(name)
        state["model"].set_adapter(name)
        return (scores or token_logprobs)(state["model"], prompt, reply)

    return score


def run_rescore_child(program_path: Path, arm: str) -> None:
    """In a child process: the program's `main` with its backend's `train` handed the groups rewritten for `arm`,
    one of RESCORED_ARMS (StartLogprobs or GrammarRatios)."""
    program = load_program(program_path)
    art_path = Path(os.environ["ART_PATH"])
    base_model = os.environ["BASE_MODEL"]

    class RescoringBackend(program.LocalBackend):  # type: ignore[misc, name-defined]
        async def train(self, model: Any, groups: Any, **kwargs: Any) -> Any:
            groups = list(groups)
            if arm in START_LOGPROBS_ARMS:
                if not hasattr(self, "_rescore"):
                    self._rescore = StartLogprobs(checkpoint_scorer(base_model, run_dir(art_path)),
                                                  art_path / START_LOGPROBS_FILE)
                self._rescore.rewrite(groups)
            else:
                if not hasattr(self, "_rescore"):
                    grammar, vocab = tool_call_grammar(base_model, program)
                    self._rescore = GrammarRatios(checkpoint_scorer(base_model, run_dir(art_path), reply_logprobs),
                                                  lambda reply: allowed_tokens(grammar, vocab, reply),
                                                  art_path / GRAMMAR_RATIOS_FILE)
                self._rescore.rewrite(groups, await model.get_step())
            return await super().train(model, groups, **kwargs)

    program.LocalBackend = RescoringBackend
    asyncio.run(program.main())


def _rewrite_summary(path: Path, prefix: str, totals: dict[str, str], maxima: dict[str, str]) -> dict[str, Any]:
    """A rewriting arm's per-call log lines (StartLogprobs, GrammarRatios) over a run, its keys under `prefix`:
    tokens rewritten, their mean shift, `totals` (summed) and `maxima` (largest) of the rows' fields (empty where
    the arm left no log)."""
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    shifts = [(r["mean_shift"], r["tokens_rewritten"]) for r in rows if r["tokens_rewritten"]]
    rewritten = sum(n for _, n in shifts)
    return {f"{prefix}_tokens_rewritten": rewritten,
            f"{prefix}_mean_shift": sum(m * n for m, n in shifts) / rewritten if rewritten else None,
            **{f"{prefix}_{key}": sum(r[field] for r in rows) for key, field in totals.items()},
            **{f"{prefix}_{key}": max(r[field] for r in rows) for key, field in maxima.items()}}


def start_logprobs_summary(art_path: Path) -> dict[str, Any]:
    """What StartLogprobs did over a run (empty for the other arms)."""
    return _rewrite_summary(art_path / START_LOGPROBS_FILE, "start_logprobs", {},
                            {"own_version_abs_err_max": "own_version_abs_err_max"})


def grammar_ratios_summary(art_path: Path) -> dict[str, Any]:
    """What GrammarRatios did over a run (empty for the other arms)."""
    return _rewrite_summary(art_path / GRAMMAR_RATIOS_FILE, "grammar_ratios", {"replies_refused": "replies_refused"},
                            {"recompute_abs_err_max": "recompute_abs_err_max"})


def bf16_sampler(serving_copy: Any) -> Any:
    """`serving_copy` (serve/engines/transformers_engine.py's) whose copy decodes under bf16 autocast: the engine's
    sampled logprobs come from bf16 matmuls while the trainer computes in float32."""
    import functools

    import torch

    def copy(model: Any) -> Any:
        served = serving_copy(model)
        forward = served.forward

        @functools.wraps(forward)
        def autocast_forward(*args: Any, **kwargs: Any) -> Any:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return forward(*args, **kwargs)

        served.forward = autocast_forward
        return served

    return copy


def nf4_sampler(serving_copy: Any) -> Any:
    """`serving_copy` whose copy holds every linear layer's base weight (the LoRA layers' `base_layer`s and plain
    linears; not the adapter's own, not `lm_head`) rounded to NF4: bitsandbytes' `quantize_4bit` then
    `dequantize_4bit`, so the engine computes with the weights a 4-bit base has, in float32 kernels, while the
    trainer keeps the float32 ones. Each rounded weight is a new Parameter of the copy: the trainer's, which the
    copy otherwise shares, is left as it is."""
    import torch
    from bitsandbytes import functional as bnb

    def copy(model: Any) -> Any:
        served = serving_copy(model)
        for name, module in served.named_modules():
            if (type(module) is torch.nn.Linear and "lora_" not in name and not name.endswith("lm_head")):
                weight = module.weight.data
                packed, state = bnb.quantize_4bit(weight.contiguous(), quant_type="nf4", blocksize=NF4_BLOCKSIZE)
                rounded = bnb.dequantize_4bit(packed, state).to(weight.dtype).reshape(weight.shape)
                module.weight = torch.nn.Parameter(rounded, requires_grad=False)
        return served

    return copy


SAMPLERS: Final = {"bfloat16": bf16_sampler, "nf4": nf4_sampler}


def patch_sampler(dtype: str) -> None:
    """Make the built-in engine's serving copy compute as SAMPLER_DTYPES[dtype] says, in this process."""
    if dtype == "float32":
        return
    from artrl.serve.engines import transformers_engine

    transformers_engine.serving_copy = SAMPLERS[dtype](transformers_engine.serving_copy)


def run_corrected_child(program_path: Path, base_arm: str) -> None:
    """In a child process: the program's `main` (SyncLoop in its PipelineTrainer's place for "sync") with the
    TrainConfig fields of CORRECTION_ENV added to every train call, and the sampler SAMPLER_DTYPE_ENV names
    (SAMPLER_DTYPES)."""
    program = load_program(program_path)
    fields = json.loads(os.environ.get(CORRECTION_ENV) or "{}")
    patch_sampler(os.environ.get(SAMPLER_DTYPE_ENV, "float32"))

    class CorrectedBackend(program.LocalBackend):  # type: ignore[misc, name-defined]
        async def train(self, model: Any, groups: Any, **kwargs: Any) -> Any:
            return await super().train(model, groups, **{**kwargs, **fields})

    program.LocalBackend = CorrectedBackend
    if base_arm == "sync":
        program.PipelineTrainer = SyncLoop
    asyncio.run(program.main())


def run_sync_child(program_path: Path) -> None:
    """In a child process: the program's `main` with `SyncLoop` as its `PipelineTrainer`."""
    program = load_program(program_path)
    program.PipelineTrainer = SyncLoop
    asyncio.run(program.main())


# ------------------------------------------------------------------ evaluation

def request_seed(replicate: int, index: int) -> int:
    h = hashlib.sha256(f"eval:{replicate}:{index}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


async def sample_eval(program_name: str, program: ModuleType, model: Any, replicate: int, samples: int,
                      env: dict[str, str]) -> list[float]:
    """Rewards of `samples` replies to each of the program's prompts, by its reward, seeded by `replicate`.

    The requests run EVAL_CONCURRENCY at a time; a seeded request samples the same tokens whatever it shares a
    batch with (serve/engines/sampling.py), up to float noise."""
    client = model.openai_client()
    name = model.get_inference_name()
    limit = asyncio.Semaphore(EVAL_CONCURRENCY)

    async def words(i: int, scenario: dict) -> list[float]:
        async with limit:
            response = await client.chat.completions.create(
                messages=[{"role": "user", "content": scenario["prompt"]}], model=name,
                max_tokens=program.MAX_TOKENS, n=samples, seed=request_seed(replicate, i))
        return [program.reward_for_answer(c.message.content or "") for c in response.choices]

    async def guess(i: int) -> list[float]:  # one reply a request, as the program's rollouts
        async with limit:
            response = await client.chat.completions.create(
                messages=[{"role": "system", "content": program.SYSTEM_PROMPT},
                          {"role": "user", "content": program.USER_PROMPT}],
                model=name, max_tokens=int(env["MAX_TOKENS"]),
                temperature=float(env.get("ROLLOUT_TEMPERATURE", "1.0")), tools=program.TOOLS,
                tool_choice=program.TOOL_CHOICE, seed=request_seed(replicate, i))
        raw, _ = program.extract_guess(response.choices[0])
        raw = raw or ""
        return [float(program.shared_prefix_len(raw, program.SECRET_BITS) if program.is_valid_guess(raw) else 0)]

    if program_name == "yes_no_maybe":
        parts = await asyncio.gather(*(words(i, s) for i, s in enumerate(program.build_scenarios())))
    else:
        parts = await asyncio.gather(*(guess(i) for i in range(samples)))
    return [r for part in parts for r in part]


def evaluate(program_name: str, program: ModuleType, base_model: str, art_path: Path | None, replicate: int,
             samples: int, env: dict[str, str]) -> dict[str, Any]:
    """Mean eval reward of the run under `art_path` at its last checkpoint, or of `base_model` when None."""
    import artrl as art

    async def main() -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as scratch:
            if art_path is None:
                path, project, name = Path(scratch), "eval", "base"
            else:
                run = run_dir(art_path)
                path, project, name = art_path, run.parent.parent.name, run.name
            backend = art.LocalBackend(path=str(path), show_progress=False)
            try:
                model = art.TrainableModel(name=name, project=project, base_model=base_model)
                await model.register(backend)
                step = await model.get_step()
                rewards = await sample_eval(program_name, program, model, replicate, samples, env)
            finally:
                backend.close()
        return {"step": step, "reward": statistics.fmean(rewards), "n": len(rewards)}

    return asyncio.run(main())


# ------------------------------------------------------------------ the runs

def run_dir(art_path: Path) -> Path:
    (run,) = art_path.glob("*/models/*")
    return run


def history(art_path: Path) -> list[dict[str, Any]]:
    from artrl.run import storage

    path = run_dir(art_path) / storage.HISTORY_FILE
    return [json.loads(line) for line in path.read_text().splitlines()]


def scenarios_pulled(art_path: Path) -> int | None:
    """The scenarios the pipeline took from the stream (its state; None for the synchronous loop, which keeps none)."""
    from artrl.pipeline_trainer.state import PIPELINE_STATE_KEY
    from artrl.run import storage

    path = run_dir(art_path) / storage.STATE_FILE
    state = json.loads(path.read_text()) if path.exists() else {}
    return (state.get(PIPELINE_STATE_KEY) or {}).get("total_scenarios_consumed")


def window_gain(values: list[float], window: int = WINDOW) -> float | None:
    """Mean of the last `window` values minus the first `window` (fewer when there are under 2 * window)."""
    w = min(window, len(values) // 2)
    if w == 0:
        return None
    return statistics.fmean(values[-w:]) - statistics.fmean(values[:w])


def summarize_history(rows: list[dict[str, Any]]) -> dict[str, Any]:
    train = sorted((r for r in rows if r.get("split") == "train"), key=lambda r: r["step"])
    rewards = [r["train/reward"] for r in train]
    set_aside = [r for r in rows if r.get("split") == "discarded"]
    return {"steps_done": len(train), "step_rewards": rewards, "step_gain": window_gain(rewards),
            "groups_per_step": [r.get("sample_efficiency/accepted_groups_per_step") for r in train],
            "staleness": [r.get("train/staleness") for r in train],
            # the trained tokens' mean age in versions: a group's staleness for step_lora, less for in-flight
            # updates, whose tokens after a swap come from newer versions (counted by `policy_token_spans`)
            "token_policy_age": [r.get("offpolicy/token_weighted_policy_age_steps") for r in train],
            # the served policy's logprob of each sampled token against the trainer's (docs/token-record.md), and
            # the loss's mean importance ratio: how far the record and the weights trained were apart
            "sampled_logprob_delta_max": [r.get("train/sampled_logprob_delta_max") for r in train],
            "mean_ratio": [r.get("train/mean_ratio") for r in train],
            # the sampler/trainer mismatch every call measures (train/offpolicy.py), per step
            **{f"mismatch_{key}": [r.get(f"offpolicy/{key}") for r in train]
               for key in ("sampler_kl", "chi2_token", "token_below_min", "token_above_max", "sequence_below_min",
                           "off_policy_masked_tokens")},
            "discarded_stale_groups": max((r.get("train/discarded_stale_groups", 0.0) for r in train), default=0.0),
            "set_aside_rows": len(set_aside)}


def run_arm(program_name: str, arm: str, base_model: Path, work: Path, env_sizes: dict[str, str],
            correction: str = "none", sampler_dtype: str = "float32") -> tuple[Path, float]:
    """Run one arm (with an off-policy correction of CORRECTIONS, a sampler dtype) in a subprocess; (its ART_PATH,
    wall seconds)."""
    art_path = work / ".art"
    program = PROGRAMS_DIR / PROGRAMS[program_name]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "ART_PATH": str(art_path),
           "PYTHONPATH": str(ROOT / "src"), "BASE_MODEL": str(base_model), **env_sizes}
    env.pop("ROLLOUT_WEIGHT_UPDATE_MODE", None)
    base_arm = FREE_TOKEN_ARMS.get(arm) or RESCORED_ARMS.get(arm, arm)
    if base_arm == "in_flight":
        env["ROLLOUT_WEIGHT_UPDATE_MODE"] = "in_flight_lora"
    here = str(Path(__file__).resolve())
    patched = correction != "none" or sampler_dtype != "float32"
    if patched and arm not in ("sync", "pipeline", "in_flight"):
        raise ValueError(f"arm {arm} takes no correction or sampler dtype (only sync, pipeline, in_flight do)")
    env[CORRECTION_ENV], env[SAMPLER_DTYPE_ENV] = json.dumps(CORRECTIONS[correction]), sampler_dtype
    cmd = ([sys.executable, here, "--corrected-child", str(program), base_arm] if patched
           else [sys.executable, here, "--sync-child", str(program)] if arm == "sync"
           else [sys.executable, here, "--free-tokens-child", str(program), base_arm] if arm in FREE_TOKEN_ARMS
           else [sys.executable, here, "--rescore-child", str(program), arm] if arm in RESCORED_ARMS
           else [sys.executable, str(program)])
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{program_name} {arm} failed (rc {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-4000:]}")
    return art_path, wall


def prime(program_name: str, program: ModuleType, out: Path) -> Path:
    from benchmarks.harness import primed_tiny

    if (out / "model" / "config.json").exists():
        return out / "model"
    build = primed_tiny.word_model if program_name == "yes_no_maybe" else primed_tiny.guess_model
    return build(out, program)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--programs", nargs="+", choices=sorted(PROGRAMS), default=list(PROGRAMS))
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="replicates (they seed the eval requests)")
    p.add_argument("--eval-samples", type=int, default=None,
                   help="replies per eval prompt (default: 8 for yes/no/maybe's 48 prompts, 128 for binary "
                        "prefix's one)")
    p.add_argument("--set", action="append", default=[], metavar="K=V",
                   help="override a size for every arm of every program (e.g. LEARNING_RATE=3e-3)")
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "artrl-pipeline-programs-learn",
                   help="where the primed models are kept between invocations")
    p.add_argument("--corrections", nargs="+", choices=list(CORRECTIONS), default=["none"],
                   help="off-policy corrections (CORRECTIONS), each run for every arm and replicate, alternated")
    p.add_argument("--sampler-dtype", choices=list(SAMPLER_DTYPES), default="float32",
                   help="what the engine decodes with, the trainer staying float32: " +
                        "; ".join(f"{k}: {v}" for k, v in SAMPLER_DTYPES.items()))
    p.add_argument("--correction-table", nargs="+", metavar="FILE",
                   help="print the corrections' table (collapses, gains, mismatch) of results files and exit")
    p.add_argument("--sync-child", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--corrected-child", nargs=2, metavar=("PROGRAM", "ARM"), help=argparse.SUPPRESS)
    p.add_argument("--rescore-child", nargs=2, metavar=("PROGRAM", "ARM"), help=argparse.SUPPRESS)
    p.add_argument("--free-tokens-child", nargs=2, metavar=("PROGRAM", "ARM"), help=argparse.SUPPRESS)
    p.add_argument("--table", nargs="+", metavar="FILE[:ARM,...]",
                   help="print the markdown table of results files and exit; FILE:in_flight takes only that arm's "
                        "lines of FILE")
    args = p.parse_args(argv)
    if args.sync_child:
        run_sync_child(args.sync_child)
        return 0
    if args.corrected_child:
        run_corrected_child(Path(args.corrected_child[0]), args.corrected_child[1])
        return 0
    if args.correction_table:
        print(correction_table([r for spec in args.correction_table for r in read_results(spec)]))
        return 0
    if args.free_tokens_child:
        run_free_tokens_child(Path(args.free_tokens_child[0]), args.free_tokens_child[1])
        return 0
    if args.rescore_child:
        run_rescore_child(Path(args.rescore_child[0]), args.rescore_child[1])
        return 0
    if args.table:  # the runs without a correction, sampled in float32 (--correction-table has the others)
        records = [r for spec in args.table for r in read_results(spec)
                   if r.get("correction", "none") == "none" and r.get("sampler_dtype", "float32") == "float32"]
        print(table(records))
        for found in (differences(records), age_fit(records)):
            if found:
                print(f"\n{found}")
        return 0
    grammar_arms = [a for a in args.arms if a in GRAMMAR_RATIO_ARMS or a in FREE_TOKEN_ARMS]
    if grammar_arms and args.programs != ["binary_prefix"]:
        p.error(f"arms {', '.join(grammar_arms)} replay the binary-prefix program's tool-call grammar: run them with "
                "--programs binary_prefix")
    overrides = dict(kv.split("=", 1) for kv in args.set)
    given = argv if argv is not None else sys.argv[1:]
    command = " ".join(["python", "benchmarks/pipeline_programs_learn.py", *given])
    for program_name in args.programs:
        program = load_program(PROGRAMS_DIR / PROGRAMS[program_name])
        sizes = {**SIZES[program_name], **overrides}
        samples = args.eval_samples or (8 if program_name == "yes_no_maybe" else 128)
        base_model = prime(program_name, program, args.cache / program_name)
        for seed in args.seeds:
            before = evaluate(program_name, program, str(base_model), None, seed, samples, sizes)
            for arm, correction in ((a, c) for a in args.arms for c in args.corrections):
                with tempfile.TemporaryDirectory(prefix=f"artrl-ppl-{program_name}-{arm}-") as work:
                    art_path, wall = run_arm(program_name, arm, base_model, Path(work), sizes, correction,
                                             args.sampler_dtype)
                    after = evaluate(program_name, program, str(base_model), art_path, seed, samples, sizes)
                    summary = summarize_history(history(art_path))
                    summary["scenarios_pulled"] = scenarios_pulled(art_path)
                    summary.update(start_logprobs_summary(art_path))
                    summary.update(grammar_ratios_summary(art_path))
                    summary.update(free_tokens_summary(art_path))
                gain = after["reward"] - before["reward"]
                record = {"bench": "pipeline_programs_learn", "program": program_name, "arm": arm, "seed": seed,
                          "correction": correction, "correction_fields": CORRECTIONS[correction],
                          "sampler_dtype": args.sampler_dtype,
                          "collapsed": summary["steps_done"] < int(sizes["MAX_STEPS"]) or gain < COLLAPSE_GAIN,
                          "sizes": sizes, "eval_samples": after["n"], "eval_before": before["reward"],
                          "eval_after": after["reward"], "eval_after_step": after["step"],
                          "gain": gain, **summary, "wall_s": round(wall, 1),
                          "omp_threads": os.environ.get("OMP_NUM_THREADS"), "command": command}
                print(json.dumps(record), flush=True)
    return 0


# ------------------------------------------------------------------ the table

def read_results(spec: str) -> list[dict[str, Any]]:
    """The records of results file `spec`, or of `FILE:ARM,...` those of the arms named (so that one table can
    set, say, the pipeline arm of one file against the in-flight arm of another)."""
    path, _, arms = spec.rpartition(":")
    if not path or not set(arms.split(",")) <= set(ARMS):
        path, arms = spec, ""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in records if r["arm"] in arms.split(",")] if arms else records


def table(records: list[dict[str, Any]]) -> str:
    """Per program: each arm's gain over replicates (mean +- sample std, median), pipeline / sync and
    in-flight / pipeline (of the means), and the mean eval before training."""
    lines = ["| program | replicates | sync gain | pipeline gain | pipeline / sync | in-flight gain | "
             "in-flight / pipeline | eval before |", "|---|---|---|---|---|---|---|---|"]
    extra: list[str] = []
    for program in PROGRAMS:
        gains = {arm: [r["gain"] for r in records if r["program"] == program and r["arm"] == arm] for arm in ARMS}
        if not any(gains.values()):
            continue
        mean = {arm: statistics.fmean(g) if g else None for arm, g in gains.items()}

        def cell(arm: str) -> str:
            g = gains[arm]
            if not g:
                return "-"
            std = f" +- {statistics.stdev(g):.3f}" if len(g) > 1 else ""
            return f"{mean[arm]:+.3f}{std} (median {statistics.median(g):+.3f})"

        def ratio(a: str, b: str) -> str:
            return f"{mean[a] / mean[b]:.2f}" if mean[a] is not None and mean[b] else "-"

        before = statistics.fmean(r["eval_before"] for r in records if r["program"] == program)
        replicates = "/".join(str(len(gains[arm])) for arm in ("sync", "pipeline", "in_flight"))
        if any(gains[arm] for arm in ("sync", "pipeline", "in_flight")):
            lines.append(f"| {program} | {replicates} | {cell('sync')} | {cell('pipeline')} | "
                         f"{ratio('pipeline', 'sync')} | {cell('in_flight')} | {ratio('in_flight', 'pipeline')} | "
                         f"{before:.3f} |")
        extra.extend(f"| {program} | {arm_label(arm)} | {len(gains[arm])} | {cell(arm)} | {before:.3f} |"
                     for arm in (*RESCORED_ARMS, *FREE_TOKEN_ARMS) if gains[arm])
    if len(lines) == 2:  # none of the three main arms: their table is left out
        lines = []
    if extra:  # the rescored and free-token arms, where the records have them
        lines += [*([""] if lines else []), "| program | arm | replicates | gain | eval before |",
                  "|---|---|---|---|---|", *extra]
    return "\n".join(lines)


def correction_table(records: list[dict[str, Any]]) -> str:
    """Per program, sampler dtype, arm and correction: replicates, collapsed runs (COLLAPSE_GAIN), the mean gain of
    all runs and of those that did not collapse (+- sample std), that mean's difference from the same arm without
    a correction (standard error, Welch's t), and the first step's mean sampler KL and share of tokens below / above
    the measured bounds over the runs' calls after the first."""
    lines = ["| program | sampler | arm | correction | replicates | collapsed | gain, all runs | gain, not collapsed "
             "| - none (se, t) | sampler KL | tokens below / above bounds |", "|---|---|---|---|---|---|---|---|---|---|---|"]

    def mean_sd(g: list[float]) -> str:
        return "-" if not g else f"{statistics.fmean(g):+.3f}" + (f" +- {statistics.stdev(g):.3f}" if len(g) > 1 else "")

    def later(r: dict[str, Any], key: str) -> list[float]:
        return [v for v in r.get(f"mismatch_{key}", [])[1:] if v is not None]

    keys = sorted({(r["program"], r.get("sampler_dtype", "float32"), r["arm"]) for r in records},
                  key=lambda k: (list(PROGRAMS).index(k[0]), k[1], ARMS.index(k[2])))
    for program, dtype, arm in keys:
        runs = [r for r in records if (r["program"], r.get("sampler_dtype", "float32"), r["arm"]) == (program, dtype, arm)]
        kept_none = [r["gain"] for r in runs if r.get("correction", "none") == "none" and not collapsed(r)]
        for name in CORRECTIONS:
            mine = [r for r in runs if r.get("correction", "none") == name]
            if not mine:
                continue
            kept = [r["gain"] for r in mine if not collapsed(r)]
            vs = welch(kept, kept_none) if name != "none" else None
            versus = f"{vs[0]:+.3f} ({vs[1]:.3f}, {vs[2]:+.2f})" if vs else "-"
            kl = [v for r in mine for v in later(r, "sampler_kl")]
            below = [v for r in mine for v in later(r, "token_below_min")]
            above = [v for r in mine for v in later(r, "token_above_max")]
            share = f"{statistics.fmean(below):.3f} / {statistics.fmean(above):.3f}" if below and above else "-"
            lines.append(f"| {program} | {dtype} | {arm_label(arm)} | {name} | {len(mine)} | "
                         f"{sum(collapsed(r) for r in mine)} | {mean_sd([r['gain'] for r in mine])} | {mean_sd(kept)} | "
                         f"{versus} | {f'{statistics.fmean(kl):.4f}' if kl else '-'} | {share} |")
    return "\n".join(lines)


def collapsed(record: dict[str, Any]) -> bool:
    """Whether a run collapsed (COLLAPSE_GAIN): recorded, or, for records written before the field, recomputed."""
    if "collapsed" in record:
        return bool(record["collapsed"])
    return record["steps_done"] < int(record["sizes"]["MAX_STEPS"]) or record["gain"] < COLLAPSE_GAIN


def differences(records: list[dict[str, Any]]) -> str:
    """Per program and pair of arms with two or more replicates of each: the first arm's gain minus the second's,
    its standard error and Welch's t, one line each. The pairs: in-flight against the pipeline, and where the
    records have them, the start-logprobs arms against each other and each against its plain arm."""
    lines = []
    pairs = [("in_flight", "pipeline"), ("in_flight_start_logprobs", "pipeline_start_logprobs"),
             ("in_flight_start_logprobs", "in_flight"), ("pipeline_start_logprobs", "pipeline"),
             ("in_flight_grammar_ratios", "pipeline_grammar_ratios"), ("in_flight_grammar_ratios", "in_flight"),
             ("pipeline_grammar_ratios", "pipeline"), ("in_flight_free_tokens", "pipeline_free_tokens"),
             ("pipeline_free_tokens", "sync_free_tokens"), ("pipeline_free_tokens", "pipeline")]
    for program in PROGRAMS:
        gains = {arm: [r["gain"] for r in records if r["program"] == program and r["arm"] == arm] for arm in ARMS}
        for a, b in pairs:
            if (found := welch(gains[a], gains[b])) is not None:
                diff, se, t = found
                lines.append(f"{program}: {arm_label(a)} - {arm_label(b)} gain {diff:+.3f}, standard error "
                             f"{se:.3f}, Welch t {t:+.2f} ({len(gains[a])} and {len(gains[b])} replicates)")
    return "\n".join(lines)


def arm_label(arm: str) -> str:
    return (arm.replace("in_flight", "in-flight").replace("_start_logprobs", " (start logprobs)")
            .replace("_grammar_ratios", " (grammar ratios)").replace("_free_tokens", " (free tokens)"))


def mean_token_age(record: dict[str, Any]) -> float | None:
    """A run's trained tokens' mean policy age over its calls after the first (None: not recorded)."""
    ages = [a for a in record.get("token_policy_age", [])[1:] if a is not None]
    return statistics.fmean(ages) if ages else None


def age_fit(records: list[dict[str, Any]]) -> str:
    """Per program with four or more runs of the pipeline and in-flight arms that record their token age: the
    correlation of gain with mean token age, and a least-squares fit gain = a + b * age + c * [in-flight] (c:
    what in-flight gains or loses beyond the age of its tokens), one line each."""
    import numpy as np

    lines = []
    for program in PROGRAMS:
        runs = [(age, r["gain"], r["arm"] == "in_flight") for r in records
                if r["program"] == program and r["arm"] in ("pipeline", "in_flight")
                and (age := mean_token_age(r)) is not None]
        if len(runs) < 4 or len({arm for _, _, arm in runs}) < 2:
            continue
        ages, gains = [a for a, _, _ in runs], [g for _, g, _ in runs]
        fit = np.linalg.lstsq(np.array([[1.0, a, float(f)] for a, _, f in runs]), np.array(gains), rcond=None)[0]
        corr = statistics.correlation(ages, gains)
        lines.append(f"{program}: over {len(runs)} runs, corr(gain, mean token age) {corr:+.2f}; "
                     f"gain = {fit[0]:+.3f} {fit[1]:+.3f} * age {fit[2]:+.3f} * [in-flight]")
    return "\n".join(lines)


def welch(a: list[float], b: list[float]) -> tuple[float, float, float] | None:
    """(mean(a) - mean(b), its standard error, Welch's t) of two samples; None under 2 values in either."""
    if len(a) < 2 or len(b) < 2:
        return None
    diff = statistics.fmean(a) - statistics.fmean(b)
    se = (statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) ** 0.5
    return diff, se, diff / se if se > 0 else float("nan")


if __name__ == "__main__":
    sys.exit(main())
