"""ART's `art.utils.deployment`: deploying a checkpoint to a hosted provider (Together, W&B). Not available here.

ART scripts import these names at the top even when deployment is switched off
(ART's tic_tac_toe example imports `deploy_model` and `TogetherDeploymentConfig`
and deploys only when `DEPLOY_MODEL = True`), so the names exist: the
configuration and result types are ART's (same fields), and calling
`deploy_model` or `deploy_wandb` raises a `ConfigError` that says what to do
instead. Deploying means uploading weights to a hosted service; artrl trains
and serves on this machine (a checkpoint is a peft LoRA adapter directory that
any server taking LoRA adapters can load).
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..model import TrainableModel

__all__ = [
    "DeploymentConfig", "DeploymentResult", "LoRADeploymentJob", "LoRADeploymentProvider", "Provider",
    "TogetherDeploymentConfig", "TogetherJobStatus", "WandbDeploymentConfig", "deploy_model", "deploy_wandb",
]

Provider = Literal["together", "wandb"]


class DeploymentConfig(BaseModel):
    """Base class of the providers' deployment settings (ART's)."""


class DeploymentResult(BaseModel):
    """What a deployment returns in ART: the model name to use for inference at the provider."""

    inference_model_name: str


class TogetherDeploymentConfig(DeploymentConfig):
    """ART's settings for Together: the S3 bucket and prefix the archive goes through, and whether to wait."""

    s3_bucket: str | None = None
    prefix: str | None = None
    wait_for_completion: bool = True


class WandbDeploymentConfig(DeploymentConfig):
    """ART's settings for W&B: the training provenance recorded with the artifact."""

    provenance: list[str]


class TogetherJobStatus(str, Enum):
    """ART's states of a Together deployment job."""

    QUEUED = "Queued"
    RUNNING = "Running"
    COMPLETE = "Complete"
    FAILED = "Failed"


class LoRADeploymentProvider(str, Enum):
    """ART's older name for the providers."""

    TOGETHER = "together"
    WANDB = "wandb"


class LoRADeploymentJob(BaseModel):
    """ART's older result of a deployment job."""

    status: TogetherJobStatus
    job_id: str
    model_name: str
    failure_reason: str | None


def _unavailable(what: str, provider: str, model: "TrainableModel", step: int, checkpoint_path: str) -> ConfigError:
    return ConfigError(
        f"{what} (ART: deploy a checkpoint to {provider}) is not available in artrl: it uploads weights to a hosted "
        f"service. Model {getattr(model, 'name', model)!r} step {step} is the peft LoRA adapter in "
        f"{checkpoint_path!r}; serve it with `artrl serve` or the LocalBackend's server (name@step), or load it in "
        "any server that takes LoRA adapters (vLLM --lora-modules, ...).")


async def deploy_model(model: "TrainableModel", checkpoint_path: str, step: int, provider: Provider,
                       config: DeploymentConfig | None = None, verbose: bool = False) -> DeploymentResult:
    """ART's `deploy_model`: raises ConfigError here (see the module docstring)."""
    del config, verbose
    raise _unavailable("deploy_model", provider, model, step, checkpoint_path)


def deploy_wandb(model: "TrainableModel", checkpoint_path: str, step: int,
                 config: WandbDeploymentConfig | None = None, verbose: bool = False) -> DeploymentResult:
    """ART's `deploy_wandb`: raises ConfigError here (see the module docstring)."""
    del config, verbose
    raise _unavailable("deploy_wandb", "W&B", model, step, checkpoint_path)
