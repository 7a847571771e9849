"""Every field and keyword of ART 0.5.23's training configuration, walked: each is honoured or refused, never
accepted and ignored.

The lists below are ART 0.5.23's, copied by name from its source (art/types.py TrainConfig and TrainSFTConfig,
art/dev/train.py TrainConfig and TrainSFTConfig, art/dev/model.py InternalModelConfig, art/local/backend.py
LocalBackend.train). With `ART_SOURCE` naming ART 0.5.23's unpacked source (tests/art_source.py) they are checked against that source
too, so a newer ART's additions show up here as a failure.

Each name gets one verdict:

* HONOURED: a setting of artrl's that does what ART's does. The test named with it must exercise it (its body
  names it); that test checks the effect (a loss, a gradient, an update, a row, a file).
* NOTICED: accepted with one notice per process that says why it changes nothing here (the promise it makes is
  kept anyway, or it configures a part artrl does not have); checked by setting it and reading the notice.
* REFUSED: a ConfigError that names it and says why; checked by setting it. Where some values ask for what artrl
  does anyway, those values are accepted (checked too).
"""

from __future__ import annotations

import ast
import logging
from pathlib import Path
from typing import Any

import pytest
from art_source import art_package

import artrl as art
from artrl.runtime import notices
from artrl.errors import ConfigError
from artrl.local.backend import art_train_overrides
from artrl.config.model import InternalModelConfig
from artrl.types import TrainConfig, TrainSFTConfig

TESTS = Path(__file__).parent

# ------------------------------------------------------------------ ART 0.5.23's names
ART_TRAIN_CONFIG = ("learning_rate", "kl_penalty_coef", "kl_penalty_source", "grad_accumulation_sequences",
                    "optimizer_save_interval", "final_training_step")
ART_TRAIN_SFT_CONFIG = ("learning_rate", "batch_size", "assistant_turns")
ART_DEV_TRAIN_CONFIG = (
    "advantage_balance", "allow_training_without_logprobs", "epsilon", "epsilon_high", "importance_sampling_level",
    "kimi_k2_tau", "kl_penalty_coef", "kl_penalty_reference_step", "kl_penalty_source", "kl_penalty_step_lag",
    "kl_ref_adapter_path", "logprob_calculation_chunk_size", "mask_prob_ratio",
    "max_negative_advantage_importance_sampling_weight", "moe_routing_replay_bundle", "moe_routing_replay_path",
    "moe_routing_replay_strict", "num_trajectories_learning_rate_multiplier_power", "packed_sequence_length",
    "plot_tensors", "ppo", "precalculate_logprobs", "scale_learning_rate_by_reward_std_dev", "scale_rewards",
    "truncated_importance_sampling")
ART_DEV_TRAIN_SFT_CONFIG = ("metric_logging",)
ART_DEV_INTERNAL_MODEL_CONFIG = (
    "init_args", "engine_args", "tinker_args", "tinker_native_args", "trainer_args", "trainer_gpu_ids",
    "inference_gpu_ids", "rollout_weight_update_mode", "chat_template_kwargs", "chat_template", "chat_template_path",
    "chat_template_content_format", "chat_template_tool_schema_format", "vllm_runtime", "allow_unvalidated_arch",
    "megatron_model_initialization")
ART_BACKEND_TRAIN = (
    "learning_rate", "loss_fn", "loss_fn_config", "normalize_advantages", "adam_params", "kl_penalty_coef",
    "kl_penalty_reference_step", "kl_ref_adapter_path", "kl_penalty_source", "epsilon", "epsilon_high",
    "advantage_balance", "scale_rewards", "importance_sampling_level", "max_negative_advantage_importance_sampling_weight",
    "mask_prob_ratio", "kimi_k2_tau", "precalculate_logprobs", "allow_training_without_logprobs", "plot_tensors",
    "truncated_importance_sampling", "scale_learning_rate_by_reward_std_dev", "logprob_calculation_chunk_size",
    "packed_sequence_length", "num_trajectories_learning_rate_multiplier_power", "save_checkpoint",
    "optimizer_save_interval", "final_training_step", "grad_accumulation_sequences", "verbose")

# ------------------------------------------------------------------ verdicts
UPDATE, KEYWORDS, LOSS, SURFACE = ("test_train_call_update.py", "test_backend_train_keywords.py",
                                   "test_loss_art_options.py", "test_art_0523_surface.py")
HONOURED: dict[str, str] = {  # name -> the test file whose tests show its effect
    "learning_rate": UPDATE, "kl_penalty_coef": UPDATE, "kl_penalty_source": UPDATE, "kl_penalty_step_lag": UPDATE,
    "kl_penalty_reference_step": UPDATE, "kl_ref_adapter_path": UPDATE, "epsilon": UPDATE, "epsilon_high": UPDATE,
    "advantage_balance": UPDATE, "scale_rewards": UPDATE, "importance_sampling_level": UPDATE,
    "max_negative_advantage_importance_sampling_weight": UPDATE, "mask_prob_ratio": UPDATE, "kimi_k2_tau": UPDATE,
    "precalculate_logprobs": UPDATE, "allow_training_without_logprobs": UPDATE, "truncated_importance_sampling": UPDATE,
    "num_trajectories_learning_rate_multiplier_power": UPDATE, "ppo": UPDATE,
    "logprob_calculation_chunk_size": SURFACE, "plot_tensors": KEYWORDS, "verbose": KEYWORDS,
    "grad_accumulation_sequences": SURFACE, "packed_sequence_length": "test_pipeline_local.py",
    "loss_fn": "test_pipeline_local.py", "normalize_advantages": "test_pipeline_local.py",
    "save_checkpoint": KEYWORDS, "batch_size": "test_train.py", "assistant_turns": SURFACE,
    "metric_logging": SURFACE, "init_args": "test_dev_config.py", "engine_args": "test_dev_config.py",
    "trainer_args": "test_dev_config.py", "trainer_gpu_ids": "test_dev_config.py",
    "inference_gpu_ids": "test_dev_config.py", "rollout_weight_update_mode": "test_in_flight_lora.py",
}
NOTICED: dict[str, Any] = {  # name -> a value that sets it
    "optimizer_save_interval": 10, "final_training_step": 100, "scale_learning_rate_by_reward_std_dev": True,
    "moe_routing_replay_path": "/bundle", "moe_routing_replay_bundle": object(), "moe_routing_replay_strict": False,
    "tinker_args": {"renderer_name": "qwen3"}, "tinker_native_args": {"renderer_name": "qwen3"},
}
REFUSED: dict[str, tuple[Any, Any]] = {  # name -> (a refused value, a value asking for what artrl does, or NONE)
    "loss_fn_config": ({"clip": 0.2}, None), "adam_params": ({"lr": 1e-4}, None),
    "vllm_runtime": ({"mode": "external", "server_url": "http://h:8000"}, {"mode": "managed"}),
    "megatron_model_initialization": ("random", "pretrained"),
    "allow_unvalidated_arch": ("yes", True),
    "chat_template": ("{{ messages }}", None), "chat_template_path": ("/t.jinja", None),
    "chat_template_kwargs": ({"enable_thinking": False}, {}),
    "chat_template_content_format": ("openai", "auto"), "chat_template_tool_schema_format": ("vllm_openai", "default"),
}
INTERNAL_MODEL_KEYS = set(ART_DEV_INTERNAL_MODEL_CONFIG)
EVERY = set(ART_TRAIN_CONFIG) | set(ART_TRAIN_SFT_CONFIG) | set(ART_DEV_TRAIN_CONFIG) | set(ART_DEV_TRAIN_SFT_CONFIG) \
    | INTERNAL_MODEL_KEYS | set(ART_BACKEND_TRAIN)


def test_every_name_has_exactly_one_verdict():
    verdicts = [set(HONOURED), set(NOTICED), set(REFUSED)]
    assert set().union(*verdicts) == EVERY, sorted(EVERY ^ set().union(*verdicts))
    assert sum(map(len, verdicts)) == len(EVERY)  # no name in two lists


def _test_bodies(file: str) -> list[str]:
    tree = ast.parse((TESTS / file).read_text())
    source = (TESTS / file).read_text()
    bodies = [ast.get_source_segment(source, node) or "" for node in ast.walk(tree)
              if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]
    # module-level tables that parametrized tests read (CASES in test_train_call_update.py)
    bodies += [ast.get_source_segment(source, node) or "" for node in tree.body
               if isinstance(node, (ast.Assign, ast.AnnAssign))]
    return bodies


@pytest.mark.parametrize("name", sorted(HONOURED))
def test_an_honoured_name_is_exercised_by_its_effect_test(name):
    assert any(name in body for body in _test_bodies(HONOURED[name])), f"{HONOURED[name]} never uses {name}"
    if name in INTERNAL_MODEL_KEYS or name == "metric_logging":
        return
    fields = set(TrainConfig.model_fields) | set(TrainSFTConfig.model_fields)
    backend_only = {"loss_fn", "normalize_advantages", "packed_sequence_length", "save_checkpoint", "verbose"}
    assert name in fields or name in backend_only, f"{name} is neither a config field nor a backend.train argument"


@pytest.mark.parametrize("name", sorted(NOTICED))
def test_a_noticed_name_says_why_once(name, caplog):
    notices.forget()
    value = NOTICED[name]
    with caplog.at_level(logging.INFO, logger="artrl.notices"):
        for _ in range(2):
            if name in INTERNAL_MODEL_KEYS:
                InternalModelConfig(**{name: value})
            else:
                InternalModelConfig().call_config(TrainConfig(), {name: value})
    said = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(said) == 1, said
    notices.forget()


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_name_is_refused_naming_it(name):
    bad, same = REFUSED[name]
    if name in INTERNAL_MODEL_KEYS:
        with pytest.raises(ConfigError, match=f"{name}=.* is not supported by artrl: .+"):
            InternalModelConfig(**{name: bad})
        if same is not None:
            InternalModelConfig(**{name: same})  # asks for what artrl does: accepted
        return
    kwargs = dict(loss_fn=None, loss_fn_config=None, normalize_advantages=True, adam_params=None,
                  packed_sequence_length=None, max_length=None)
    with pytest.raises(ConfigError, match=f"{name}="):
        art_train_overrides(**{**kwargs, name: bad})


def test_backend_train_takes_every_keyword():
    import inspect

    params = inspect.signature(art.LocalBackend.train).parameters
    explicit = {n for n, p in params.items() if p.kind == p.KEYWORD_ONLY}
    missing = [k for k in ART_BACKEND_TRAIN if k not in explicit and k not in TrainConfig.model_fields]
    assert missing == []


def test_dev_configs_take_every_key():
    art.dev.TrainConfig(**{k: None for k in ART_DEV_TRAIN_CONFIG})  # keys only: unknown ones raise here
    art.dev.TrainSFTConfig(metric_logging={"enabled": True})
    assert set(ART_TRAIN_SFT_CONFIG) <= set(TrainSFTConfig.model_fields)
    assert set(ART_TRAIN_CONFIG) <= set(TrainConfig.model_fields)


# ------------------------------------------------------------------ against ART's own source, when given

ART_PACKAGE = art_package()


def _class_fields(path: Path, cls: str) -> list[str]:
    tree = ast.parse(path.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    return [s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]


@pytest.mark.skipif(ART_PACKAGE is None, reason="set ART_SOURCE to ART 0.5.23's source to compare with it")
def test_the_lists_are_arts():
    root = ART_PACKAGE
    assert tuple(_class_fields(root / "types.py", "TrainConfig")) == ART_TRAIN_CONFIG
    assert tuple(_class_fields(root / "types.py", "TrainSFTConfig")) == ART_TRAIN_SFT_CONFIG
    assert tuple(_class_fields(root / "dev" / "train.py", "TrainConfig")) == ART_DEV_TRAIN_CONFIG
    assert tuple(_class_fields(root / "dev" / "train.py", "TrainSFTConfig")) == ART_DEV_TRAIN_SFT_CONFIG
    assert tuple(_class_fields(root / "dev" / "model.py", "InternalModelConfig")) == ART_DEV_INTERNAL_MODEL_CONFIG
    tree = ast.parse((root / "local" / "backend.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LocalBackend"]
    (train,) = [n for n in cls.body if isinstance(n, ast.AsyncFunctionDef) and n.name == "train"]
    assert tuple(a.arg for a in train.args.kwonlyargs) == ART_BACKEND_TRAIN
