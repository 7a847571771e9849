"""ART's public module paths and names, each importable from artrl or listed here as absent with its reason.

tests/data/art_public_api.json holds, for ART 0.5.23 and 0.5.18, every public module path of ART's package and
the names it exports (written by benchmarks/art_public_api.py from ART's own source; nothing of ART is copied).
For each path, `artrl` in place of `art` imports; for each name, `getattr` finds it, or refuses it with an
`AttributeError` that names it and says why (ART's Megatron configuration). What artrl does not provide is
listed below with the reason; the lists only shrink: a listed path or name that artrl now has fails the test
until its line goes. With `ART_SOURCE` naming ART 0.5.23's unpacked source (tests/art_source.py) (and `ART_SOURCE_0518` for 0.5.18)
the data file is checked against ART's source.
"""

from __future__ import annotations

import importlib
import json
import pathlib
import warnings

import pytest
from art_source import art_package

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = json.loads((ROOT / "tests" / "data" / "art_public_api.json").read_text())

# ART's module paths artrl does not have, by reason
ABSENT_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ART 0.5.23's multi-host runtime (Monarch, etcd, NIXL, its vLLM replicas); artrl's workers are "
     "torch.distributed (distributed/) and its replicas replicas/",
     ("artrl.distributed.adapter_transport", "artrl.distributed.art_runtime", "artrl.distributed.artifact_preflight",
      "artrl.distributed.data_plane", "artrl.distributed.etcd_runtime", "artrl.distributed.host_admission",
      "artrl.distributed.monarch_actor", "artrl.distributed.monarch_bootstrap", "artrl.distributed.monarch_runtime",
      "artrl.distributed.nccl_preflight", "artrl.distributed.nixl_runtime", "artrl.distributed.packing",
      "artrl.distributed.rollout", "artrl.distributed.specs", "artrl.distributed.topology",
      "artrl.distributed.trajectory_store", "artrl.distributed.vllm_replica")),
    ("ART's serving and weight-transfer internals for its vLLM and Megatron back ends (not applicable: one "
     "server in front of the built-in engine or vLLM, serve/)",
     ("artrl.adapter_leases", "artrl.openai", "artrl.runtime_diagnostics", "artrl.serving_capabilities",
      "artrl.token_prefix", "artrl.trainer_rank", "artrl.trainer_rank.topk", "artrl.vllm_route_transport",
      "artrl.vllm_runtime", "artrl.weight_transfer", "artrl.weight_transfer.nccl",
      "artrl.weight_transfer.packed_tensor")),
    ("ART's preprocessing and cost internals (artrl's data path is trajectories/ and preprocess/)",
     ("artrl.preprocessing", "artrl.preprocessing.dynamo_tokens", "artrl.preprocessing.inputs",
      "artrl.preprocessing.moe_routing", "artrl.preprocessing.pack", "artrl.preprocessing.policy_spans",
      "artrl.preprocessing.response_masking", "artrl.preprocessing.sft", "artrl.preprocessing.tokenize",
      "artrl.preprocessing.vllm_tokens")),
    ("ART's model service and back ends (docs/art-compatibility.md, 'Other ART modules')",
     ("artrl.guided_completion", "artrl.local.checkpoints", "artrl.local.service", "artrl.serverless.backend",
      "artrl.serverless.client")),
    ("ART's internals of its integrations and its tuner's worker control (artrl's langgraph/ records the "
     "HTTP turns; pipeline_trainer/ drives its workers itself)",
     ("artrl.dev.get_model_config", "artrl.dev.sequence_lengths", "artrl.langgraph.llm_wrapper",
      "artrl.langgraph.logging", "artrl.langgraph.message_utils", "artrl.pipeline_tuner.attachment",
      "artrl.pipeline_tuner.worker_controller")),
    ("ART's example programs shipped in its package (artrl keeps them in examples/art_pipeline_0523/)",
     ("artrl.pipeline_trainer.binary_prefix_tool_pipeline", "artrl.pipeline_trainer.yes_no_maybe_pipeline")),
    ("ART's utilities for its own services (S3, deployment providers, W&B, benchmark charts, process "
     "management)",
     ("artrl.utils.append_only", "artrl.utils.benchmark_rollout", "artrl.utils.benchmarking.aggregate_trajectories",
      "artrl.utils.benchmarking.charts", "artrl.utils.benchmarking.charts.percentage_comparison_bar_chart",
      "artrl.utils.benchmarking.charts.training_progress_chart", "artrl.utils.benchmarking.filter_model_split",
      "artrl.utils.benchmarking.load_trajectories", "artrl.utils.benchmarking.log_constant_metrics_wandb",
      "artrl.utils.benchmarking.pull_model_trajectories", "artrl.utils.benchmarking.types", "artrl.utils.cache_dirs",
      "artrl.utils.convert_moe_lora", "artrl.utils.deploy_model", "artrl.utils.deployment.common",
      "artrl.utils.deployment.legacy", "artrl.utils.deployment.together", "artrl.utils.deployment.wandb",
      "artrl.utils.get_repo_root_path", "artrl.utils.group_aggregate", "artrl.utils.grpo", "artrl.utils.lifecycle",
      "artrl.utils.logging", "artrl.utils.managed_process", "artrl.utils.model_config", "artrl.utils.network",
      "artrl.utils.old_benchmarking.calculate_step_metrics", "artrl.utils.old_benchmarking.display_image_grid",
      "artrl.utils.old_benchmarking.generate_comparison_table", "artrl.utils.old_benchmarking.generate_line_graphs",
      "artrl.utils.old_benchmarking.load_benchmarked_models", "artrl.utils.old_benchmarking.types",
      "artrl.utils.record_provenance", "artrl.utils.s3", "artrl.utils.s3_checkpoint_utils", "artrl.utils.safetensors",
      "artrl.utils.suppress_litellm_serialization_warnings", "artrl.utils.wandb_sdk")),
)
ABSENT_PATHS = {path: reason for reason, paths in ABSENT_GROUPS for path in paths}

# names of ART's modules that artrl's module of the same path does not have (ART's internals: loggers, type
# variables, its back ends' configuration, helpers of its own services); docs/art-compatibility.md has the rest
ABSENT_NAMES: dict[str, frozenset[str]] = {
    "artrl.auto_trajectory": frozenset({
        "auto_trajectory_context_var", "logger", "parse_sse_to_chat_completion", "patch_httpx"}),
    "artrl.backend": frozenset({
        "AnyModel", "AnyTrainableModel"}),
    "artrl.cli": frozenset({
        "SKILL_NAMES", "app", "help_command", "init", "install_skills", "migrate", "run", "runtime_app",
        "runtime_prepare", "runtime_status"}),
    "artrl.dev": frozenset({
        "BackendModelConfig", "RolloutWeightUpdateMode", "VllmRuntimeArgs", "is_external_vllm_mode"}),
    "artrl.dev.engine": frozenset({
        "WeightTransferConfig"}),
    "artrl.dev.model": frozenset({
        "BackendModelConfig", "DebugOption", "FSDPOption", "HubStrategy", "IntervalStrategy", "OptimizerNames",
        "RolloutWeightUpdateMode", "RolloutWeightsMode", "SaveStrategy", "SchedulerType", "VllmRuntimeArgs",
        "VllmRuntimeMode"}),
    "artrl.dev.validate": frozenset({
        "is_external_vllm_mode"}),
    "artrl.distributed.launch": frozenset({
        "ArtLaunchContext"}),
    "artrl.errors": frozenset({
        "ARTError", "ArtVllmMetricsTimeoutError", "ForbiddenBucketCreationError", "LoRADeploymentTimedOutError",
        "UnsupportedBaseModelDeploymentError", "UnsupportedLoRADeploymentProviderError"}),
    "artrl.gather": frozenset({
        "gather_context_var", "record_trajectory_completion_tokens"}),
    "artrl.local.adapter_leases": frozenset({
        "AdapterLeaseManager"}),
    "artrl.local.backend": frozenset({
        "logger"}),
    "artrl.loss": frozenset({
        "LossOffPolicyDiagnosticsAccumulator", "histogram_quantile", "importance_ratio_histogram_edges"}),
    "artrl.mcp.generate_scenarios": frozenset({
        "preview_scenarios"}),
    "artrl.metrics_taxonomy": frozenset({
        "SFT_GRADIENT_STEP_KEY", "SFT_METRIC_PREFIX", "SFT_WANDB_GRADIENT_STEP_KEY"}),
    "artrl.model": frozenset({
        "METRICS_BUILDER_STATE_KEY", "METRIC_SECTIONS", "METRIC_SPLITS", "ModelConfig", "StateType",
        "WANDB_CANONICAL_METRIC_KEYS", "WANDB_CANONICAL_METRIC_PREFIXES"}),
    "artrl.pipeline_tuner": frozenset({
        "PackedGroupObservation", "PackedGroupShape", "PackingLeafShape", "PipelineAutotunerAttachment",
        "PipelineMetric", "RolloutWorkerController"}),
    "artrl.pipeline_tuner.autotune": frozenset({
        "PackingOutcome", "PackingProjection", "recommended_queue_size"}),
    "artrl.pipeline_tuner.config": frozenset({
        "PackedGroupObservation", "PackedGroupShape", "PackingLeafShape", "PipelineMetric"}),
    "artrl.trajectories": frozenset({
        "ChatCompletionsRequest", "CompactDumpable", "CompactTrajectoryKind", "CompactTrajectoryPayload",
        "CompletionsRequest", "MessagesRequest", "ResponsesRequest", "TensorizedTopK", "TokenizedTopK", "Tokenizer",
        "compact_dump", "compact_memory", "compact_validate", "compact_validate_json", "first_occurrence_masks"}),
    "artrl.trajectories.tensors": frozenset({
        "TensorizedTopK"}),
    "artrl.utils": frozenset({
        "record_provenance"}),
    "artrl.utils.retry": frozenset({
        "T"}),
    "artrl.utils.sft": frozenset({
        "resolve_sft_batch_size"}),
    "artrl.utils.strip_logprobs": frozenset({
        "logger"}),
    "artrl.yield_trajectory": frozenset({
        "yield_trajectory_context_var"}),
}


def _versions() -> list[tuple[str, str, list[str]]]:
    """(ART version, artrl path, ART's names there) for every ART module path."""
    return [(version, "artrl" + path[len("art"):], names)
            for version, modules in sorted(DATA.items()) for path, names in sorted(modules.items())]


def _import(path: str):
    """The artrl module at `path`, or None when artrl has no such module."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(path)
        except ModuleNotFoundError as e:
            if e.name and (path == e.name or path.startswith(e.name + ".") or e.name.startswith(path)):
                return None
            raise


def _missing(module, name: str) -> bool:
    """Whether `name` is missing from `module`: not there, and not refused with an error that names it."""
    try:
        getattr(module, name)
    except AttributeError as e:
        return name not in str(e) or "has no attribute" in str(e)
    return False


def test_the_data_covers_both_versions():
    assert sorted(DATA) == ["0.5.18", "0.5.23"]
    assert "art.trajectories" in DATA["0.5.23"] and "Trajectory" in DATA["0.5.23"]["art.trajectories"]


def test_every_art_path_imports_from_artrl_or_is_listed():
    paths = sorted({path for _, path, _ in _versions()})
    missing = [p for p in paths if p not in ABSENT_PATHS and _import(p) is None]
    assert missing == []


def test_every_listed_path_is_still_absent():
    """A path artrl now provides leaves the list (it may only shrink)."""
    known = {path for _, path, _ in _versions()}
    assert sorted(set(ABSENT_PATHS) - known) == []  # a listed path that ART does not have
    assert [p for p in sorted(ABSENT_PATHS) if _import(p) is not None] == []


def test_every_name_of_an_art_module_is_there_or_listed():
    missing = []
    for version, path, names in _versions():
        if path in ABSENT_PATHS:
            continue
        module = _import(path)
        missing += [f"{path}.{n} ({version})" for n in names
                    if n not in ABSENT_NAMES.get(path, ()) and _missing(module, n)]
    assert missing == []


def test_every_listed_name_is_still_absent():
    names = {(path, n) for _, path, ns in _versions() for n in ns}
    assert sorted((p, n) for p, ns in ABSENT_NAMES.items() for n in ns if (p, n) not in names) == []
    assert sorted(f"{p}.{n}" for p, ns in ABSENT_NAMES.items() for n in ns if not _missing(_import(p), n)) == []


@pytest.mark.parametrize("version, variable", [("0.5.23", "ART_SOURCE"), ("0.5.18", "ART_SOURCE_0518")])
def test_the_data_is_arts_own(version, variable):
    source = art_package(variable)
    if source is None:
        pytest.skip(f"set {variable} to ART {version}'s source to compare the data file with it")
    from benchmarks.art_public_api import walk

    assert walk(source) == DATA[version]
