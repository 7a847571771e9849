"""Trajectories -> token ids, trainable mask, sampled logprobs, advantages.

Each sampled turn is trained on the server's token record (docs/token-record.md):

1. **The record.** A `Choice` from our server carries `prompt_token_ids` (the
   exact prompt it was sampled from) and `token_ids` (the ids it sampled, a final
   end-of-turn id included), with logprobs aligned one to one. Such a turn's
   context is those prompt ids and its trainable tokens are those sampled ids:
   tokens in, tokens out, nothing re-rendered.
2. **One sequence per chain.** The turns of one conversation are visited in
   order; a turn whose prompt starts with the sequence built so far (the previous
   turn's prompt + sampled ids) extends it: the new prompt tokens become context
   and its sampled ids trainable. A turn whose prompt does not (the chat template
   rewrote an earlier turn, e.g. Qwen3 dropping old `<think>` blocks, or the
   caller edited the history) starts a new sequence, so every sampled turn keeps
   exactly the context it was sampled from. Splits are counted
   (`record_splits`), with the context they hold again
   (`repeated_context_tokens`: per split, the shorter of the new prompt and the
   sequence before it, an upper bound); the packer stores a group's common
   prompt once.
3. **The fallback: rendering.** Trainable turns without a record (SFT data,
   choices from a server that returns no prompt ids, and, with
   `allow_training_without_logprobs`, plain assistant dicts in RL data) are
   trained on one rendering of the conversation: every such turn is replaced by
   a placeholder, the conversation is rendered with the chat template, the text
   between placeholders is tokenized piece by piece, and each placeholder becomes
   the turn's tokens: the sampled ids when the choice has them (a template
   end-of-turn token right after ids that end with one is dropped), else the
   template's rendering of the message through its end-of-turn token
   (`retokenized_turns`). These turns are counted (`rendered_turns`) in the
   call's metrics and summary line.

Images (a vision-language model's, `vision`: models/vision.py): a turn's prompt ids hold each image of its
messages as a run of image tokens, expanded exactly as the server expanded them (the same call). A record
names its prompt's images (`prompt_images`: content hash and processor grid, never the pixels); the
tokenizer loads the images of the messages before the turn again, finds each recorded one by its hash,
runs the processor and checks the grid, so the trainer sees the pixels the server saw. A turn extends the
sequence only when the images before its new tokens are the same images (two images of one size have the
same token ids). Each sequence keeps its images (first token, processed image) and, for Qwen-VL's 3-D
rotary positions, its own position ids. An image given to a model without a vision tower is refused,
naming the part.

Captured exchanges (a trajectory recorded by `with art.Trajectory() as t:`, in any wire protocol) are
first turned into conversations of such Choices, each carrying its record (token_record.py); from there
they train exactly as above.

Which turns are trainable: for RL, the sampled turns (Choices), plus assistant
dicts when `allow_training_without_logprobs` (ART's meaning: such turns train as
on-policy); for SFT, every assistant turn. A sampled turn without logprobs trains
as on-policy (importance ratio 1, `turns_missing_logprobs`) unless
`require_logprobs`. Advantages are group-relative: reward minus the group mean,
divided by the group std when `scale_rewards`; a group whose advantages are all
zero teaches nothing and is skipped and counted.

Everything here is plain Python over lists, independent of any model. The chat
format itself (validation, normalisation, end-of-turn ids) is `chat/format.py`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from openai.types.chat.chat_completion import Choice

from ..chat.format import (
    PLACEHOLDER,
    encode,
    end_of_turn_ids,
    render_text,
    split_at_placeholders,
    template_message,
    turn_marker,
)
from ..errors import TrajectoryError
from ..chat.images import ProcessedImage
from ..chat.media import ConversationImages, same_images
from .token_record import SampledSpan, reconciled_prompt, sampled_text

log = logging.getLogger(__name__)


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
    # an MoE model's routing record of sampled turns (models/moe.py): (first token's index, [tokens, moe layers,
    # top_k] expert ids, -1 where none), replayed by the trainer; empty without one. A record starts at the turn's
    # last prompt position where the server recorded it (its output predicts the first sampled token)
    routing: list[tuple[int, Any]] = field(default_factory=list)
    # a vision-language model's images: (index of its first image token, the processed image), in order
    images: list[tuple[int, ProcessedImage]] = field(default_factory=list)
    # [3, len] (time, height, width) position ids of a sequence with images (models/vision.py); None: 0..len-1
    rope_positions: Any = None
    # [start, end) of context tokens that continue the sequence only once earlier sampled turns were spelled with
    # their sampled ids (`reconcile`, wire_records.reconciled_prompt): not the server's prompt as it was sent
    reconciled: list[tuple[int, int]] = field(default_factory=list)

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
    record_turns: int = 0  # sampled turns trained on the server's token record
    record_splits: int = 0  # record turns whose prompt did not extend the previous turn's: a new sequence
    repeated_context_tokens: int = 0  # context those new sequences hold again (<= the sequence before each)
    rendered_turns: int = 0  # trainable turns without a record, trained on a rendering of the conversation
    retokenized_turns: int = 0  # ... of which the completion text itself was re-tokenized (no sampled ids)
    turns_missing_logprobs: int = 0  # sampled turns without logprobs, trained as on-policy
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


def sampled_token_ids(choice: Choice) -> Any:
    """The ids the server sampled for a Choice, if it returned them (unchecked: see `_check_ids`)."""
    extra = choice.model_extra or {}
    ids = extra.get("token_ids")
    if ids is not None:
        return ids
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


def _choice_routing(choice: Choice, n_tokens: int, where: str) -> Any:
    """An MoE model's routing record of a Choice, or None without one: [n_tokens + 1, layers, top_k] int16 starting
    at the prompt's last position (whose output predicts the first sampled token) when the record holds that
    position, else [n_tokens, layers, top_k] starting at the first sampled token (an older server's record)."""
    from ..models.moe import RECORD_KEY, decode_routing_with_prompt

    record = (choice.model_extra or {}).get(RECORD_KEY)
    if record is None:
        return None
    try:
        routing, prompt_last = decode_routing_with_prompt(record)
    except ValueError as e:
        raise TrajectoryError(f"{where}: {e}. Record the response unchanged.") from e
    if routing.shape[0] != n_tokens:
        raise TrajectoryError(f"{where}: the choice has {n_tokens} sampled token ids but a {RECORD_KEY} record of "
                              f"{routing.shape[0]} tokens; record the response unchanged.")
    if prompt_last is None:
        return routing
    import torch

    return torch.cat([prompt_last[None], routing])


def _record(choice: Choice) -> tuple[Any, list[int]] | None:
    """(prompt ids, sampled ids) the server recorded for a choice, or None without a complete record."""
    prompt = (choice.model_extra or {}).get("prompt_token_ids")
    ids = sampled_token_ids(choice)
    return (prompt, ids) if prompt is not None and ids is not None else None


def _check_ids(ids: Any, where: str, what: str, upper: int | None) -> list[int]:
    """`ids` as a list of token ids; a TrajectoryError naming the entry otherwise."""
    if not isinstance(ids, list) or not ids:
        raise TrajectoryError(f"{where}: {what} must be a non-empty list of token ids, got {ids!r:.120}.")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (upper is not None and t >= upper):
            bound = f"0 <= id < {upper}" if upper is not None else "an integer >= 0"
            raise TrajectoryError(
                f"{where}: {what}[{i}] is {t!r:.40}, not a token id of this tokenizer ({bound}). "
                "The record must be the one the server returned for this model; record the choice unchanged.")
    return ids


def _trainable(item: Any, train_on: str, train_dicts: bool) -> bool:
    if isinstance(item, Choice):
        return True
    if item.get("role") != "assistant":
        return False
    return train_on in ("assistant", "last") or train_dicts


def tokenize_history(
    messages_and_choices: Sequence[Any],
    tools: list[dict[str, Any]] | None,
    tokenizer: Any,
    *,
    train_on: Literal["sampled", "assistant", "last"] = "sampled",
    train_dicts: bool = False,
    end_ids: Collection[int] | None = None,
    where: str = "trajectory",
    stats: TokenizeStats | None = None,
    vision: Any = None,
    reconcile: bool = False,
) -> list[TokenizedSequence]:
    """Tokenize one conversation into the sequences its trainable turns are trained on (module docstring).

    Args:
        train_on: "sampled" makes the Choice turns trainable (RL); "assistant" every assistant turn (SFT); "last"
            only the final item, when it is an assistant turn (SFT, ART's assistant_turns="last").
        train_dicts: with train_on="sampled", also train plain assistant dicts, as on-policy.
        end_ids: ids that end a turn (`chat_format.end_of_turn_ids` of the model; default: the tokenizer's).
        where: a name for error messages, e.g. "group 2, trajectory 5".
        vision: a vision-language model's `models.vision.VisionInputs` (None: the model reads text only).
        reconcile: ART's `reconcile_text_equivalent_tokenizations` (art.tokenize only; training never sets it): a
            turn whose prompt spells an earlier sampled turn of the sequence with the tokenizer's ids of its text,
            not the ids it sampled, extends the sequence with that turn kept as sampled
            (`wire_records.reconciled_prompt`), instead of starting a new sequence; the context added so is
            recorded in `reconciled`.
    """
    stats = stats if stats is not None else TokenizeStats()
    eot = frozenset(end_ids) if end_ids is not None else end_of_turn_ids(tokenizer)
    media = ConversationImages(messages_and_choices, vision, where)
    sequences: list[TokenizedSequence] = []
    chain: TokenizedSequence | None = None
    spans: list[SampledSpan] = []  # the sampled turns of `chain`
    rendered: list[int] = []
    last = len(messages_and_choices) - 1
    for i, item in enumerate(messages_and_choices):
        if not _trainable(item, train_on, train_dicts) or (train_on == "last" and i != last):
            continue
        record = _record(item) if isinstance(item, Choice) else None
        if record is None:
            rendered.append(i)
            continue
        at = f"{where}: messages_and_choices[{i}]"
        prompt = _check_ids(record[0], at, "prompt_token_ids", len(tokenizer))
        if not record[1]:
            raise TrajectoryError(f"{at} is a Choice with no sampled tokens.")
        ids = _check_ids(record[1], at, "token_ids", None)
        routing = _choice_routing(item, len(ids), at)
        lps = _choice_logprobs(item, len(ids), at)
        images = media.of_record(item, i, prompt, at)  # [(first image token, image)] of the prompt
        if lps is None:
            stats.turns_missing_logprobs += 1
            lps = [math.nan] * len(ids)
        stats.record_turns += 1
        if chain is not None and len(prompt) >= len(chain) and prompt[:len(chain)] == chain.token_ids:
            chain.reconciled.clear()  # the server's own prompt holds the whole sequence so far
        elif chain is not None and reconcile and not images and not chain.images and (repaired := reconciled_prompt(
                prompt, chain.token_ids, spans, lambda text: encode(tokenizer, text), eot)) is not None:
            prompt = repaired
            chain.reconciled.append((len(chain), len(prompt)))
        if chain is not None and len(prompt) >= len(chain) and prompt[:len(chain)] == chain.token_ids and \
                same_images(chain.images, [s for s in images if s[0] < len(chain)]):
            spans.append(SampledSpan(len(prompt), list(ids), sampled_text(item)))
            _extend(chain, prompt[len(chain):], ids, lps, routing, [s for s in images if s[0] >= len(chain)])
            continue
        if chain is not None:
            stats.record_splits += 1
            stats.repeated_context_tokens += min(len(prompt), len(chain))  # computed again (an upper bound)
            sequences.append(chain)
        chain = TokenizedSequence(token_ids=[], trainable_mask=[], logprobs=[])
        spans = [SampledSpan(len(prompt), list(ids), sampled_text(item))]
        _extend(chain, prompt, ids, lps, routing, images)
    if chain is not None:
        sequences.append(chain)
    if rendered:
        sequences.append(_render(messages_and_choices, set(rendered), tools, tokenizer, eot, where, stats,
                                 sampled=train_on == "sampled", media=media))
    for seq in sequences:
        if seq.images:
            seq.rope_positions = vision.positions(len(seq), seq.images)  # [3, len]
    return sequences


def _extend(seq: TokenizedSequence, context: Sequence[int], sampled: Sequence[int], logprobs: Sequence[float],
            routing: Any = None, images: Sequence[tuple[int, ProcessedImage]] = ()) -> None:
    seq.images += images  # their places are the prompt's, which starts the sequence
    if routing is not None:  # from the first sampled token on, or one earlier: the prompt's last position
        seq.routing.append((len(seq.token_ids) + len(context) - (routing.shape[0] - len(sampled)), routing))
    seq.token_ids += [*context, *sampled]
    seq.trainable_mask += [False] * len(context) + [True] * len(sampled)
    seq.logprobs += [math.nan] * len(context) + list(logprobs)


def _render(items: Sequence[Any], trainable: set[int], tools: list[dict[str, Any]] | None, tokenizer: Any,
            eot: frozenset[int], where: str, stats: TokenizeStats, sampled: bool,
            media: ConversationImages | None = None) -> TokenizedSequence:
    """The fallback: one rendering of the conversation, trainable turns at placeholders (module docstring, 3)."""
    images = media.before(len(items)) if media is not None and media.urls else []
    template_messages: list[dict[str, Any]] = []
    # per placeholder: ("ids", (ids, logprobs)) for sampled ids, ("render", choice or None) for text
    turns: list[tuple[str, Any]] = []
    markers: list[str] = []  # what stands for each placeholder turn in the rendering
    for i, item in enumerate(items):
        msg = template_message(item)
        if i not in trainable:
            template_messages.append(msg)
            continue
        ph = PLACEHOLDER.format(len(turns))
        stats.rendered_turns += 1
        ids = sampled_token_ids(item) if isinstance(item, Choice) else None
        if ids is not None:
            at = f"{where}: messages_and_choices[{i}]"
            if not ids:
                raise TrajectoryError(f"{at} is a Choice with no sampled tokens.")
            lps = _choice_logprobs(item, len(_check_ids(ids, at, "token_ids", None)), at)
            if lps is None:
                stats.turns_missing_logprobs += 1
            markers.append(turn_marker(len(turns), msg.get("content")))
            template_messages.append({"role": "assistant", "content": markers[-1]})
            turns.append(("ids", (ids, lps)))
        else:
            if isinstance(item, Choice):
                stats.retokenized_turns += 1
            markers.append(ph)
            template_messages.append({**msg, "content": ph + msg["content"]})
            turns.append(("render", item))

    text = render_text(tokenizer, template_messages, tools, add_generation_prompt=False, where=where,
                       images=media.vision.image_tokens(images) if images and media is not None else None)
    pieces = split_at_placeholders(text, range(len(turns)), markers)
    if pieces is None:
        counts = [text.count(marker) for marker in markers]
        k = next(k for k, c in enumerate(counts) if c != 1)
        raise TrajectoryError(
            f"{where}: the chat template rendered assistant turn {k} {counts[k]} times; artrl needs "
            "templates that render each assistant message's content once and unchanged."
        )

    token_ids: list[int] = encode(tokenizer, pieces[0])
    mask: list[bool] = [False] * len(token_ids)
    logprobs: list[float] = [math.nan] * len(token_ids)
    for k, (kind, payload) in enumerate(turns):
        after = encode(tokenizer, pieces[k + 1])
        if kind == "ids":
            ids, lps = payload
            token_ids += ids
            mask += [True] * len(ids)
            logprobs += lps if lps is not None else [math.nan] * len(ids)
            if ids[-1] in eot and after and after[0] in eot:
                after = after[1:]  # the model closed the turn itself; the template's end token is not repeated
            token_ids += after
            mask += [False] * len(after)
            logprobs += [math.nan] * len(after)
        else:
            end = next((j + 1 for j, t in enumerate(after) if t in eot), len(after))
            token_ids += after
            mask += [True] * end + [False] * (len(after) - end)
            turn_lps = [math.nan] * end
            choice = payload
            if isinstance(choice, Choice):
                values = None
                if choice.logprobs is not None and choice.logprobs.content is not None:
                    values = [lp.logprob for lp in choice.logprobs.content]
                if values is not None and len(values) == end:
                    turn_lps = values
                else:
                    stats.turns_missing_logprobs += 1
            elif sampled:
                stats.turns_missing_logprobs += 1  # an assistant dict trained as on-policy (RL)
            logprobs += turn_lps + [math.nan] * (len(after) - end)
    spans = media.vision.spans(token_ids, images, where) if images and media is not None else []
    return TokenizedSequence(token_ids=token_ids, trainable_mask=mask, logprobs=logprobs,
                             images=list(zip(spans, images)))


def group_advantages(rewards: Sequence[float], scale: bool) -> list[float]:
    """Reward minus group mean, divided by the group's (population) std when `scale`."""
    n = len(rewards)
    mean = sum(rewards) / n
    adv = [r - mean for r in rewards]
    if scale:
        std = math.sqrt(sum(a * a for a in adv) / n)
        adv = [a / (std + 1e-6) for a in adv]
    return adv
