"""`art.dev`: ART's nested InternalModelConfig mapped onto artrl's, every key accepted, one notice per ignored key."""

from __future__ import annotations

import logging

import pytest

import artrl as art
from artrl.runtime import notices
from artrl.errors import ConfigError
from artrl.types import TrainConfig

NOTICES = "artrl.notices"

# every key of ART 0.5.17's art.dev.TrainConfig
ART_DEV_TRAIN_KEYS = {
    "advantage_balance": 0.2, "allow_training_without_logprobs": True, "epsilon": 0.3, "epsilon_high": 0.5,
    "importance_sampling_level": "sequence", "kimi_k2_tau": 0.1, "kl_penalty_coef": 0.1, "kl_ref_adapter_path": "/x",
    "logprob_calculation_chunk_size": 512, "mask_prob_ratio": True,
    "max_negative_advantage_importance_sampling_weight": 2.0, "num_trajectories_learning_rate_multiplier_power": 0.5,
    "plot_tensors": True, "ppo": True, "precalculate_logprobs": True, "scale_learning_rate_by_reward_std_dev": True,
    "scale_rewards": False, "truncated_importance_sampling": 2.0,
}


@pytest.fixture(autouse=True)
def fresh_notices():
    notices.forget()
    yield
    notices.forget()


def notice_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == NOTICES]


def test_every_art_dev_train_key_is_a_train_config_field():
    options = art.dev.TrainConfig(**ART_DEV_TRAIN_KEYS)
    config = TrainConfig(**options)
    for key, value in ART_DEV_TRAIN_KEYS.items():
        assert getattr(config, key) == value, key
    with pytest.raises(ConfigError, match="unknown TrainConfig options \\['advantage_balanse'\\]"):
        art.dev.TrainConfig(advantage_balanse=0.1)


def test_dev_configs_take_a_mapping_like_arts_typeddicts():
    assert art.dev.TrainConfig({"ppo": True}, epsilon=0.3) == {"ppo": True, "epsilon": 0.3}
    assert art.dev.TrainConfig({"epsilon": 0.1}, epsilon=0.3) == {"epsilon": 0.3}  # keywords win, as dict(m, **kw)
    assert art.dev.TrainSFTConfig({}) == {}
    with pytest.raises(ConfigError, match="advantage_balanse"):
        art.dev.TrainConfig({"advantage_balanse": 0.1})


def test_nested_config_maps_onto_flat_fields(caplog):
    nested = art.dev.InternalModelConfig(
        init_args=art.dev.InitArgs(max_seq_length=512, dtype="bf16", trust_remote_code=True,
                                   use_gradient_checkpointing="unsloth", random_state=7, load_in_4bit=False,
                                   load_in_8bit=True),
        trainer_args=art.dev.TrainerArgs(per_device_train_batch_size=3, gradient_accumulation_steps=4,
                                         adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.1,
                                         max_grad_norm=0.5, optim="paged_adamw_8bit"),
        engine_args=art.dev.EngineArgs(max_num_seqs=6, max_model_len=1024),
    )
    assert isinstance(nested, dict)  # a TypedDict, as in ART
    with caplog.at_level(logging.WARNING, logger=NOTICES):
        cfg = art.InternalModelConfig(**nested)
    assert (cfg.max_length, cfg.dtype, cfg.trust_remote_code, cfg.gradient_checkpointing, cfg.seed) == \
        (512, "bfloat16", True, True, 7)
    assert (cfg.per_device_train_batch_size, cfg.grad_accumulation_sequences, cfg.adam_beta1, cfg.adam_beta2,
            cfg.adam_epsilon, cfg.weight_decay, cfg.max_grad_norm) == (3, 4, 0.8, 0.95, 1e-6, 0.1, 0.5)
    assert (cfg.inference_max_batch_size, cfg.inference_max_length) == (6, 1024)
    assert (cfg.load_in_4bit, cfg.load_in_8bit, cfg.optim) == (False, True, "paged_adamw_8bit")
    assert notice_lines(caplog) == []  # everything given here has a meaning


@pytest.mark.parametrize(("section", "key", "value", "why"), [
    ("init_args", "full_finetuning", True, "LoRA adapter only"),
    ("init_args", "fast_inference", True, "Unsloth's embedded vLLM"),
    ("trainer_args", "lr_scheduler_type", "constant", "Hugging Face's Trainer"),
    ("trainer_args", "learning_rate", 1e-5, "each train call's learning_rate"),
])
def test_ignored_nested_keys_are_noticed_once_each(caplog, section, key, value, why):
    with caplog.at_level(logging.WARNING, logger=NOTICES):
        for _ in range(3):
            cfg = art.InternalModelConfig(**{section: {key: value}})
    lines = notice_lines(caplog)
    assert len(lines) == 1, lines
    assert f"{section}.{key}" in lines[0] and why in lines[0] and "no effect" in lines[0]
    assert cfg == art.InternalModelConfig()  # nothing else changed


@pytest.mark.parametrize(("key", "value", "why"), [
    ("gpu_memory_utilization", 0.8, "no pool to size"),
    ("enforce_eager", True, "vLLM engine argument"),
    ("enable_sleep_mode", True, "nothing is put to sleep"),
])
def test_engine_args_are_kept_for_vllm_and_noticed_once_when_the_builtin_engine_opens(
        caplog, tiny_path, tok, key, value, why):
    from artrl.serve.engines.factory import open_engine
    from artrl.models.loading import load_model

    with caplog.at_level(logging.WARNING, logger=NOTICES):
        cfg = art.InternalModelConfig(engine_args={key: value, "max_num_seqs": 3})
    assert notice_lines(caplog) == []  # the engine is not known yet: vLLM would apply them
    assert cfg.engine_args == {key: value, "max_num_seqs": 3} and cfg.inference_max_batch_size == 3
    model, _ = load_model(str(tiny_path), cfg)
    with caplog.at_level(logging.WARNING, logger=NOTICES):
        for _ in range(2):
            open_engine("builtin", tokenizer=tok, end_ids=frozenset({2}), cfg=cfg, model=model).close()
    lines = notice_lines(caplog)
    assert len(lines) == 1, lines  # max_num_seqs applies (inference_max_batch_size); the other once
    assert f"engine_args.{key}" in lines[0] and why in lines[0] and "no effect" in lines[0]


@pytest.mark.parametrize("key", ["tinker_args", "tinker_native_args"])
def test_top_level_art_keys_are_noticed(caplog, key):
    with caplog.at_level(logging.WARNING, logger=NOTICES):
        art.InternalModelConfig(**{key: {"renderer_name": "x"}})
        art.InternalModelConfig(**{key: {"renderer_name": "x"}})
    assert len(notice_lines(caplog)) == 1 and key in notice_lines(caplog)[0]


def test_arts_gpu_ids_are_honoured_as_training_workers(caplog):
    with caplog.at_level(logging.WARNING, logger=NOTICES):
        cfg = art.InternalModelConfig(trainer_gpu_ids=[0, 1], inference_gpu_ids=[2])
    assert notice_lines(caplog) == []  # not meaningless here: docs/distributed.md
    assert cfg.trainer_gpu_ids == [0, 1] and cfg.inference_gpu_ids == [2]
    assert cfg.distributed and cfg.workers_here == 2


def test_flat_keys_win_over_nested_ones_with_a_notice(caplog):
    with caplog.at_level(logging.WARNING, logger=NOTICES):
        cfg = art.InternalModelConfig(max_length=256, init_args={"max_seq_length": 512},
                                      trainer_args={"adam_beta1": 0.7}, adam_beta1=0.8)
    assert (cfg.max_length, cfg.adam_beta1) == (256, 0.8)
    lines = notice_lines(caplog)
    assert len(lines) == 2 and any("using 256" in line for line in lines) and any("using 0.8" in line for line in lines)


def test_bad_values_in_art_keys_get_the_fields_error():
    with pytest.raises(ConfigError, match="max_length"):
        art.InternalModelConfig(init_args={"max_seq_length": 3})
    with pytest.raises(ConfigError, match="dtype"):
        art.InternalModelConfig(init_args={"dtype": "int3"})


def test_trainable_model_accepts_both_shapes():
    nested = art.TrainableModel(name="a", project="p", base_model="artrl/tiny",
                                _internal_config={"init_args": {"max_seq_length": 64, "random_state": 3}})
    flat = art.TrainableModel(name="b", project="p", base_model="artrl/tiny",
                              _internal_config=art.InternalModelConfig(seed=3, max_length=64))
    assert nested.internal_config() == flat.internal_config()


def test_peft_args_raise_arts_migration_message():
    """ART 0.5.23 removed `peft_args` for `TrainableModel(lora_config=...)`; every way of passing it says so."""
    from artrl.dev.model import PEFT_ARGS_MIGRATION_MESSAGE
    from artrl.local.backend import _internal_config

    message = PEFT_ARGS_MIGRATION_MESSAGE
    assert "r->rank" in message and "lora_config" in message
    with pytest.raises(ConfigError) as e:
        art.dev.PeftArgs(r=4)
    assert str(e.value) == message and isinstance(e.value, ValueError)  # ART raises a ValueError
    with pytest.raises(ConfigError) as e:
        art.InternalModelConfig(peft_args={"r": 4})
    assert str(e.value) == message
    with pytest.raises(ConfigError) as e:
        art.TrainableModel(name="a", project="p", base_model="artrl/tiny", _internal_config={"peft_args": {}})
    assert str(e.value) == message
    model = art.TrainableModel(name="a", project="p", base_model="artrl/tiny")
    object.__setattr__(model, "_internal_config", {"peft_args": {"r": 4}})  # set after construction
    with pytest.raises(ConfigError) as e:
        _internal_config(model)
    assert str(e.value) == message


def test_backend_reads_a_raw_dict_set_after_construction():
    """ART's own test sets `object.__setattr__(model, "_internal_config", {...})`."""
    from artrl.local.backend import _internal_config

    model = art.TrainableModel(name="a", project="p", base_model="artrl/tiny")
    object.__setattr__(model, "_internal_config", {"init_args": {"max_seq_length": 96}})
    assert _internal_config(model).max_length == 96


def test_model_level_trainer_args_are_call_defaults_a_call_can_override():
    cfg = art.InternalModelConfig(trainer_args={"weight_decay": 0.1, "max_grad_norm": 0.5,
                                                "per_device_train_batch_size": 3})
    call = cfg.call_config(TrainConfig(learning_rate=1e-4, max_grad_norm=2.0))
    assert (call.weight_decay, call.max_grad_norm, call.per_device_train_batch_size, call.learning_rate) == \
        (0.1, 2.0, 3, 1e-4)
    sft = cfg.call_config(art.TrainSFTConfig())
    assert (sft.weight_decay, sft.per_device_train_batch_size) == (0.1, 3)
    assert art.InternalModelConfig().call_config(TrainConfig()) == TrainConfig()
    # an override (backend.train's keyword, model.train's _config) beats the call and the model
    over = cfg.call_config(TrainConfig(max_grad_norm=2.0), {"max_grad_norm": 3.0, "weight_decay": 0.0})
    assert (over.max_grad_norm, over.weight_decay, over.per_device_train_batch_size) == (3.0, 0.0, 3)
    with pytest.raises(ConfigError, match="unknown TrainConfig fields"):
        cfg.call_config(TrainConfig(), {"learning_rat": 1.0})
    with pytest.raises(ConfigError, match="contradict"):  # checked once, after the merge
        cfg.call_config(TrainConfig(ppo=True), {"loss": "cispo"})


# --------------------------------------------------------------------------- ART's validation helpers

@pytest.mark.parametrize(("config", "error"), [
    ({}, None),
    ({"init_args": {"model_name": "x"}}, None),
    ({"trainer_gpu_ids": [0], "inference_gpu_ids": [1]}, None),
    ({"trainer_gpu_ids": [0, 1], "inference_gpu_ids": [2]}, None),
    ({"trainer_gpu_ids": [0], "inference_gpu_ids": [1], "init_args": {"fast_inference": False}}, None),
    ({"trainer_gpu_ids": [0]}, "must both be set or both unset"),
    ({"inference_gpu_ids": [1]}, "must both be set or both unset"),
    ({"trainer_gpu_ids": [], "inference_gpu_ids": [1]}, "trainer_gpu_ids must be non-empty"),
    ({"trainer_gpu_ids": [0], "inference_gpu_ids": []}, "inference_gpu_ids must be non-empty"),
    ({"trainer_gpu_ids": [0, 1], "inference_gpu_ids": [1]}, "must not overlap"),
    ({"trainer_gpu_ids": [0], "inference_gpu_ids": [1, 2]}, None),  # ART refuses it; artrl starts a replica per GPU
    # ART 0.5.23: one engine over both GPUs; artrl's replicas cannot honour it, so it is refused, not ignored
    ({"trainer_gpu_ids": [0], "inference_gpu_ids": [1, 2], "engine_args": {"tensor_parallel_size": 2}},
     "one replica each"),
    ({"trainer_gpu_ids": [0], "inference_gpu_ids": [1], "engine_args": {"tensor_parallel_size": 1}}, None),
    ({"trainer_gpu_ids": [1], "inference_gpu_ids": [0]}, "must start at GPU 0"),
    ({"trainer_gpu_ids": [0, 2], "inference_gpu_ids": [1]}, "must be contiguous starting from 0"),
    ({"trainer_gpu_ids": [0], "inference_gpu_ids": [1], "init_args": {"fast_inference": True}},
     "fast_inference is incompatible with dedicated"),
    ({"trainer_gpu_ids": [0], "inference_gpu_ids": [1], "engine_args": {"enable_sleep_mode": True}},
     "enable_sleep_mode is incompatible with dedicated"),
])
def test_dedicated_config_validation(config, error):
    assert art.dev.is_dedicated_mode(config) == ("trainer_gpu_ids" in config and "inference_gpu_ids" in config)
    if error is None:
        art.dev.validate_dedicated_config(config)
    else:
        with pytest.raises(ValueError, match=error):
            art.dev.validate_dedicated_config(config)


def test_openai_server_config_is_built_as_in_art():
    cfg = art.dev.get_openai_server_config("m", "artrl/tiny", "/tmp/log", lora_path="/runs/m/checkpoints/0003",
                                           config={"server_args": {"port": 9000}})
    assert cfg["server_args"]["port"] == 9000 and cfg["server_args"]["api_key"] == "default"
    assert cfg["server_args"]["lora_modules"] == ['{"name": "m@3", "path": "/runs/m/checkpoints/0003"}']
    assert cfg["engine_args"]["served_model_name"] == "artrl/tiny" and cfg["log_file"] == "/tmp/log"
