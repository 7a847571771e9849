"""Trajectories -> token ids, trainable mask, sampled logprobs, advantages.

How a conversation becomes tokens (and why it lines up with sampling):

1. Every trainable assistant turn is replaced by a unique placeholder string and
   the whole conversation (tools included) is rendered with the tokenizer's chat
   template to text.
2. The text is split at the placeholders; each piece of template text is
   tokenized on its own, exactly as the inference server tokenized the rendered
   prompt that ended at the generation prompt (`<|im_start|>assistant\\n`).
3. Each placeholder becomes the turn's tokens:
   * a `Choice` that carries the ids the server sampled (`choice.token_ids`, or
     vLLM-style `token_id:N` logprob tokens) contributes those ids verbatim,
     with its logprobs aligned one to one: tokens in, tokens out. The template's
     own end-of-turn token right after it is dropped when the sampled ids
     already end with one (the model stopped there).
   * a `Choice` without ids falls back to re-tokenising its message (counted in
     `retokenized_turns`); its logprobs are used only if the counts agree.
   * a plain assistant dict (SFT) is rendered by the template itself; its tokens
     up to and including the end-of-turn token are trainable.

Which turns are trainable: for RL, the sampled turns (Choices); for SFT, every
assistant turn. Advantages are group-relative: reward minus the group mean,
divided by the group std when `scale_rewards`; a group whose advantages are all
zero teaches nothing and is skipped and counted.

Everything here is plain Python over lists, independent of any model.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from openai.types.chat.chat_completion import Choice

from ..errors import TrajectoryError
from ..trajectories import History, Trajectory, TrajectoryGroup, message_of, revalidate

log = logging.getLogger(__name__)

_PLACEHOLDER = "@@ARTRL_TURN_{}@@"
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


@dataclass
class TokenizedSequence:
    """One conversation as tokens. Lists are aligned index by index."""

    token_ids: list[int]
    trainable_mask: list[bool]  # True on trainable (sampled) tokens
    logprobs: list[float]  # sampled logprob of each token; nan where unknown or not trainable
    advantage: float = 0.0
    weight: float = 1.0
    group_index: int = 0
    trajectory_index: int = 0
    history_index: int = 0  # 0 = main conversation, k = additional_histories[k-1]

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def first_trainable(self) -> int:
        for i, m in enumerate(self.trainable_mask):
            if m:
                return i
        return len(self.token_ids)

    @property
    def n_trainable(self) -> int:
        return sum(self.trainable_mask)

    @property
    def positions(self) -> list[int]:
        return list(range(len(self.token_ids)))

    @property
    def name(self) -> str:
        h = f", history {self.history_index}" if self.history_index else ""
        return f"group {self.group_index}, trajectory {self.trajectory_index}{h}"


@dataclass
class TokenizeStats:
    groups: int = 0
    trajectories: int = 0
    sequences: int = 0
    trainable_tokens: int = 0
    groups_skipped_zero_advantage: int = 0
    groups_skipped_empty: int = 0
    trajectories_without_trainable_tokens: int = 0
    retokenized_turns: int = 0
    turns_missing_logprobs: int = 0
    rollout_exceptions: int = 0

    def as_metrics(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.__dict__.items()}


@dataclass
class TokenizeResult:
    """Tokenized sequences, grouped as their TrajectoryGroups were (skipped groups omitted)."""

    groups: list[list[TokenizedSequence]]
    stats: TokenizeStats = field(default_factory=TokenizeStats)

    @property
    def sequences(self) -> list[TokenizedSequence]:
        return [s for g in self.groups for s in g]


def end_of_turn_ids(tokenizer: Any) -> set[int]:
    """Token ids that end an assistant turn for this tokenizer (eos and known chat end tokens)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    for tok in _END_OF_TURN_TOKENS:
        if tok in vocab:
            ids.add(int(vocab[tok]))
    return ids


def _encode(tokenizer: Any, text: str) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _flatten_content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)


def sampled_token_ids(choice: Choice) -> list[int] | None:
    """The ids the server sampled for a Choice, if it returned them."""
    extra = choice.model_extra or {}
    ids = extra.get("token_ids")
    if ids is not None:
        return [int(i) for i in ids]
    content = choice.logprobs.content if choice.logprobs is not None else None
    if content and all(lp.token.startswith("token_id:") for lp in content):
        try:
            return [int(lp.token.split(":", 1)[1]) for lp in content]
        except ValueError:
            return None
    return None


def _choice_logprobs(choice: Choice, n_tokens: int, where: str) -> list[float] | None:
    """Sampled logprobs of a Choice aligned to its n_tokens ids; None if it carries none."""
    if choice.logprobs is None or choice.logprobs.content is None:
        return None
    values = [lp.logprob for lp in choice.logprobs.content]
    if len(values) != n_tokens:
        raise TrajectoryError(
            f"{where}: the choice has {n_tokens} sampled token ids but {len(values)} logprobs; "
            "logprobs must align one to one with the sampled tokens. Record the response unchanged."
        )
    for i, v in enumerate(values):
        if not math.isfinite(v) or v > 1e-3:
            raise TrajectoryError(
                f"{where}: logprobs.content[{i}].logprob is {v}; sampled logprobs must be finite and <= 0."
            )
    return values


def tokenize_history(
    messages_and_choices: Sequence[Any],
    tools: list[dict[str, Any]] | None,
    tokenizer: Any,
    *,
    train_on: Literal["sampled", "assistant"] = "sampled",
    where: str = "trajectory",
    stats: TokenizeStats | None = None,
) -> TokenizedSequence:
    """Tokenize one conversation.

    Args:
        train_on: "sampled" marks only Choice turns trainable (RL); "assistant"
            marks every assistant turn (SFT).
        where: a name for error messages, e.g. "group 2, trajectory 5".
    """
    stats = stats if stats is not None else TokenizeStats()
    if not messages_and_choices:
        # nothing to render (templates refuse an empty conversation) and nothing to train
        return TokenizedSequence(token_ids=[], trainable_mask=[], logprobs=[])
    eot = end_of_turn_ids(tokenizer)
    template_messages: list[dict[str, Any]] = []
    # (kind, payload) per placeholder: ("ids", (ids, logprobs)) or ("render", None)
    turns: list[tuple[str, Any]] = []
    for i, item in enumerate(messages_and_choices):
        msg = message_of(item)
        trainable = isinstance(item, Choice) if train_on == "sampled" else msg.get("role") == "assistant"
        if not trainable:
            template_messages.append(msg if isinstance(msg.get("content"), (str, type(None))) else
                                     {**msg, "content": _flatten_content(msg.get("content"))})
            continue
        ph = _PLACEHOLDER.format(len(turns))
        ids = sampled_token_ids(item) if isinstance(item, Choice) else None
        if ids is not None:
            if not ids:
                raise TrajectoryError(f"{where}: messages_and_choices[{i}] is a Choice with no sampled tokens.")
            lps = _choice_logprobs(item, len(ids), f"{where}: messages_and_choices[{i}]")
            if lps is None:
                stats.turns_missing_logprobs += 1
            template_messages.append({"role": "assistant", "content": ph})
            turns.append(("ids", (ids, lps)))
        else:
            if isinstance(item, Choice):
                stats.retokenized_turns += 1
            entry: dict[str, Any] = {"role": "assistant", "content": ph + _flatten_content(msg.get("content"))}
            if msg.get("tool_calls"):
                entry["tool_calls"] = msg["tool_calls"]
            template_messages.append(entry)
            turns.append(("render", item if isinstance(item, Choice) else None))

    try:
        text = tokenizer.apply_chat_template(template_messages, tools=tools or None, tokenize=False)
    except Exception as e:  # template errors come in many types (jinja, TypeError, ...)
        hint = " (the chat template may not support tools)" if tools else ""
        raise TrajectoryError(f"{where}: the chat template could not render the conversation{hint}: "
                              f"{type(e).__name__}: {e}") from None
    pieces: list[str] = []
    rest = text
    for k in range(len(turns)):
        ph = _PLACEHOLDER.format(k)
        if rest.count(ph) != 1:
            raise TrajectoryError(
                f"{where}: the chat template rendered assistant turn {k} {rest.count(ph)} times; artrl needs "
                "templates that render each assistant message's content once and unchanged."
            )
        before, rest = rest.split(ph, 1)
        pieces.append(before)
    pieces.append(rest)

    token_ids: list[int] = _encode(tokenizer, pieces[0])
    mask: list[bool] = [False] * len(token_ids)
    logprobs: list[float] = [math.nan] * len(token_ids)
    for k, (kind, payload) in enumerate(turns):
        after = _encode(tokenizer, pieces[k + 1])
        if kind == "ids":
            ids, lps = payload
            token_ids += ids
            mask += [True] * len(ids)
            logprobs += lps if lps is not None else [math.nan] * len(ids)
            if ids[-1] in eot:
                # the template closes the turn itself; the model already sampled the end token
                cut = next((j for j, t in enumerate(after) if t in eot), None)
                if cut is not None:
                    after = after[cut + 1:]
            token_ids += after
            mask += [False] * len(after)
            logprobs += [math.nan] * len(after)
        else:
            end = next((j + 1 for j, t in enumerate(after) if t in eot), len(after))
            token_ids += after
            mask += [True] * end + [False] * (len(after) - end)
            turn_lps = [math.nan] * end
            choice = payload
            if choice is not None:
                values = None
                if choice.logprobs is not None and choice.logprobs.content is not None:
                    values = [lp.logprob for lp in choice.logprobs.content]
                if values is not None and len(values) == end:
                    turn_lps = values
                else:
                    stats.turns_missing_logprobs += 1
            logprobs += turn_lps + [math.nan] * (len(after) - end)
    return TokenizedSequence(token_ids=token_ids, trainable_mask=mask, logprobs=logprobs)


def group_advantages(rewards: Sequence[float], scale: bool) -> list[float]:
    """Reward minus group mean, divided by the group's (population) std when `scale`."""
    n = len(rewards)
    mean = sum(rewards) / n
    adv = [r - mean for r in rewards]
    if scale:
        std = math.sqrt(sum(a * a for a in adv) / n)
        adv = [a / (std + 1e-6) for a in adv]
    return adv


def _tokenize_trajectory(
    traj: Trajectory, tokenizer: Any, train_on: Literal["sampled", "assistant"], gi: int, ti: int,
    advantage: float, stats: TokenizeStats,
) -> list[TokenizedSequence]:
    out = []
    histories: list[History | Trajectory] = [traj, *traj.additional_histories]
    for hi, h in enumerate(histories):
        where = f"group {gi}, trajectory {ti}" + (f", additional_histories[{hi - 1}]" if hi else "")
        seq = tokenize_history(h.messages_and_choices, h.tools, tokenizer, train_on=train_on, where=where,
                               stats=stats)
        seq.group_index, seq.trajectory_index, seq.history_index = gi, ti, hi
        seq.advantage = advantage
        if seq.n_trainable:
            out.append(seq)
    return out


def tokenize_groups(
    groups: Sequence[TrajectoryGroup],
    tokenizer: Any,
    *,
    scale_rewards: bool = True,
    allow_training_without_logprobs: bool = False,
) -> TokenizeResult:
    """Tokenize RL groups: sampled turns trainable, group-relative advantages."""
    stats = TokenizeStats()
    result = TokenizeResult(groups=[], stats=stats)
    for gi, group in enumerate(groups):
        if not isinstance(group, TrajectoryGroup):
            raise TrajectoryError(f"groups[{gi}] has type {type(group).__name__}; expected a TrajectoryGroup.")
        stats.groups += 1
        stats.rollout_exceptions += len(group.exceptions)
        trajs = list(group.trajectories)
        stats.trajectories += len(trajs)
        if not trajs:
            stats.groups_skipped_empty += 1
            continue
        for ti, traj in enumerate(trajs):
            revalidate(traj, f"group {gi}, trajectory {ti}")
        advantages = group_advantages([t.reward for t in trajs], scale_rewards)
        if all(a == 0 for a in advantages):
            stats.groups_skipped_zero_advantage += 1
            continue
        seqs: list[TokenizedSequence] = []
        for ti, (traj, adv) in enumerate(zip(trajs, advantages)):
            before = stats.turns_missing_logprobs
            got = _tokenize_trajectory(traj, tokenizer, "sampled", gi, ti, adv, stats)
            if stats.turns_missing_logprobs > before and not allow_training_without_logprobs:
                raise TrajectoryError(
                    f"group {gi}, trajectory {ti}: a sampled turn carries no logprobs. Request "
                    "logprobs=True from the server, or set TrainConfig(allow_training_without_logprobs="
                    "True) to train such turns as on-policy (importance ratio 1)."
                )
            if not got:
                stats.trajectories_without_trainable_tokens += 1
                log.warning("group %d, trajectory %d has no sampled (Choice) turn; skipped", gi, ti)
            seqs += got
        if seqs:
            result.groups.append(seqs)
    stats.sequences = len(result.sequences)
    stats.trainable_tokens = sum(s.n_trainable for s in result.sequences)
    return result


def tokenize_sft(trajectories: Sequence[Trajectory], tokenizer: Any) -> TokenizeResult:
    """Tokenize SFT data: every assistant turn trainable; each trajectory its own group."""
    stats = TokenizeStats()
    result = TokenizeResult(groups=[], stats=stats)
    for ti, traj in enumerate(trajectories):
        revalidate(traj, f"trajectories[{ti}]")
        stats.trajectories += 1
        got = _tokenize_trajectory(traj, tokenizer, "assistant", ti, 0, 0.0, stats)
        if not got:
            stats.trajectories_without_trainable_tokens += 1
            log.warning("trajectory %d has no assistant turn; skipped", ti)
            continue
        for s in got:
            s.trajectory_index = ti
        result.groups.append(got)
    stats.groups = len(result.groups)
    stats.sequences = len(result.sequences)
    stats.trainable_tokens = sum(s.n_trainable for s in result.sequences)
    return result
