"""What the trainer is given by a binary-prefix pipeline run, in-flight (or step_lora): record, then check.

One run of examples/art_pipeline_0523/binary_prefix_tool_pipeline.py (the sizes of
benchmarks/pipeline_programs_learn.py, from its primed model), in this process, with the program's `LocalBackend`
replaced by `RecordingBackend`: every `train` call's groups are written to `calls.jsonl` (per trajectory: reward,
the version the rollout started on, the choice's prompt and sampled ids, their sampled logprobs and
`policy_token_spans`) before they are trained, with the call's metrics after. Every checkpoint stays on disk.

Then, offline, with the base model and each checkpoint's adapter:

* **the record**: each sampled token's logprob recomputed (one forward over prompt + reply, no cache) under the
  version its span names, against the logprob the server recorded: a mismatch is a wrong behaviour logprob;
* **the ratio the loss sees**: the same under the weights the call trains from (`r_t = exp(new_t - old_t)`),
  per token group (tokens of single-version replies, and of multi-version replies before and after the swap);
* **the weights the loss gives**: per call, the mean of CISPO's clipped ratio (its token weight) over the tokens
  of replies with positive advantage and over those with negative (the sign of reward minus its group's mean);
* **the replies**: reward and validity of replies sampled by one version against those that changed version;
* **the grammar's share** (`--grammar-mass`): on the tokens sampled after a swap, the start version's logprob
  minus the sampling version's, raw (as the record and the trainer hold them) and within the forced tool call's
  grammar, with the mass each version puts on the grammar's allowed tokens;
* **the learning curve** (`--curve N`): the benchmark's held-out eval (N seeded replies at the rollouts'
  temperature) of every checkpoint, where the benchmark scores the last one only.

    PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/experiments/in_flight_diagnose.py --mode in_flight_lora --out d --curve 64
    PYTHONPATH=src OMP_NUM_THREADS=2 python benchmarks/experiments/in_flight_diagnose.py --analyze d

The summary is one JSON object: the last line on stdout (the program prints its own lines before it), and
`summary.json` in the run's directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Final

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: pipeline_programs_learn
import pipeline_programs_learn as ppl  # noqa: E402

CALLS_FILE: Final = "calls.jsonl"


def make_recording_backend(base: type, out: Path) -> type:
    class RecordingBackend(base):  # type: ignore[misc, valid-type]
        """The program's backend; each `train` call's groups are written to `out / CALLS_FILE` first."""

        async def train(self, model: Any, groups: Any, **kwargs: Any) -> Any:
            step = await model.get_step()
            rows = []
            for g, group in enumerate(groups):
                for trajectory in group.trajectories:
                    choice = trajectory.messages_and_choices[-1]
                    extra = choice.model_extra or {}
                    rows.append({"group": g, "reward": trajectory.reward,
                                 "valid": trajectory.metrics.get("valid_guess"),
                                 "initial_version": trajectory.initial_policy_version,
                                 "prompt_ids": extra.get("prompt_token_ids"), "token_ids": extra.get("token_ids"),
                                 "logprobs": [c.logprob for c in choice.logprobs.content],
                                 "spans": extra.get("policy_token_spans"), "finish": choice.finish_reason})
            result = await super().train(model, groups, **kwargs)
            with (out / CALLS_FILE).open("a") as f:
                f.write(json.dumps({"from_step": step, "trajectories": rows, "metrics": result.metrics}) + "\n")
            return result

    return RecordingBackend


def record(mode: str, out: Path, base_model: Path, sizes: dict[str, str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / CALLS_FILE).unlink(missing_ok=True)
    os.environ.update({"HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "ART_PATH": str(out / ".art"),
                       "BASE_MODEL": str(base_model), **sizes})
    os.environ.pop("ROLLOUT_WEIGHT_UPDATE_MODE", None)
    if mode == "in_flight_lora":
        os.environ["ROLLOUT_WEIGHT_UPDATE_MODE"] = mode
    program = ppl.load_program(ppl.PROGRAMS_DIR / ppl.PROGRAMS["binary_prefix"])
    program.LocalBackend = make_recording_backend(program.LocalBackend, out)
    asyncio.run(program.main())
    (out / "base_model").write_text(str(base_model))
    (out / "mode").write_text(mode)


# ------------------------------------------------------------------ analysis

def analyze(out: Path) -> dict[str, Any]:
    import torch

    from artrl.run import storage
    from artrl.train.loss import LOG_RATIO_BOUND
    from artrl.types import CISPO_EPSILON, CISPO_EPSILON_HIGH

    low, high = CISPO_EPSILON, CISPO_EPSILON_HIGH  # the programs train with ART's default loss, CISPO
    torch.manual_seed(0)
    calls = [json.loads(line) for line in (out / CALLS_FILE).read_text().splitlines()]
    run = ppl.run_dir(out / ".art")
    checkpoints = set(storage.list_checkpoints(run))
    model = ppl.model_with_checkpoints((out / "base_model").read_text(), run)

    def under(version: int, prompt: list[int], reply: list[int]) -> list[float]:
        model.set_adapter(f"v{version}")
        return ppl.token_logprobs(model, prompt, reply)

    record_err: list[float] = []  # |recorded - recomputed under the span's version|
    log_ratio: dict[str, list[float]] = {"single": [], "before_swap": [], "after_swap": []}
    replies: dict[str, list[dict[str, Any]]] = {"single": [], "multi": []}
    per_call = []
    age = {r["step"]: r.get("offpolicy/token_weighted_policy_age_steps") for r in ppl.history(out / ".art")
           if r.get("split") == "train"}  # the pipeline's figure, on the train row of the step a call produced
    for call in calls:
        s = call["from_step"]
        call_ratios = []
        group_mean = {g: statistics.fmean(t["reward"] for t in call["trajectories"] if t["group"] == g)
                      for g in {t["group"] for t in call["trajectories"]}}
        weights: dict[str, list[float]] = {"positive": [], "negative": []}  # the loss's token weights, by A's sign
        for t in call["trajectories"]:
            prompt, reply, recorded = t["prompt_ids"], t["token_ids"], t["logprobs"]
            spans = t["spans"] or [{"start_token": 0, "end_token": len(reply), "policy_version": t["initial_version"]}]
            versions = [sp["policy_version"] for sp in spans]
            kind = "multi" if len(set(versions)) > 1 else "single"
            replies[kind].append({"reward": t["reward"], "valid": t["valid"], "len": len(reply),
                                  "finish": t["finish"]})
            new = under(s, prompt, reply)
            advantage = t["reward"] - group_mean[t["group"]]
            if advantage:
                weights["positive" if advantage > 0 else "negative"] += [
                    min(max(math.exp(min(n - o, LOG_RATIO_BOUND)), 1 - low), 1 + high)
                    for n, o in zip(new, recorded)]
            for k, sp in enumerate(spans):
                a, b, v = sp["start_token"], sp["end_token"], sp["policy_version"]
                if v in checkpoints:
                    own = under(v, prompt, reply)
                    record_err += [abs(own[i] - recorded[i]) for i in range(a, b)]
                where = "single" if kind == "single" else ("before_swap" if k == 0 else "after_swap")
                log_ratio[where] += [new[i] - recorded[i] for i in range(a, b)]
                call_ratios += [new[i] - recorded[i] for i in range(a, b)]
        per_call.append({"from_step": s, "groups": len({t["group"] for t in call["trajectories"]}),
                         "tokens": len(call_ratios), "token_policy_age": age.get(s + 1),
                         **{f"{sign}_advantage_tokens": len(w) for sign, w in weights.items()},
                         **{f"{sign}_advantage_mean_weight": statistics.fmean(w) if w else None
                            for sign, w in weights.items()},
                         "mean_ratio": statistics.fmean(math.exp(x) for x in call_ratios) if call_ratios else None,
                         "loss_mean_ratio": call["metrics"].get("train/mean_ratio")})

    def ratio_summary(values: list[float]) -> dict[str, Any]:
        if not values:
            return {"tokens": 0}
        r = sorted(math.exp(x) for x in values)
        return {"tokens": len(r), "mean_ratio": statistics.fmean(r), "median": statistics.median(r),
                "p05": r[int(0.05 * (len(r) - 1))], "p95": r[int(0.95 * (len(r) - 1))],
                "mean_log_ratio": statistics.fmean(values)}

    def reply_summary(items: list[dict[str, Any]]) -> dict[str, Any]:
        if not items:
            return {"n": 0}
        return {"n": len(items), "mean_reward": statistics.fmean(i["reward"] for i in items),
                "valid": statistics.fmean(float(i["valid"] or 0) for i in items),
                "mean_len": statistics.fmean(i["len"] for i in items),
                "cut_at_length": statistics.fmean(i["finish"] == "length" for i in items)}

    return {"replies_spanning_versions": len(replies["multi"]) / max(1, len(replies["multi"]) + len(replies["single"])),
            "record_abs_err_max": max(record_err, default=None),
            "record_abs_err_mean": statistics.fmean(record_err) if record_err else None,
            "record_tokens_checked": len(record_err),
            "ratio": {k: ratio_summary(v) for k, v in log_ratio.items()},
            "replies": {k: reply_summary(v) for k, v in replies.items()}, "calls": per_call}


def grammar_mass(out: Path) -> dict[str, Any]:
    """Over the tokens of multi-version replies sampled after a swap: the mean logprob difference (start version
    minus sampling version) raw, as the record and the trainer hold it, and within the grammar the replies were
    sampled under (the program's forced tool call, compiled as the server compiles it), with the log of the mass
    each version puts on the grammar's allowed tokens. Sampling from the grammar-masked distribution makes the
    masked difference at most 0 in expectation; the raw one also carries log(Z_start / Z_sampler). And over every
    trained token, log(Z_trained_from / Z_sampler): the factor the grammar's mass puts into the raw ratio the loss
    weighs that token by."""
    program = ppl.load_program(ppl.PROGRAMS_DIR / ppl.PROGRAMS["binary_prefix"])
    base_path = (out / "base_model").read_text()
    model = ppl.model_with_checkpoints(base_path, ppl.run_dir(out / ".art"))
    grammar, vocab = ppl.tool_call_grammar(base_path, program)

    raw, masked, mass_start, mass_sampler, refused, replies = [], [], [], [], 0, 0
    drift: list[float] = []  # every trained token: log Z under the weights trained from minus under its sampler
    for call in (json.loads(line) for line in (out / CALLS_FILE).read_text().splitlines()):
        for t in call["trajectories"]:
            start, prompt, reply = t["initial_version"], t["prompt_ids"], t["token_ids"]
            spans = t["spans"] or [{"start_token": 0, "end_token": len(reply), "policy_version": start}]
            allowed = ppl.allowed_tokens(grammar, vocab, reply)
            if allowed is None:
                refused += 1  # a reply the grammar does not replay: counted, left out
                continue
            versions = {sp["policy_version"] for sp in spans}
            picked, mass = {}, {}  # per version: each sampled token's logprob, and the log mass on allowed tokens
            for v in versions | {start, call["from_step"]}:
                model.set_adapter(f"v{v}")
                picked[v], mass[v] = ppl.picked_and_mass(ppl.reply_logprobs(model, prompt, reply), reply, allowed)
            for sp in spans:
                v = sp["policy_version"]
                for i in range(sp["start_token"], sp["end_token"]):
                    drift.append(mass[call["from_step"]][i] - mass[v][i])
                    if v == start or len(versions) < 2:  # the tokens of replies that changed version, after the swap
                        continue
                    diff = picked[start][i] - picked[v][i]
                    raw.append(diff)
                    masked.append(diff - (mass[start][i] - mass[v][i]))
                    mass_start.append(mass[start][i])
                    mass_sampler.append(mass[v][i])
            replies += len(versions) > 1
    mean = statistics.fmean
    return {"replies": replies, "replies_the_grammar_refused": refused, "tokens": len(raw),
            "mean_raw_difference": mean(raw) if raw else None,
            "mean_masked_difference": mean(masked) if masked else None,
            "mean_log_allowed_mass_start": mean(mass_start) if raw else None,
            "mean_log_allowed_mass_sampler": mean(mass_sampler) if raw else None,
            "share_of_tokens_where_start_has_more_allowed_mass": mean(a > b for a, b in zip(mass_start, mass_sampler))
            if raw else None,
            # what the grammar's mass does to every trained token's raw ratio: log(Z_trained_from / Z_sampler)
            "trained_tokens": len(drift),
            "mean_log_allowed_mass_trained_from_minus_sampler": mean(drift) if drift else None}


def curve(out: Path, samples: int, replicate: int, sizes: dict[str, str]) -> list[dict[str, Any]]:
    """The benchmark's held-out eval (seeded replies at the rollouts' temperature) of every checkpoint of the run."""
    import artrl as art
    from artrl.run import storage

    program = ppl.load_program(ppl.PROGRAMS_DIR / ppl.PROGRAMS["binary_prefix"])
    run = ppl.run_dir(out / ".art")

    class AtStep:  # the model, its inference name pinned to one checkpoint (`name@step`)
        def __init__(self, model: Any, step: int) -> None:
            self.model, self.step = model, step

        def openai_client(self) -> Any:
            return self.model.openai_client()

        def get_inference_name(self) -> str:
            return self.model.get_inference_name(step=self.step)

    async def main() -> list[dict[str, Any]]:
        backend = art.LocalBackend(path=str(out / ".art"), show_progress=False)
        try:
            model = art.TrainableModel(name=run.name, project=run.parent.parent.name,
                                       base_model=(out / "base_model").read_text())
            await model.register(backend)
            steps = storage.list_checkpoints(run)
            rows = []
            for step in steps:
                rewards = await ppl.sample_eval("binary_prefix", program, AtStep(model, step), replicate, samples,
                                                sizes)
                rows.append({"step": step, "reward": statistics.fmean(rewards),
                             "zero": statistics.fmean(r == 0 for r in rewards)})
            return rows
        finally:
            backend.close()

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("step_lora", "in_flight_lora"), default="in_flight_lora")
    p.add_argument("--out", type=Path, help="record a run into this directory, then analyze it")
    p.add_argument("--analyze", type=Path, help="analyze a recorded run only")
    p.add_argument("--grammar-mass", action="store_true",
                   help="also compare, on the tokens sampled after a swap, the start and sampling versions' logprobs "
                        "raw and within the tool call's grammar, with each version's mass on the allowed tokens")
    p.add_argument("--curve", type=int, default=0, metavar="SAMPLES",
                   help="also evaluate every checkpoint with the benchmark's eval, this many replies (0: not)")
    p.add_argument("--set", action="append", default=[], metavar="K=V", help="override a size (as the benchmark)")
    p.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "artrl-pipeline-programs-learn",
                   help="the benchmark's primed models (built there when missing)")
    args = p.parse_args(argv)
    sizes = {**ppl.SIZES["binary_prefix"], **dict(kv.split("=", 1) for kv in args.set)}
    if args.out is not None:
        program = ppl.load_program(ppl.PROGRAMS_DIR / ppl.PROGRAMS["binary_prefix"])
        base_model = ppl.prime("binary_prefix", program, args.cache / "binary_prefix")
        record(args.mode, args.out, base_model, sizes)
    target = args.analyze or args.out
    if target is None:
        p.error("give --out or --analyze")
    mode_file = target / "mode"
    summary = {"mode": mode_file.read_text().strip() if mode_file.exists() else None, **analyze(target)}
    if args.grammar_mass:
        summary["grammar_mass"] = grammar_mass(target)
    if args.curve:
        summary["curve"] = curve(target, args.curve, 0, sizes)
    (target / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
