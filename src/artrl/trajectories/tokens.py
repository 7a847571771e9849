"""`art.tokenize` / `art.tensorize`: trajectories as the token sequences the trainer sees, with per-token facts.

ART 0.5.23's pair, over artrl's tokenizer (trajectories/sequences.py): each trajectory (legacy
histories or captured exchanges, token_record.py) becomes the sequences training uses, each a
`TokenizedHistory` of `tokens`, `logprobs` (the sampled logprob on sampled tokens, NaN
elsewhere) and `flags` (`TokenFlag`, ART's bits):

* a turn trained on the server's token record (docs/token-record.md): every token of its
  sequence `EXACT` (the ids came from the server), its sampled ids also `SAMPLED | OUTPUT |
  ASSISTANT`, and `STOP` on an end-of-turn id;
* a sequence rendered from text (data without a record, counted by the trainer): its assistant
  turns `ASSISTANT | OUTPUT`, nothing `EXACT`.

`multi_history=False` (ART's default) needs exactly one sequence per trajectory (a ValueError
otherwise, as ART's); `multi_history=True` gives a `TokenizedMultiHistoryTrajectory` of all of
them. Groups give `TokenizedTrajectoryGroup`s. `tensorize` is the same as torch tensors (int64
tokens, float32 logprobs, int32 flags) on `device`.

`reconcile_text_equivalent_tokenizations=True` (ART's opt-in): a turn whose prompt spelled an
earlier sampled turn again from its text, with other ids than it sampled, continues that turn's
sequence with the turn kept as sampled (token_record.reconciled_prompt, ART's repair), instead of
starting a new sequence; the context added so is not `EXACT` (the server sent another spelling).
`Trajectory.tokenize()` / `TrajectoryGroup.tokenize()` (and `tensorize()`) are this of one item; the entry
points `art.tokenize` / `art.tensorize` over many are tokenization.py's.

Differences from ART, each refused or documented, never ignored: `chat_template` and
`chat_template_kwargs` are refused with a ConfigError (the record needs no template; the
fallback renders with the tokenizer's own);
`ASSISTANT` marks sampled turns only, not earlier assistant turns inside a prompt; a
`TokenizedHistory.history` is a `LegacyHistory` (messages and choices), not ART's
protocol-native history; the work runs in a worker thread, not a process pool. `model` selects
exchanges by model name (exact, else a shell pattern) as ART's selector does; sequences of
exchanges are named by the exchanges' model (as ART's), those of legacy data by `model`, else
`base_model`; `base_model` otherwise only names the tokenizer.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntFlag
from typing import Any

from ..chat.format import encode, end_of_turn_ids
from ..errors import ConfigError
from ..models.tokenizer import load_tokenizer
from .exchanges import TrajectoryExchanges
from .sequences import TokenizeStats, tokenize_history
from .tensors import (Conversation, TensorizedHistory, TensorizedMultiHistoryTrajectory, TensorizedTrajectory,
                      TensorizedTrajectoryGroup, TrajectoryFields)


class TokenFlag(IntFlag):
    """Independent facts about a token (ART's bits; members combine)."""

    EXACT = 1 << 0  # the id came from the server's record, not from tokenizing text here
    SAMPLED = 1 << 1  # the server sampled this id (implies EXACT | OUTPUT)
    ASSISTANT = 1 << 2  # inside an assistant turn
    STOP = 1 << 3  # an end-of-turn id
    OUTPUT = 1 << 4  # part of a response
    RAW_LOGPROBS = 1 << 5
    PROCESSED_LOGPROBS = 1 << 6


@dataclass
class TokenizedHistory:
    """One token sequence: `tokens`, `logprobs` and `flags`, one entry per token."""

    history: Conversation  # a LegacyHistory (history.py)
    model: str
    tokens: list[int]
    logprobs: list[float]
    flags: list[TokenFlag]

    def tensorize(self, *, device: Any = None) -> "TensorizedHistory":
        import torch

        return TensorizedHistory(history=self.history, model=self.model,
                                 tokens=torch.tensor(self.tokens, dtype=torch.int64, device=device or "cpu"),
                                 logprobs=torch.tensor(self.logprobs, dtype=torch.float32, device=device or "cpu"),
                                 flags=torch.tensor([int(f) for f in self.flags], dtype=torch.int32,
                                                    device=device or "cpu"))


@dataclass
class TokenizedTrajectory(TokenizedHistory, TrajectoryFields):
    trajectory: Any  # the Trajectory (data.py)

    def tensorize(self, *, device: Any = None) -> "TensorizedTrajectory":
        h = TokenizedHistory.tensorize(self, device=device)
        return TensorizedTrajectory(history=h.history, model=h.model, tokens=h.tokens, logprobs=h.logprobs,
                                    flags=h.flags, trajectory=self.trajectory)


@dataclass
class TokenizedMultiHistoryTrajectory(TrajectoryFields):
    trajectory: Any  # the Trajectory (data.py)
    histories: list[TokenizedHistory]

    def tensorize(self, *, device: Any = None) -> "TensorizedMultiHistoryTrajectory":
        return TensorizedMultiHistoryTrajectory(trajectory=self.trajectory,
                                                histories=[h.tensorize(device=device) for h in self.histories])


@dataclass
class TokenizedTrajectoryGroup:
    trajectory_group: Any  # the TrajectoryGroup (data.py)
    trajectories: list[Any]

    @property
    def metrics(self) -> dict[str, Any]:
        return self.trajectory_group.metrics

    @property
    def metadata(self) -> dict[str, Any]:
        return self.trajectory_group.metadata

    def tensorize(self, *, device: Any = None) -> "TensorizedTrajectoryGroup":
        return TensorizedTrajectoryGroup(trajectory_group=self.trajectory_group,
                                         trajectories=[t.tensorize(device=device) for t in self.trajectories])


# --------------------------------------------------------------------------- tokenizing


def select_exchanges(exchanges: TrajectoryExchanges, model: str | None) -> TrajectoryExchanges:
    """The exchanges of `model` (an exact name first, else a shell pattern); all of them for None."""
    if model is None:
        return exchanges
    names = {e.model for _, e in exchanges.all()}
    wanted = {model} if model in names else {n for n in names if n is not None and fnmatch.fnmatchcase(n, model)}
    return TrajectoryExchanges(**{name: [e for e in getattr(exchanges, name) if e.model in wanted]
                                  for name in ("chat_completions", "completions", "responses", "messages")})


def sequence_name(exchanges: TrajectoryExchanges, select: str | None, default: str) -> str:
    """The name of the sequences of `exchanges` (those of the model `select`; all for None): their model when they
    name one (as ART's), else `default`."""
    served = {e.model for _, e in select_exchanges(exchanges, select).all()}
    return served.pop() if len(served) == 1 and None not in served else default


def sequences_of(conversations: list[tuple[Conversation, str]], tokenizer: Any, end_ids: frozenset[int], model: str,
                 reconcile: bool = False) -> list[TokenizedHistory]:
    """The token sequences of `conversations` (each with a name for errors), named `model`. `reconcile`: ART's
    `reconcile_text_equivalent_tokenizations` (module docstring)."""
    out = []
    for history, at in conversations:
        stats = TokenizeStats()
        seqs = tokenize_history(history.messages_and_choices, history.tools, tokenizer, end_ids=end_ids, where=at,
                                stats=stats, reconcile=reconcile)
        for k, seq in enumerate(seqs):
            rendered = stats.rendered_turns > 0 and k == len(seqs) - 1  # the rendered sequence comes last
            respelled = {i for a, b in seq.reconciled for i in range(a, b)}
            flags, logprobs = [], []
            for i, (token, trainable, lp) in enumerate(zip(seq.token_ids, seq.trainable_mask, seq.logprobs)):
                flag = TokenFlag(0) if rendered or i in respelled else TokenFlag.EXACT
                if trainable:
                    flag |= TokenFlag.ASSISTANT | TokenFlag.OUTPUT | (TokenFlag(0) if rendered else TokenFlag.SAMPLED)
                    if token in end_ids:
                        flag |= TokenFlag.STOP
                flags.append(flag)
                logprobs.append(lp if trainable and not rendered else math.nan)
            out.append(TokenizedHistory(history=history, model=model, tokens=list(seq.token_ids),
                                        logprobs=logprobs, flags=flags))
    return out


def tokenize_trajectory(trajectory: Any, tokenizer: Any, end_ids: frozenset[int], model: str, select: str | None,
                        multi_history: bool, where: str, reconcile: bool = False) -> Any:
    """One Trajectory (the caller has checked that it is one), tokenized as `art.tokenize` does it: its exchanges
    of the model `select` only (all for None); its sequences named by their exchanges' model when those name one,
    else `model`."""
    trajectory.validate_fields()
    spelling = ((lambda text: encode(tokenizer, text)), end_ids) if reconcile else None
    if trajectory.exchanges:
        model = sequence_name(trajectory.exchanges, select, model)
    seqs = sequences_of(trajectory.conversations(select, where, spelling), tokenizer, end_ids, model, reconcile)
    if multi_history:
        return TokenizedMultiHistoryTrajectory(trajectory=trajectory, histories=seqs)
    if len(seqs) != 1:
        raise ValueError(f"{where}: trajectory tokenization requires exactly one history; found {len(seqs)} "
                         "(pass multi_history=True for all of them, or model= to select one model's exchanges)")
    s = seqs[0]
    return TokenizedTrajectory(history=s.history, model=s.model, tokens=s.tokens, logprobs=s.logprobs,
                               flags=s.flags, trajectory=trajectory)


def tokenize_group(group: Any, tokenizer: Any, end_ids: frozenset[int], model: str, select: str | None,
                   multi_history: bool, where: str, reconcile: bool = False) -> TokenizedTrajectoryGroup:
    """A TrajectoryGroup, each of its trajectories as `tokenize_trajectory` does it."""
    return TokenizedTrajectoryGroup(trajectory_group=group, trajectories=[
        tokenize_trajectory(t, tokenizer, end_ids, model, select, multi_history, f"{where}.trajectories[{ti}]",
                            reconcile)
        for ti, t in enumerate(group.trajectories)])


def resolve_tokenizer(tokenizer: Any, base_model: str | None, model: str | None) -> Any:
    if tokenizer is not None:
        return tokenizer
    name = base_model or model
    if name is None:
        raise ConfigError("art.tokenize needs a tokenizer: pass tokenizer=... or base_model=... (the model whose "
                          "tokenizer served the trajectories, e.g. base_model='artrl/tiny').")
    return load_tokenizer(name)


def check_unsupported(chat_template: str | None, chat_template_kwargs: Mapping[str, object] | None) -> None:
    for name, value, bad in (("chat_template", chat_template, chat_template is not None),
                             ("chat_template_kwargs", chat_template_kwargs, chat_template_kwargs is not None)):
        if bad:
            raise ConfigError(f"art.tokenize({name}={value!r:.80}) is not supported: artrl trains each sampled turn "
                              "on the server's token record and renders data without one with the tokenizer's own "
                              f"chat template. Leave {name} unset.")


def prepare(model: str | None, base_model: str | None, tokenizer: Any, chat_template: str | None,
            chat_template_kwargs: Mapping[str, object] | None) -> tuple[Any, frozenset[int], str]:
    """The tokenizer, its end-of-turn ids, and the name of the sequences (`model`, else `base_model`)."""
    check_unsupported(chat_template, chat_template_kwargs)
    tok = resolve_tokenizer(tokenizer, base_model, model)
    return tok, end_of_turn_ids(tok), model or base_model or ""  # only `model` selects exchanges
