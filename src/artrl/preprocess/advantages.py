"""ART's `advantage_balance`: shift a call's weight between positive and negative advantages.

With balance b in [-1, 1], applied to every sequence of the call (each sequence's
advantage A is shared by its trainable tokens):

* b > 0: negative advantages become A * (1 - b) (b = 1: learn from successes only);
* b < 0: positive advantages become A * (1 + b) (b = -1: learn from failures only);
* then every advantage is multiplied by one factor so the call's mean |A| per
  trainable token is what it was before, as ART does by renormalising the
  packed advantages to mean |A| = 1 afterwards. The balance changes the mix of
  the update, not its overall size.

Worked example: sequences with A = [+1, -1] and 2, 2 trainable tokens, b = 0.5:
scaled [+1, -0.5] (mean |A| 0.75 against 1.0 before), factor 4/3, result
[+1.333, -0.667] (mean |A| 1.0 again).

ART also divides every call's advantages by their token mean |A| even when
b = 0; artrl keeps the group-relative values as they are
(docs/art-compatibility.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..trajectories.sequences import TokenizedSequence


def _mean_abs(seqs: Sequence[TokenizedSequence]) -> float:
    tokens = sum(s.n_trainable for s in seqs)
    return sum(abs(s.advantage) * s.n_trainable for s in seqs) / tokens if tokens else 0.0


def balance_advantages(groups: Sequence[Sequence[TokenizedSequence]], balance: float) -> None:
    """Apply `balance` to every sequence's advantage in place (see the module docstring)."""
    if not -1.0 <= balance <= 1.0:
        raise ValueError(f"advantage_balance={balance}; it must be in [-1, 1]")
    if balance == 0:
        return
    seqs = [s for g in groups for s in g]
    before = _mean_abs(seqs)
    for s in seqs:
        if balance > 0 and s.advantage < 0:
            s.advantage *= 1 - balance
        elif balance < 0 and s.advantage > 0:
            s.advantage *= 1 + balance
    after = _mean_abs(seqs)
    if after > 0:
        factor = before / after
        for s in seqs:
            s.advantage *= factor
