"""The tasks of `python benchmarks/bench.py learn`: prompts, a grader, a completion budget, a starting model.

Each task differs in the shape of its reward, so a step definition or a loss
that only works for one shape shows up:

* **vowels** (dense, continuous): any prompt; the reward is the share of vowels
  (a, e, i, o, u) among the ASCII letters of the reply, 0 for a reply without
  letters. The untrained tiny model replies with gibberish whose share varies
  from reply to reply, so every group carries signal from the first step, and
  the policy can raise it by preferring vowel-rich tokens.
* **nodigit** (binary): any prompt; 1 for a reply without a digit, else 0. The
  untrained model's replies often contain number tokens ("145", "79"), so about
  half the groups are mixed; the rest carry no signal (all 0 or all 1).
* **colours** (graded, sparse in its top value): the demo's colour quiz
  (`artrl.tasks.colours`) and its grader: 1 for the bare right colour, 0.3
  hedged, 0.1 a wrong colour, else 0. A random-init model never names a colour,
  so this task starts, like the demo's RL stage, from the tiny model after the
  demo's SFT warm-up (`warm_up_colours`): the warmed-up adapter is merged into
  the base weights and saved as a local model directory, and both arms put a
  fresh LoRA adapter on top of it. RL then has the demo's job: make the bare
  answer the rule and sharpen the facts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from artrl.errors import ConfigError
from artrl.tasks import colours

log = logging.getLogger(__name__)

VOWELS: Final = frozenset("aeiou")

GENERIC_PROMPTS: Final = (
    "Say a word.", "Tell me something.", "Describe the sky.", "Name an animal.", "What is your favourite food?",
    "Write a short line.", "Greet me.", "Give me a name.", "Describe a city.", "What did you do today?",
    "Name a colour.", "Tell me about the sea.", "Say something kind.", "What is the weather like?",
    "Name a fruit.", "Describe your home.", "Tell me a secret.", "What is music?", "Name a place.",
    "Say hello.", "Describe a tree.", "What time is it?", "Name a friend.", "Tell me a story.",
)
"""Prompts of the tasks whose reward ignores the question (24, a step draws `--prompts` of them)."""

WARMUP_MARKER: Final = "artrl_bench_warmup.json"
"""Written last into a warmed-up model directory; a directory without it is never used."""


@dataclass(frozen=True)
class Prompt:
    """One question of a task: a stable key (recorded per step), its chat messages, the grader's target."""

    key: str
    messages: tuple[dict[str, str], ...]
    target: str = ""


@dataclass(frozen=True)
class LearnTask:
    """A task: its prompts, how a reply is graded, its completion budget, and whether it starts warmed up."""

    name: str
    reward_shape: str
    max_tokens: int
    prompts: tuple[Prompt, ...]
    grade: Callable[[str, Prompt], float] = field(repr=False)
    warm_up: bool = False


def vowel_share(text: str) -> float:
    """Share of vowels among the ASCII letters of `text` (0.0 without letters): "Aeb!" -> 2/3."""
    letters = [c for c in text.lower() if "a" <= c <= "z"]
    return sum(c in VOWELS for c in letters) / len(letters) if letters else 0.0


def no_digit(text: str) -> float:
    """1.0 when `text` holds no ASCII digit, else 0.0."""
    return 0.0 if any("0" <= c <= "9" for c in text) else 1.0


def _generic(name: str) -> tuple[Prompt, ...]:
    return tuple(Prompt(f"{name}/{i}", ({"role": "user", "content": p},)) for i, p in enumerate(GENERIC_PROMPTS))


def _colour_prompts() -> tuple[Prompt, ...]:
    return tuple(Prompt(f"colours/{s.obj}/{colours.TRAIN_TEMPLATES.index(s.template)}",
                        tuple(s.messages()), target=s.colour) for s in colours.scenarios("train"))


TASKS: Final[dict[str, LearnTask]] = {
    "vowels": LearnTask("vowels", "dense", 16, _generic("vowels"), lambda text, p: vowel_share(text)),
    "nodigit": LearnTask("nodigit", "binary", 8, _generic("nodigit"), lambda text, p: no_digit(text)),
    "colours": LearnTask("colours", "graded", colours.MAX_TOKENS, _colour_prompts(),
                         lambda text, p: colours.reward(text, p.target), warm_up=True),
}
"""Every task `python benchmarks/bench.py learn --tasks` knows, by name."""


def get_task(name: str) -> LearnTask:
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError(f"unknown learning-benchmark task {name!r}; known tasks: {sorted(TASKS)}") from None


def prompt_schedule(task: LearnTask, seed: int, steps: int, prompts: int) -> list[list[Prompt]]:
    """The prompts of every step of a run: `prompts` distinct ones per step, drawn from `(task, seed)` alone."""
    if prompts > len(task.prompts):
        raise ConfigError(f"--prompts {prompts} exceeds the {len(task.prompts)} prompts of task {task.name!r}; "
                          "lower it")
    rng = random.Random(f"{task.name}:{seed}")  # a str seed hashes the same in every process
    return [rng.sample(task.prompts, prompts) for _ in range(steps)]


# ---------------------------------------------------------------- colours warm-up


@dataclass(frozen=True)
class WarmUp:
    """The demo's SFT warm-up (`artrl.demo.DemoConfig` defaults): epochs of the 96 examples, cosine lr."""

    epochs: int = 20
    learning_rate: float = 1e-2
    batch_size: int = 8
    seed: int = 0

    def fingerprint(self, base_model: str) -> str:
        from artrl.models.tiny import BUILTIN_MODELS, build_fingerprint

        base = build_fingerprint(base_model) if base_model in BUILTIN_MODELS else base_model
        recipe = {"base": base, "warmup": self.__dict__, "data": [t.model_dump(mode="json", include={
            "messages_and_choices"}) for t in colours.sft_trajectories()]}
        return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


async def warm_up_colours(base_model: str, directory: Path, warm: WarmUp) -> Path:
    """The colour quiz's starting model: `base_model` after the demo's SFT, merged, in `directory`.

    Built once per recipe (`WarmUp.fingerprint`) through the public API (a TrainableModel on a
    LocalBackend in a temporary directory, one `train_sft` call), then the adapter is merged into
    the base weights and the model and tokenizer are saved; the directory is renamed into place
    with a marker written last, so a crash never leaves a half-built model that a later run uses.
    """
    from artrl.train import schedules
    from artrl.local import LocalBackend
    from artrl.model import TrainableModel
    from artrl.config.model import InternalModelConfig
    from artrl.types import TrainSFTConfig

    final = directory / f"colours-warmup-{warm.fingerprint(base_model)}"
    if (final / WARMUP_MARKER).exists():
        log.info("colours: reusing the warmed-up model %s", final)
        return final
    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=directory))
    try:
        examples = colours.sft_trajectories()
        rng = random.Random(warm.seed)
        data = []
        for _ in range(warm.epochs):
            epoch = list(examples)
            rng.shuffle(epoch)
            data += epoch
        n_steps = -(-len(data) // warm.batch_size)
        log.info("colours: SFT warm-up, %d examples x %d epochs (%d optimizer steps)", len(examples), warm.epochs,
                 n_steps)
        model = TrainableModel(name="warmup", project="bench-learn", base_model=base_model,
                               _internal_config=InternalModelConfig(seed=warm.seed, device="cpu"))
        backend = LocalBackend(path=str(tmp / "runs"), show_progress=False)
        try:
            await model.register(backend)
            result = await model.train_sft(data, config=TrainSFTConfig(
                learning_rate=schedules.cosine(warm.learning_rate, n_steps), batch_size=warm.batch_size))
        finally:
            backend.close()
        if result.checkpoint_path is None:
            raise ConfigError(f"the colours warm-up trained nothing ({result.metrics}); see the log above")
        _merge(base_model, result.checkpoint_path, tmp / "model")
        shutil.rmtree(tmp / "runs")
        model_dir = tmp / "model"
        (model_dir / WARMUP_MARKER).write_text(json.dumps({"base_model": base_model, "warmup": warm.__dict__}))
        from artrl.runtime.fs import fsync_dir, fsync_tree

        fsync_tree(model_dir)
        try:
            os.rename(model_dir, final)
        except OSError:
            if not (final / WARMUP_MARKER).exists():  # not a concurrent build that won the race
                raise
        fsync_dir(directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _merge(base_model: str, adapter_dir: str, out: Path) -> None:
    """Fold the LoRA adapter in `adapter_dir` into `base_model`'s weights; save model and tokenizer to `out`."""
    import warnings

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from artrl.models.tiny import resolve_model_path
    from artrl.models.tokenizer import load_tokenizer

    path = resolve_model_path(base_model)
    base: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with warnings.catch_warnings():  # peft asks transformers a deprecated question; nothing for a user to do
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(str(out))
    load_tokenizer(base_model).save_pretrained(str(out))
