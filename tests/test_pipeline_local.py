"""PipelineTrainer on LocalBackend with the tiny model, and LocalBackend's ART 0.5.18 additions
(adapter_lease, prune_model_adapters, the train call's keywords)."""

from __future__ import annotations

import asyncio

import pytest
import torch

import artrl as art
from artrl.errors import ConfigError
from artrl.local.backend import art_train_overrides
from artrl.pipeline_trainer import PipelineTrainer

PROMPTS = ["Name a colour.", "Say a number.", "Pick an animal."]
GROUPS_PER_STEP, ROLLOUTS, STEPS = 2, 3, 3
TRAIN = dict(learning_rate=1e-3, loss_fn="cispo", loss_fn_config=None, normalize_advantages=True, adam_params=None)
# Two loss settings. With precalculate_logprobs (ART's: the old logprobs are the trainer's own) the update depends
# on the sampled tokens only, so rollouts may run concurrently (4 workers): batches differ between the two loops,
# tokens do not. With the default loss the old logprobs are the sampled ones, and a row's logprobs differ by float
# noise (~1e-6) with the batch it shares (other rows, padding, peft's mixed-adapter path), which AdamW's first
# steps (near sign(grad)) carry to ~1e-4 relative; so there every request runs alone, in both loops.
BOUND_ZERO_CASES = [({"precalculate_logprobs": True}, False, "artrl/tiny"), ({}, True, "artrl/tiny"),
                    ({}, True, "artrl/tiny-moe")]  # a mixture-of-experts model, its routing replayed


# ---------------------------------------------------------------------------------------------- leases, pruning


def test_adapter_lease_pins_the_inference_name_in_its_context_only(tmp_path):
    backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
    model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny", base_path=str(tmp_path))
    model._attach(backend)
    pruned = []

    class Served:  # the server's side (serve/http/served_models.py) frees adapters; here only what it was asked
        def prune(self, name, retain):
            pruned.append((name, sorted(retain)))

    async def main():
        names = {}

        async def rollout(key, step, gate):
            async with backend.adapter_lease(model, step):
                await gate.wait()
                names[key] = model.get_inference_name()

        gate = asyncio.Event()
        tasks = [asyncio.create_task(rollout("a", 2, gate)), asyncio.create_task(rollout("b", 5, gate))]
        await asyncio.sleep(0)
        assert backend.leases(model).active_steps() == {2, 5}
        assert await backend.prune_model_adapters(model, retain_steps={7}) == {2, 5, 7}  # no server: nothing freed
        backend._served = Served()
        await backend.prune_model_adapters(model, retain_steps={6, 7})
        gate.set()
        await asyncio.gather(*tasks)
        assert names == {"a": "m@2", "b": "m@5"}
        assert model.get_inference_name() == "m" and model.get_inference_name(3) == "m@3"
        assert backend.leases(model).active_steps() == set()

    asyncio.run(main())
    assert pruned == [("m", [2, 5, 6, 7])]


# ---------------------------------------------------------------------------------------------- ART 0.5.18 keywords


@pytest.mark.parametrize("kwargs, expected", [
    (dict(loss_fn="ppo"), {"loss": "ppo"}),
    (dict(loss_fn="cispo"), {"loss": "cispo"}),
    (dict(normalize_advantages=False), {"scale_rewards": False}),
    (dict(normalize_advantages=True), {}),
    (dict(packed_sequence_length=256), {"row_length": 256}),
])
def test_art_train_overrides(kwargs, expected):
    base = dict(loss_fn=None, loss_fn_config=None, normalize_advantages=True, adam_params=None,
                packed_sequence_length=None, max_length=512)
    assert art_train_overrides(**{**base, **kwargs}) == expected


@pytest.mark.parametrize("kwargs, message", [
    (dict(loss_fn="dro"), "loss_fn='cispo'"),
    (dict(loss_fn_config={"clip": 0.1}), "loss_fn_config=None"),
    (dict(adam_params={"beta1": 0.8}), "adam_params=None"),
    (dict(packed_sequence_length=1024), r"exceeds the model's max_length \(512\)"),
    (dict(packed_sequence_length=8), "int >= 16"),
])
def test_art_train_overrides_refuse_what_art_refuses(kwargs, message):
    base = dict(loss_fn=None, loss_fn_config=None, normalize_advantages=True, adam_params=None,
                packed_sequence_length=None, max_length=512)
    with pytest.raises(ConfigError, match=message):
        art_train_overrides(**{**base, **kwargs})


def test_backend_train_takes_art_0_5_18_keywords(tmp_path, make_choice):
    """Through the call: the keywords reach the call's config, a refused one trains nothing."""
    async def main():
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        model = art.TrainableModel(name="kw18", project="p", base_model="artrl/tiny",
                                   _internal_config=art.InternalModelConfig(max_length=128))
        await model.register(backend)
        session = backend._runs["kw18"]
        seen = []
        real = session.train

        def spy(kind, data, cfg, **kw):
            seen.append(cfg)
            return real(kind, data, cfg, **kw)

        session.train = spy
        user = {"role": "user", "content": "Pick a colour."}
        groups = [art.TrajectoryGroup([art.Trajectory(messages_and_choices=[user, make_choice(c)], reward=r)
                                       for c, r in (("blue", 1.0), ("red", 0.0))])]
        result = await backend.train(model, groups, learning_rate=1e-4, loss_fn="ppo", normalize_advantages=False,
                                     packed_sequence_length=64, save_checkpoint=False)
        assert result.step == 1 and result.checkpoint_path is None
        cfg = seen[0]
        assert (cfg.resolved_loss(), cfg.scale_rewards, cfg.row_length, cfg.learning_rate) == ("ppo", False, 64, 1e-4)
        with pytest.raises(ConfigError, match="adam_params=None"):
            await backend.train(model, groups, adam_params={"lr": 1})
        assert await model.get_step() == 1 and len(seen) == 1
        # model.train keeps working next to it
        assert (await model.train(groups, config=art.TrainConfig(learning_rate=1e-4))).step == 2
        await backend.close()

    asyncio.run(main())


# ---------------------------------------------------------------------------------------------- bound 0 == synchronous


def scenario_list() -> list[dict]:
    return [{"metadata": {"scenario_id": i}, "prompt": PROMPTS[i % len(PROMPTS)]}
            for i in range(GROUPS_PER_STEP * STEPS)]


def make_rollout(names: list[tuple[str, int]] | None = None, sequential: bool = False):
    """Seeded requests: the same scenario samples the same tokens from the same weights. The reward has a
    per-rollout term so every group has a reward spread (the pipeline sets spread-less groups aside, the
    synchronous loop trains them)."""

    async def rollout(model, scenario, config) -> art.TrajectoryGroup:
        client = model.openai_client()
        i = scenario["metadata"]["scenario_id"]

        async def one(j: int) -> art.Trajectory:
            msgs = [{"role": "user", "content": scenario["prompt"]}]
            name = model.get_inference_name()
            resp = await client.chat.completions.create(model=name, messages=msgs, max_tokens=6, temperature=1.0,
                                                        logprobs=True, seed=1000 * i + j)
            if names is not None:
                names.append((name, i))
            choice = art.choice_from_completion(resp)
            return art.Trajectory(messages_and_choices=msgs + [choice],
                                  reward=float(len(choice.message.content or "")) + 0.1 * j)

        if sequential:  # each request alone in the engine: the same decode batches in any loop
            return art.TrajectoryGroup([await one(j) for j in range(ROLLOUTS)])
        return art.TrajectoryGroup(await asyncio.gather(*(one(j) for j in range(ROLLOUTS))))

    return rollout


def adapter(backend, name: str) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(backend._runs[name].trainer.model).items()}


def trained_record(groups: list[art.TrajectoryGroup]) -> list[list[tuple[str, list[float]]]]:
    return [[(t.messages_and_choices[-1].message.content, [x.logprob for x in t.messages_and_choices[-1].logprobs.content])
             for t in g.trajectories] for g in groups]


async def open_model(path, base_model: str = "artrl/tiny") -> tuple[art.LocalBackend, art.TrainableModel]:
    backend = art.LocalBackend(path=str(path), show_progress=False)
    model = art.TrainableModel(name="eq", project="p", base_model=base_model,
                               _internal_config=art.InternalModelConfig(seed=0, max_length=128))
    await model.register(backend)
    return backend, model


@pytest.mark.parametrize(("EXTRA", "sequential", "base_model"), BOUND_ZERO_CASES,
                         ids=["precalculated", "sampled-logprobs", "moe"])
def test_bound_zero_pipeline_is_the_synchronous_loop(tmp_path, EXTRA, sequential, base_model):
    async def synchronous():
        backend, model = await open_model(tmp_path / "sync", base_model)
        rollout, scenarios, record = make_rollout(sequential=sequential), scenario_list(), []
        for s in range(STEPS):
            batch = scenarios[s * GROUPS_PER_STEP:(s + 1) * GROUPS_PER_STEP]
            if sequential:
                groups = [await rollout(model, sc, None) for sc in batch]
            else:
                groups = list(await asyncio.gather(*(rollout(model, sc, None) for sc in batch)))
            record.append(trained_record(groups))
            await backend.train(model, groups, save_checkpoint=False, **TRAIN, **EXTRA)
        weights = adapter(backend, "eq")
        await backend.close()
        return record, weights

    async def pipelined():
        backend, model = await open_model(tmp_path / "pipe", base_model)
        record, names, real = [], [], backend.train

        async def spy(model, groups, **kwargs):
            record.append(trained_record(groups))
            return await real(model, groups, **kwargs)

        backend.train = spy
        trainer = PipelineTrainer(model, backend, make_rollout(names, sequential), scenario_list(), None,
                                  num_rollout_workers=1 if sequential else 4, min_batch_size=GROUPS_PER_STEP,
                                  max_steps_off_policy=0, train_kwargs=EXTRA, **TRAIN)
        async with asyncio.timeout(300):
            await trainer.train(handle_signals=False)
        weights = adapter(backend, "eq")
        # every turn sampled from the leased checkpoint of the version the rollout started on
        assert {n for n, _ in names} == {f"eq@{v}" for v in range(STEPS)}
        assert all(n == f"eq@{i // GROUPS_PER_STEP}" for n, i in names)
        await backend.close()
        return record, weights

    sync_record, sync_weights = asyncio.run(synchronous())
    pipe_record, pipe_weights = asyncio.run(pipelined())
    assert [[[c for c, _ in g] for g in step] for step in pipe_record] == \
        [[[c for c, _ in g] for g in step] for step in sync_record]  # the same completions, step for step
    for pipe_step, sync_step in zip(pipe_record, sync_record, strict=True):
        for pipe_group, sync_group in zip(pipe_step, sync_step, strict=True):
            for (_, pipe_lp), (_, sync_lp) in zip(pipe_group, sync_group, strict=True):
                assert pipe_lp == pytest.approx(sync_lp, abs=1e-5)
    assert sync_weights.keys() == pipe_weights.keys()
    moved = [k for k in sync_weights if "lora_B" in k and sync_weights[k].abs().max() > 0]
    assert moved, "the adapter must have moved for the comparison to mean something"
    for k in sync_weights:
        rel = ((pipe_weights[k] - sync_weights[k]).norm() / sync_weights[k].norm().clamp_min(1e-12)).item()
        assert rel <= 1e-5, (k, rel)  # relative per tensor


def test_cost_calculator_is_a_no_op_by_default_and_settable():
    model = art.TrainableModel(name="c", project="p", base_model="artrl/tiny")
    assert model.cost_calculator(10, 5, "train") == {}
    model.set_cost_calculator(lambda p, c, ctx: {f"costs/{ctx}/usd": (p + c) * 1e-6})
    assert model.cost_calculator(10, 5, "train") == {"costs/train/usd": pytest.approx(1.5e-5)}
    model.set_cost_calculator(None)
    assert model.cost_calculator(10, 5, "eval") == {}
