"""ART 0.5.23's `TrainableModel(run_name=..., lora_config=art.LoRAConfig(...))`.

`run_name` is the run's durable lineage (run directory, checkpoints, history, trajectories, tracked run) and
`name` the served alias; `lora_config` shapes the adapter that trains, is saved and is served. Every key of
`LoRAConfig` either changes the adapter (or the config it is built from) or is refused with its name.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from safetensors.torch import load_file

import artrl as art
from artrl.dev.model import LoRAConfig
from artrl.errors import ConfigError
from artrl.config.lora import HONOURED, REFUSED, apply_lora_config, lora_config_fields
from artrl.run import storage
from artrl.config.model import InternalModelConfig

USER = {"role": "user", "content": "Pick a colour."}
SMALL = art.InternalModelConfig(max_length=128)


def groups(make_choice, colours=("blue", "red")) -> list[art.TrajectoryGroup]:
    return [art.TrajectoryGroup([art.Trajectory(messages_and_choices=[USER, make_choice(c)], reward=float(i == 0))
                                 for i, c in enumerate(colours)])]


# ---------------------------------------------------------------------------------------------- run_name
def test_without_run_name_the_layout_is_name_s():
    model = art.TrainableModel(name="agent", project="p", base_model="artrl/tiny", base_path="/x")
    assert model.run_name == "agent" and model._get_output_dir() == "/x/p/models/agent"
    other = art.TrainableModel(name="agent", run_name="agent-run-2", project="p", base_model="artrl/tiny",
                               base_path="/x")
    assert other._get_output_dir() == "/x/p/models/agent-run-2" and other.get_inference_name() == "agent"
    assert other._tracking_config()["run_name"] == "agent-run-2" and "run_name" not in model._tracking_config()


@pytest.mark.parametrize("bad", ["", ".", "..", "a/b", "a\\b"])
def test_run_name_is_validated_like_name(bad):
    with pytest.raises(ValueError, match="run_name"):
        art.TrainableModel(name="agent", run_name=bad, project="p", base_model="artrl/tiny")


def test_the_tracked_run_is_named_after_run_name(tmp_path, monkeypatch):
    from artrl.run.tracking import WandbTracker

    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # the tracker is only built here: nothing starts or connects
    model = art.TrainableModel(name="agent", run_name="run-b", project="p", base_model="artrl/tiny",
                               base_path=str(tmp_path), report_metrics=["wandb"])
    history = model._run_history()
    assert history.run == tmp_path / "p" / "models" / "run-b"
    assert [t.name for t in history.trackers.items if isinstance(t, WandbTracker)] == ["run-b"]


async def _first_token_logprobs(model, step: int | None = None) -> dict[str, float]:
    """The top logprobs of the first token `model`'s own client gets for USER (greedy, so the same request twice
    gives the same answer)."""
    reply = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(step=step), messages=[USER], max_tokens=1, temperature=0, logprobs=True,
        top_logprobs=5)
    return {t.token: round(t.logprob, 4) for t in reply.choices[0].logprobs.content[0].top_logprobs}


def test_two_runs_of_one_name_train_and_serve_side_by_side_on_one_backend(tmp_path, make_choice):
    """One name, two run names, one LocalBackend (ART 0.5.23 keys its services by (project, run)): two run
    directories, each at its own step, each client answered by its own run's weights."""
    def model(run_name: str) -> art.TrainableModel:
        return art.TrainableModel(name="agent", run_name=run_name, project="p", base_model="artrl/tiny",
                                  _internal_config=SMALL)

    a, b = model("run-a"), model("run-b")
    models = tmp_path / "p" / "models"
    logprobs = _first_token_logprobs

    async def scenario(backend: art.LocalBackend) -> None:
        await a.register(backend)
        await b.register(backend)
        # the first run is served as `name`, the other as `name:<run_name>`; each model's client names its own
        assert (a.get_inference_name(), b.get_inference_name()) == ("agent", "agent:run-b")
        assert a.inference_base_url == b.inference_base_url  # one server
        untrained = await logprobs(a)
        assert await logprobs(b) == untrained  # the same base weights, both adapters untrained

        result = await a.train(groups(make_choice), config=art.TrainConfig(learning_rate=5e-2))
        assert result.step == 1 and await b.get_step() == 0  # a shared directory would be at step 1
        trained_a = await logprobs(a)
        assert trained_a != untrained and await logprobs(b) == untrained  # only a's run changed

        result = await b.train(groups(make_choice, ("green", "pink")), config=art.TrainConfig(learning_rate=5e-2))
        assert result.step == 1 and await a.get_step() == 1
        trained_b = await logprobs(b)
        assert trained_b not in (untrained, trained_a) and await logprobs(a) == trained_a
        # each run's checkpoints under its own name; a second handle on run b finds run b
        assert b.get_inference_name(step=0) == "agent:run-b@0" and await logprobs(b, step=0) == untrained
        again = model("run-b")
        await again.register(backend)
        assert again.get_inference_name() == "agent:run-b" and await logprobs(again) == trained_b

    with art.LocalBackend(path=str(tmp_path), show_progress=False) as backend:
        asyncio.run(scenario(backend))

    assert sorted(p.name for p in models.iterdir()) == ["run-a", "run-b"]  # nothing under the served name
    assert art.utils.get_model_step(a, str(tmp_path)) == 1  # ART's reader of a run's step, without a backend
    for run in ("run-a", "run-b"):
        assert storage.list_checkpoints(models / run) == [0, 1]
        assert (models / run / storage.TRAJECTORIES_DIR / "train").is_dir()  # model.train's logged groups
        rows = storage.read_jsonl(models / run / storage.HISTORY_FILE)
        assert [r["step"] for r in rows] == [1]
    weights = [load_file(str(storage.checkpoint_dir(models / run, 1) / storage.ADAPTER_WEIGHTS_FILE))
               for run in ("run-a", "run-b")]
    assert any(not weights[0][k].equal(weights[1][k]) for k in weights[0])  # two runs, two trainings


# ---------------------------------------------------------------------------------------------- lora_config
def test_lora_config_is_exported_as_in_art():
    assert art.LoRAConfig is art.dev.LoRAConfig
    assert art.LoRAConfig(rank=4, alpha=8) == {"rank": 4, "alpha": 8}  # a TypedDict: a plain dict, as in ART


def test_rank_4_adapter_trains_is_saved_and_served(tmp_path, make_choice):
    lora = art.LoRAConfig(rank=4, alpha=8)
    model = art.TrainableModel(name="small", project="p", base_model="artrl/tiny", lora_config=lora,
                               _internal_config=SMALL)
    with art.LocalBackend(path=str(tmp_path), show_progress=False) as backend:
        asyncio.run(model.register(backend))
        asyncio.run(model.train(groups(make_choice), config=art.TrainConfig(learning_rate=1e-2)))
        session = backend._runs["small"]
        assert session.trainer.model.peft_config["default"].r == 4  # the adapter that trains
        engine = session.engine  # the adapter that serves: loaded from the step's checkpoint
        live = engine._versions.versions[1]
        assert (engine.model.peft_config[live].r, engine.model.peft_config[live].lora_alpha) == (4, 8)
        served = {n: p.shape for n, p in engine.model.named_parameters() if f".lora_A.{live}." in n}
        assert served and all(shape[0] == 4 for shape in served.values())

    for step in (0, 1):  # the adapter that is saved
        path = storage.checkpoint_dir(tmp_path / "p" / "models" / "small", step)
        saved = json.loads((path / storage.ADAPTER_CONFIG_FILE).read_text())
        assert (saved["r"], saved["lora_alpha"]) == (4, 8)
        tensors = load_file(str(path / storage.ADAPTER_WEIGHTS_FILE))
        a = {k: v.shape for k, v in tensors.items() if "lora_A" in k}
        b = {k: v.shape for k, v in tensors.items() if "lora_B" in k}
        assert a and all(s[0] == 4 for s in a.values()) and all(s[1] == 4 for s in b.values())


@pytest.mark.slow  # a worker process (the suite's convention for worker tests: `pytest -m slow`)
def test_a_training_worker_builds_the_same_adapter(tmp_path, make_choice):
    """With the trainer in a worker process (train_in_worker; the same path as several workers), the worker builds
    the adapter from the run's config and writes the checkpoint: it is lora_config's, and the engine serves it."""
    lora = art.LoRAConfig(rank=4, alpha=8, layers_to_transform=[1])
    model = art.TrainableModel(name="w", project="p", base_model="artrl/tiny", lora_config=lora,
                               _internal_config=art.InternalModelConfig(max_length=128, train_in_worker=True))
    with art.LocalBackend(path=str(tmp_path), show_progress=False) as backend:
        asyncio.run(model.register(backend))
        result = asyncio.run(model.train(groups(make_choice), config=art.TrainConfig(learning_rate=1e-2)))
        assert result.metrics["train/workers"] == 1
        engine = backend._runs["w"].engine
        assert engine.model.peft_config[engine.live_adapter].r == 4
    path = storage.checkpoint_dir(tmp_path / "p" / "models" / "w", 1)  # written by the worker
    saved = json.loads((path / storage.ADAPTER_CONFIG_FILE).read_text())
    assert (saved["r"], saved["lora_alpha"], saved["layers_to_transform"]) == (4, 8, [1])
    tensors = load_file(str(path / storage.ADAPTER_WEIGHTS_FILE))
    assert {_layer_of(k) for k in tensors} == {1} and all(v.shape[0] == 4 for k, v in tensors.items() if "lora_A" in k)


def test_a_resume_with_other_lora_settings_is_refused(tmp_path):
    def register(**lora):
        model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny", _internal_config=SMALL,
                                   lora_config=art.LoRAConfig(**lora))
        with art.LocalBackend(path=str(tmp_path), show_progress=False) as backend:
            asyncio.run(model.register(backend))

    register(rank=4, alpha=8)
    register(rank=4, alpha=8)  # the same settings resume
    with pytest.raises(ConfigError, match=r"rank \(r\): 4 in the checkpoint, 8 now"):
        register(alpha=8)
    # the same shapes, another scale: the weights would load, so only the check stands between them
    with pytest.raises(ConfigError, match=r"alpha \(lora_alpha\): 8(\.0)? in the checkpoint, 32(\.0)? now.*run_name"):
        register(rank=4, alpha=32)


def test_lora_config_and_internal_config_may_not_disagree():
    with pytest.raises(ConfigError, match=r"lora_config\['rank'\] gives lora_rank=4 .* lora_rank=16"):
        art.TrainableModel(name="m", project="p", base_model="artrl/tiny", lora_config={"rank": 4},
                           _internal_config=art.InternalModelConfig(lora_rank=16))
    same = art.TrainableModel(name="m", project="p", base_model="artrl/tiny", lora_config={"rank": 4},
                              _internal_config=art.InternalModelConfig(lora_rank=4))
    assert apply_lora_config(same.internal_config(), same.lora_config).lora_rank == 4


@pytest.mark.parametrize(("lora", "match"), [
    ({"r": 4}, "peft's name; ART's LoRAConfig calls it 'rank'"),
    ({"lora_alpha": 4}, "calls it 'alpha'"),
    ({"ranks": 4}, "unknown key 'ranks'"),
    ({"rank": 0}, "rank -> lora_rank"),
    ({"dropout": 1.5}, "dropout -> lora_dropout"),
    ([("rank", 4)], "pass art.LoRAConfig"),
])
def test_bad_lora_configs_are_refused_at_construction(lora, match):
    with pytest.raises(ConfigError, match=match):
        art.TrainableModel(name="m", project="p", base_model="artrl/tiny", lora_config=lora)


# Every key of ART's LoRAConfig: (lora_config, the baseline it is compared with, what it must change). A new key
# in LoRAConfig fails test_every_lora_config_key_is_handled until it is given here and in config/lora.py.
def _lora_modules(peft_model, kind="lora_A"):
    return {n: m for n, m in peft_model.named_modules() if n.endswith(f".{kind}.default")}


def _layer_of(name: str) -> int:
    return int(name.split(".layers.")[1].split(".")[0])


def _scaling(peft_model) -> float:
    layer = next(m for n, m in peft_model.named_modules() if n.endswith("q_proj") and hasattr(m, "scaling"))
    return layer.scaling["default"]


HONOURED_CASES = {
    "rank": ({"rank": 4}, {}, lambda p, c: p.peft_config["default"].r == 4
             and all(m.weight.shape[0] == 4 for m in _lora_modules(p).values())),
    "alpha": ({"alpha": 32}, {}, lambda p, c: _scaling(p) == 32 / 8),
    "dropout": ({"dropout": 0.25}, {}, lambda p, c: next(
        getattr(m, "p", 0.0) for n, m in p.named_modules() if n.endswith("lora_dropout.default")) == 0.25),
    "target_modules": ({"target_modules": ["q_proj", "v_proj"]}, {}, lambda p, c: {
        n.split(".")[-3] for n in _lora_modules(p)} == {"q_proj", "v_proj"}),
    "use_rslora": ({"use_rslora": True}, {}, lambda p, c: math.isclose(_scaling(p), 16 / math.sqrt(8))),
    "init_weights": ({"init_weights": False}, {}, lambda p, c: any(
        m.weight.abs().sum() > 0 for m in _lora_modules(p, "lora_B").values())),
    "layers_to_transform": ({"layers_to_transform": [1]}, {}, lambda p, c: {
        _layer_of(n) for n in _lora_modules(p)} == {1}),
    "layers_pattern": ({"layers_to_transform": [2], "layers_pattern": "layers"}, {"layers_to_transform": [2]},
                       lambda p, c: p.peft_config["default"].layers_pattern == "layers"
                       and {_layer_of(n) for n in _lora_modules(p)} == {2}),
    "random_state": ({"random_state": 7}, {}, None),  # None: the adapter's initial weights differ
    "max_seq_length": ({"max_seq_length": 64}, {}, lambda p, c: c.max_length == 64),
    "use_gradient_checkpointing": ({"use_gradient_checkpointing": "unsloth"}, {}, lambda p, c:
                                   p.get_base_model().is_gradient_checkpointing),
}
NO_VALUE = object()  # a refused key without a value that is a no-op here
REFUSED_CASES = {  # key -> (a value that cannot be honoured, the value that is a no-op here)
    "bias": ("all", "none"),
    "modules_to_save": (["lm_head"], None),
    "loftq_config": ({"loftq_bits": 4}, {}),
    "temporary_location": ("/tmp/unsloth", NO_VALUE),
}


def test_every_lora_config_key_is_handled():
    fields = set(lora_config_fields())
    assert fields == set(LoRAConfig.__annotations__) and len(fields) == 15  # ART 0.5.23's keys
    assert set(HONOURED) | set(REFUSED) == fields and not set(HONOURED) & set(REFUSED)
    assert set(HONOURED_CASES) == set(HONOURED) and set(REFUSED_CASES) == set(REFUSED)


def _build(tiny_path, lora):
    from artrl.models.loading import add_lora, load_base_model

    cfg = apply_lora_config(InternalModelConfig(), lora)
    base, _ = load_base_model(str(tiny_path), cfg)
    return add_lora(base, cfg), cfg


def _adapter_state(peft_model):
    return {n: p.detach().clone() for n, p in peft_model.named_parameters() if ".lora_" in n}


@pytest.mark.parametrize("key", sorted(HONOURED_CASES))
def test_each_honoured_key_changes_the_adapter(tiny_path, key):
    lora, baseline, check = HONOURED_CASES[key]
    peft_model, cfg = _build(tiny_path, lora)
    base_model, base_cfg = _build(tiny_path, baseline)
    if check is None:
        mine, theirs = _adapter_state(peft_model), _adapter_state(base_model)
        assert mine.keys() == theirs.keys() and any(not mine[n].equal(theirs[n]) for n in mine)
    else:
        assert check(peft_model, cfg), key
        assert not check(base_model, base_cfg), f"{key}: the baseline passes the check too"


@pytest.mark.parametrize("key", sorted(REFUSED_CASES))
def test_each_refused_key_is_named_in_the_error(key):
    bad, no_op = REFUSED_CASES[key]
    with pytest.raises(ConfigError, match=rf"lora_config\['{key}'\]"):
        art.TrainableModel(name="m", project="p", base_model="artrl/tiny", lora_config={key: bad})
    if no_op is not NO_VALUE:
        model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny", lora_config={key: no_op})
        assert apply_lora_config(model.internal_config(), model.lora_config) == InternalModelConfig()


def test_layers_that_peft_would_not_restrict_are_refused(tiny_path):
    """peft applies layers_to_transform to module names only: with a regex of targets it raises, and on an MoE
    model's fused expert parameters it would adapt every layer; both are ConfigErrors naming the setting."""
    from artrl.models.loading import add_lora, load_base_model

    with pytest.raises(ConfigError, match=r"peft refuses the LoRA settings .*layers_to_transform=\[0\]"):
        _build(tiny_path, {"layers_to_transform": [0], "target_modules": r".*\.q_proj"})
    cfg = apply_lora_config(InternalModelConfig(), {"layers_to_transform": [0]})
    base, _ = load_base_model("artrl/tiny-moe", cfg)
    with pytest.raises(ConfigError, match=r"layers_to_transform=\[0\] with LoRA on the experts"):
        add_lora(base, cfg)
