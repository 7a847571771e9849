"""Tokenize's entry points: ART's `art.tokenize` / `art.tensorize` over trajectories or groups, and the trainer's
`tokenize_groups` (RL) and `tokenize_sft` (SFT), which check each trajectory and turn its conversations into the
`TokenizedSequence`s that preprocess/ packs.

One conversation's tokenizing is sequences.py's; ART's per-item types and one trajectory's tokenizing are
tokens.py's; this module dispatches over groups and trajectories (data.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Literal

from openai.types.chat.chat_completion import Choice

from ..errors import TrajectoryError
from .data import Trajectory, TrajectoryGroup, revalidate
from .history import LegacyHistory, record_histories
from .sequences import TokenizedSequence, TokenizeResult, TokenizeStats, group_advantages, tokenize_history
from .tokens import prepare, tokenize_group, tokenize_trajectory

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- ART's entry points


def _trajectory(value: Any, where: str) -> Trajectory:
    if not isinstance(value, Trajectory):
        raise TypeError(f"{where} has type {type(value).__name__}; expected a Trajectory.")
    return value


def _run(items: Iterable[Any], multi_history: bool, reconcile: bool, model: str | None, base_model: str | None,
         tokenizer: Any, chat_template: str | None, chat_template_kwargs: Mapping[str, object] | None) -> list[Any]:
    tok, end_ids, label = prepare(model, base_model, tokenizer, chat_template, chat_template_kwargs)
    values = list(items)
    if all(isinstance(v, TrajectoryGroup) for v in values):
        return [tokenize_group(g, tok, end_ids, label, model, multi_history, f"groups[{gi}]", reconcile)
                for gi, g in enumerate(values)]
    if any(isinstance(v, TrajectoryGroup) for v in values):
        raise TypeError("art.tokenize takes trajectories or trajectory groups, not a mix of both.")
    return [tokenize_trajectory(_trajectory(t, f"items[{i}]"), tok, end_ids, label, model, multi_history,
                                f"items[{i}]", reconcile)
            for i, t in enumerate(values)]


async def tokenize(items: Iterable[Trajectory] | Iterable[TrajectoryGroup], *, multi_history: bool = False,
                   reconcile_text_equivalent_tokenizations: bool = False, model: str | None = None,
                   base_model: str | None = None, tokenizer: Any = None, chat_template: str | None = None,
                   chat_template_kwargs: Mapping[str, object] | None = None) -> list[Any]:
    """Tokenize trajectories (or groups) as training sees them (module docstring); order kept."""
    return await asyncio.to_thread(_run, items, multi_history, reconcile_text_equivalent_tokenizations, model,
                                   base_model, tokenizer, chat_template, chat_template_kwargs)


async def tensorize(items: Iterable[Trajectory] | Iterable[TrajectoryGroup], *, multi_history: bool = False,
                    reconcile_text_equivalent_tokenizations: bool = False, model: str | None = None,
                    base_model: str | None = None, tokenizer: Any = None, chat_template: str | None = None,
                    chat_template_kwargs: Mapping[str, object] | None = None, device: Any = None) -> list[Any]:
    """`tokenize`, as torch tensors on `device` (CPU by default)."""
    tokenized = await tokenize(items, multi_history=multi_history,
                               reconcile_text_equivalent_tokenizations=reconcile_text_equivalent_tokenizations,
                               model=model, base_model=base_model, tokenizer=tokenizer, chat_template=chat_template,
                               chat_template_kwargs=chat_template_kwargs)
    return [t.tensorize(device=device) for t in tokenized]


# --------------------------------------------------------------------------- the trainer's entry points


def _has_assistant_dict(traj: Trajectory) -> bool:
    """Whether a turn of `traj` (or of its additional histories) is an assistant message given as a plain dict."""
    return any(isinstance(item, dict) and item.get("role") == "assistant"
               for h in (traj, *traj.additional_histories) for item in h.messages_and_choices)


def _warn_untrainable(skipped: list[tuple[int, int, bool]], train_dicts: bool) -> None:
    """One warning per call for the trajectories with no trainable turn, saying why and what to do."""
    where = ", ".join(f"group {gi} trajectory {ti}" for gi, ti, _ in skipped[:3]) + (
        f" and {len(skipped) - 3} more" if len(skipped) > 3 else "")
    if not train_dicts and any(has_dict for _, _, has_dict in skipped):
        log.warning(
            "%d trajectories have no trainable turn and were skipped (%s): their assistant turns are plain dicts. "
            "RL trains the Choice objects the inference server returned (response.choices[0], which carry the "
            "prompt and sampled token ids and their logprobs), not text: put the Choice itself in "
            "messages_and_choices. To train on text replies, use model.train_sft(...), or "
            "TrainConfig(allow_training_without_logprobs=True) to train such turns as on-policy (ART's option).",
            len(skipped), where)
    else:
        log.warning("%d trajectories have no trainable turn (no Choice%s) and were skipped (%s)", len(skipped),
                    ", no assistant message" if train_dicts else "", where)


def _tokenize_trajectory(
    traj: Trajectory, tokenizer: Any, train_on: Literal["sampled", "assistant", "last"], gi: int, ti: int,
    advantage: float, stats: TokenizeStats, train_dicts: bool, end_ids: Collection[int] | None,
    vision: Any = None, name: str | None = None,
) -> list[TokenizedSequence]:
    """`name`: the trajectory in error messages (default "group {gi}, trajectory {ti}"). With train_on="last"
    only the trajectory's own conversation is read (its final message), not its additional histories."""
    out = []
    base = name or f"group {gi}, trajectory {ti}"
    if traj.exchanges:  # captured exchanges: their turns carry the same record (token_record.py)
        named: list[tuple[LegacyHistory | Trajectory, str]] = record_histories(traj.exchanges, base)
    else:
        named = [(traj, base), *((h, f"{base}, additional_histories[{k}]")
                                 for k, h in enumerate(traj.additional_histories))]
        if train_on == "last":  # ART 0.5.23's assistant_turns="last": the trajectory's own final reply only
            named = named[:1]
    for hi, (h, where) in enumerate(named):
        for seq in tokenize_history(h.messages_and_choices, h.tools, tokenizer, train_on=train_on,
                                    train_dicts=train_dicts, end_ids=end_ids, where=where, stats=stats,
                                    vision=vision):
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
    require_logprobs: bool = False,
    end_ids: Collection[int] | None = None,
    vision: Any = None,
) -> TokenizeResult:
    """Tokenize RL groups: sampled turns trainable, group-relative advantages.

    Args:
        allow_training_without_logprobs: ART's meaning: plain assistant dicts are trained too,
            as on-policy (sampled turns without logprobs always are, unless require_logprobs).
        require_logprobs: refuse a sampled turn without logprobs (TrajectoryError naming it).
        end_ids: ids that end a turn (`chat_format.end_of_turn_ids(tokenizer, model)`, as the engine stops on).
        vision: a vision-language model's `models.vision.VisionInputs` (None: text only).
    """
    stats = TokenizeStats()
    result = TokenizeResult(groups=[], stats=stats)
    untrainable: list[tuple[int, int, bool]] = []  # (group, trajectory, has an assistant dict)
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
            got = _tokenize_trajectory(traj, tokenizer, "sampled", gi, ti, adv, stats,
                                       train_dicts=allow_training_without_logprobs, end_ids=end_ids,
                                       vision=vision)
            if stats.turns_missing_logprobs > before and require_logprobs:
                raise TrajectoryError(
                    f"group {gi}, trajectory {ti}: a sampled turn carries no logprobs, and "
                    "TrainConfig(require_logprobs=True) refuses such turns. Record the choices our server "
                    "returns (they always carry logprobs), request logprobs=True from another server, or "
                    "leave require_logprobs off to train such turns as on-policy (importance ratio 1)."
                )
            if not got:
                stats.trajectories_without_trainable_tokens += 1
                untrainable.append((gi, ti, _has_assistant_dict(traj)))
            seqs += got
        if seqs:
            result.groups.append(seqs)
    if untrainable:
        _warn_untrainable(untrainable, allow_training_without_logprobs)
    stats.sequences = len(result.sequences)
    stats.trainable_tokens = sum(s.n_trainable for s in result.sequences)
    if stats.turns_missing_logprobs:  # the call's INFO line counts them too (train/call.py)
        log.debug("%d sampled turns carry no logprobs; trained as on-policy (importance ratio 1)",
                 stats.turns_missing_logprobs)
    return result


def tokenize_sft(trajectories: Sequence[Trajectory], tokenizer: Any, *,
                 end_ids: Collection[int] | None = None, vision: Any = None,
                 assistant_turns: Literal["all", "last"] = "all") -> TokenizeResult:
    """Tokenize SFT data: every assistant turn trainable, or with `assistant_turns="last"` (ART 0.5.23) only each
    trajectory's final message, which must be an assistant turn (TrajectoryError naming the trajectory
    otherwise); each trajectory its own group (`vision`: see `tokenize_groups`)."""
    if assistant_turns not in ("all", "last"):
        raise ValueError(f"assistant_turns={assistant_turns!r}; expected 'all' or 'last'")
    train_on: Literal["assistant", "last"] = "assistant" if assistant_turns == "all" else "last"
    stats = TokenizeStats()
    result = TokenizeResult(groups=[], stats=stats)
    for ti, traj in enumerate(trajectories):
        revalidate(traj, f"trajectories[{ti}]")
        if train_on == "last":
            items = traj.messages_and_choices
            final = items[-1] if items else None
            if final is None or not (isinstance(final, Choice) or final.get("role") == "assistant"):
                role = "none" if final is None else "a Choice" if isinstance(final, Choice) else final.get("role")
                raise TrajectoryError(
                    f"trajectories[{ti}]: assistant_turns='last' trains the final message, which must be an "
                    f"assistant turn; this trajectory ends with {role!r}. End it with the assistant reply to "
                    "learn, or use assistant_turns='all'.")
        stats.trajectories += 1
        got = _tokenize_trajectory(traj, tokenizer, train_on, ti, 0, 0.0, stats, train_dicts=True,
                                   end_ids=end_ids, vision=vision, name=f"trajectories[{ti}]")
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
