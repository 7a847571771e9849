"""The one place a train call's kind is chosen: RL (groups) or SFT (trajectories) -> a `PreparedCall`.

The session prepares every call here, once, in the process that received it;
with training workers the prepared call (rows, plan, learning rates, loss) is
shipped to every rank as it is, so no rank tokenizes or packs again.
"""

from __future__ import annotations

from typing import Any

from ..types import TrainConfig, TrainSFTConfig
from .call import BuildContext, PreparedCall
from .rl import prepare_rl
from .sft import prepare_sft


def prepare_call(kind: str, ctx: BuildContext, data: list[Any], config: TrainConfig | TrainSFTConfig, *,
                 ref_adapter: str | None = None) -> PreparedCall:
    """`kind` "rl": `data` are TrajectoryGroups and `config` a TrainConfig (`ref_adapter`: a loaded adapter as
    the KL reference); "sft": Trajectories and a TrainSFTConfig. `config` comes checked
    (`InternalModelConfig.call_config`)."""
    if kind == "rl" and isinstance(config, TrainConfig):
        return prepare_rl(ctx, data, config, ref_adapter=ref_adapter)
    if kind == "sft" and isinstance(config, TrainSFTConfig):
        return prepare_sft(ctx, data, config)
    raise TypeError(f"a {kind!r} call takes a {'TrainConfig' if kind == 'rl' else 'TrainSFTConfig'}, "
                    f"got {type(config).__name__}")
