"""ART's names for hosted services (deployment to Together / W&B, S3 backups): they import as in ART, and using
them raises a ConfigError that says what to do instead (ART's example scripts import them at the top)."""

from __future__ import annotations

import asyncio

import pytest

import artrl as art
from artrl.utils import deployment
from artrl.utils.deployment import TogetherDeploymentConfig, deploy_model  # tic_tac_toe's import line


def test_deployment_names_import_with_arts_fields():
    assert set(deployment.__all__) >= {"DeploymentConfig", "DeploymentResult", "LoRADeploymentJob",
                                       "LoRADeploymentProvider", "Provider", "TogetherDeploymentConfig",
                                       "WandbDeploymentConfig", "deploy_model", "deploy_wandb"}
    config = TogetherDeploymentConfig()
    assert (config.s3_bucket, config.prefix, config.wait_for_completion) == (None, None, True)
    assert isinstance(config, deployment.DeploymentConfig)
    assert deployment.WandbDeploymentConfig(provenance=["local-rl"]).provenance == ["local-rl"]
    assert deployment.DeploymentResult(inference_model_name="x").inference_model_name == "x"
    job = deployment.LoRADeploymentJob(status="Complete", job_id="j", model_name="m", failure_reason=None)
    assert job.status is deployment.TogetherJobStatus.COMPLETE
    assert deployment.LoRADeploymentProvider("wandb") is deployment.LoRADeploymentProvider.WANDB


def test_deploying_raises_a_clear_error():
    model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny")
    with pytest.raises(art.ConfigError, match=r"deploy_model .*together.*'m' step 3 .*'/ckpt/0003'.*artrl serve"):
        asyncio.run(deploy_model(model=model, checkpoint_path="/ckpt/0003", step=3, provider="together",
                                 config=TogetherDeploymentConfig(wait_for_completion=True), verbose=True))
    with pytest.raises(art.ConfigError, match="deploy_wandb .*W&B"):
        deployment.deploy_wandb(model, "/ckpt/0001", 1)


@pytest.mark.parametrize("method", ["_experimental_pull_from_s3", "_experimental_push_to_s3"])
def test_s3_backups_raise_a_clear_error_naming_the_run_directory(tmp_path, method):
    backend = art.LocalBackend(path=str(tmp_path))
    model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny")
    run_dir = tmp_path / "p" / "models" / "m"
    with pytest.raises(art.ConfigError, match=rf"{method}.*s3://bucket-1 .*{run_dir}.*aws s3 sync"):
        asyncio.run(getattr(backend, method)(model, s3_bucket="bucket-1", verbose=True))
    with pytest.raises(art.ConfigError, match=r"\$BACKUP_BUCKET"):  # ART's default bucket
        asyncio.run(getattr(backend, method)(model))
    assert not run_dir.exists()  # nothing created, nothing synced
