"""Hostile input (issue 6, point 3): every bad input gets a clear error or a counted skip.

One test per row of the bad-input table in docs/reliability.md (test_the_docs_table_lists_every_test
keeps the two in step). An error must be an `ArtrlError` whose message names the item and the fix,
raised without a chained traceback; a skip must be counted in the train step's metrics. The last
tests feed random trajectory structures through tokenize -> build and a train call: clean ones must
train, and one defect put into a clean one must raise that defect's own error.
"""

from __future__ import annotations

import asyncio
import copy
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from openai.types.chat.chat_completion import Choice

import artrl as art
from artrl.errors import ArtrlError, CheckpointError, ConfigError, PackingError, TrajectoryError
from artrl.run import storage
# the data layer a train call runs, in one place (tokenize, then the build that a call makes of its config)
from artrl.trajectories.sequences import group_advantages
from artrl.trajectories.tokenization import tokenize_groups, tokenize_sft
from artrl.train.call import build_batches
from artrl.train.rl import build_rl
from artrl.train.trainer import BuildContext

DOCS = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"
MAX_LENGTH = 128  # the model maximum of the served test model
USER = {"role": "user", "content": "Pick a colour."}
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


def assert_clear(info: pytest.ExceptionInfo, *fragments: str, cause: bool = False) -> None:
    """An artrl error naming the item and the fix. Its chain: none, or (cause=True) the original error of a
    file that could not be read, kept as `__cause__` (never an error of our own behind it)."""
    err = info.value
    assert isinstance(err, ArtrlError), type(err)
    if cause:
        assert err.__cause__ is None or not isinstance(err.__cause__, ArtrlError), "chained artrl error"
    else:
        assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__), "chained traceback"
    for fragment in fragments:
        assert re.search(fragment, str(err)), f"{fragment!r} not in: {err}"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A registered model whose maximum length is MAX_LENGTH tokens."""
    model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny",
                               _internal_config=art.InternalModelConfig(max_length=MAX_LENGTH))
    backend = art.LocalBackend(path=str(tmp_path_factory.mktemp("hostile")), show_progress=False)
    asyncio.run(model.register(backend))
    yield model
    backend.close()


def rl(model: art.TrainableModel, groups: list, **config: Any) -> art.TrainResult:
    return asyncio.run(model.train(groups, config=art.TrainConfig(**{"learning_rate": 1e-4, **config})))


def sft(model: art.TrainableModel, trajectories: list, **config: Any) -> art.TrainResult:
    return asyncio.run(model.train_sft(trajectories, config=art.TrainSFTConfig(**{"learning_rate": 1e-4, **config})))


def traj(*turns: Any, reward: float = 0.0, **kw: Any) -> art.Trajectory:
    return art.Trajectory(messages_and_choices=[USER, *turns], reward=reward, **kw)


@pytest.fixture()
def good(make_choice):
    """A group that trains: two sampled answers with different rewards."""
    return lambda: art.TrajectoryGroup([traj(make_choice("blue"), reward=1.0), traj(make_choice("red"), reward=0.0)])


# --------------------------------------------------------------------------- rewards and groups


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("when", ["at_construction", "assigned_later"])
def test_non_finite_reward(live, make_choice, good, reward, when):
    if when == "at_construction":
        late = traj(make_choice("blue"), reward=reward)  # accepted, as in ART: refused where it is used
    else:
        late = traj(make_choice("blue"), reward=1.0)
        late.reward = reward  # ART rollouts set the reward after building the trajectory
    step = asyncio.run(live.get_step())
    with pytest.raises(TrajectoryError) as info:
        rl(live, [good(), art.TrajectoryGroup([late, traj(make_choice("red"))])])
    assert_clear(info, r"group 1, trajectory 0: Trajectory\.reward is (nan|inf|-inf)", "finite")
    assert asyncio.run(live.get_step()) == step


def test_malformed_group_is_refused():
    with pytest.raises(TrajectoryError) as info:
        art.TrajectoryGroup([traj(), "not a trajectory"])
    assert_clear(info, r"trajectories\[1\] has type str")


@pytest.mark.parametrize("members", ["failed_rollouts", "none"])
def test_group_of_failed_rollouts_only_is_skipped_and_counted(live, good, members):
    failed = [RuntimeError("rollout crashed"), TimeoutError()] if members == "failed_rollouts" else []
    result = rl(live, [good(), art.TrajectoryGroup(failed)])
    assert result.metrics["data/groups_skipped_empty"] == 1
    assert result.metrics["data/rollout_exceptions"] == len(failed)
    assert result.checkpoint_path is not None


def test_group_of_one_is_skipped_and_counted(live, make_choice, good):
    result = rl(live, [good(), art.TrajectoryGroup([traj(make_choice("green"), reward=1.0)])])
    assert result.metrics["data/groups_skipped_zero_advantage"] == 1 and result.metrics["data/sequences"] == 2


def test_all_equal_rewards_group_is_skipped_and_counted(live, make_choice, good):
    same = art.TrajectoryGroup([traj(make_choice(c), reward=0.5) for c in ("green", "pink", "teal")])
    result = rl(live, [good(), same])
    assert result.metrics["data/groups_skipped_zero_advantage"] == 1 and result.metrics["data/sequences"] == 2


def test_a_call_with_nothing_to_train_advances_the_step_with_the_same_weights(live, make_choice, caplog):
    """ART's step semantics: the loop's step keeps moving; the checkpoint holds the unchanged weights."""
    step = asyncio.run(live.get_step())
    trainer = live.backend()._runs["m"].trainer
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    with caplog.at_level("WARNING", logger="artrl.local.session"):
        result = rl(live, [art.TrajectoryGroup([traj(make_choice("blue"), reward=1.0)]),
                           art.TrajectoryGroup([traj(make_choice("red"), reward=0.0), traj(make_choice("red"))])])
    assert result.step == step + 1 == asyncio.run(live.get_step())
    assert result.checkpoint_path is not None and storage.is_complete(Path(result.checkpoint_path))
    assert result.metrics["data/groups_skipped_zero_advantage"] == 2
    assert "train/loss" not in result.metrics and "loss/train" not in result.metrics  # no optimizer step ran
    assert "nothing was trained" in caplog.text
    for n, p in trainer.model.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.detach(), before[n]), n
    from safetensors.torch import load_file
    saved = load_file(str(Path(result.checkpoint_path) / storage.ADAPTER_WEIGHTS_FILE))
    previous = load_file(str(storage.checkpoint_dir(Path(result.checkpoint_path).parents[1], step)
                             / storage.ADAPTER_WEIGHTS_FILE))
    assert saved.keys() == previous.keys() and all(torch.equal(saved[k], previous[k]) for k in saved)


@pytest.mark.parametrize("kind", ["rl", "sft", "sft_no_messages"])
def test_trajectory_without_assistant_turn_is_skipped_and_counted(live, make_choice, good, kind):
    if kind == "rl":
        no_turn = art.TrajectoryGroup([traj(reward=1.0), traj(make_choice("red"), reward=0.0)])
        result = rl(live, [good(), no_turn])
        assert result.metrics["data/sequences"] == 3
    else:
        empty = traj() if kind == "sft" else art.Trajectory(messages_and_choices=[], reward=0.0)
        result = sft(live, [traj({"role": "assistant", "content": "blue"}), empty])
        assert result.metrics["data/sequences"] == 1
    assert result.metrics["data/trajectories_without_trainable_tokens"] == 1


# --------------------------------------------------------------------------- logprobs and turns


def test_missing_logprobs_train_on_policy_unless_required(live, make_choice):
    group = art.TrajectoryGroup([traj(make_choice("blue", logprobs=False), reward=1.0),
                                 traj(make_choice("red", logprobs=False), reward=0.0)])
    result = rl(live, [group])
    assert result.metrics["data/turns_missing_logprobs"] == 2 and result.checkpoint_path
    assert "train/sampled_logprob_delta_max" not in result.metrics  # nothing sampled to compare with
    with pytest.raises(TrajectoryError) as info:
        rl(live, [group], require_logprobs=True)
    assert_clear(info, "group 0, trajectory 0: a sampled turn carries no logprobs", "require_logprobs",
                 "logprobs=True")
    with pytest.raises(ConfigError) as info:
        rl(live, [group], require_logprobs=True, allow_training_without_logprobs=True)
    assert_clear(info, "require_logprobs=True", "allow_training_without_logprobs=True", "set only one")


def _edit_logprobs(choice: Choice, how: str) -> Choice:
    data = choice.model_dump()
    content = data["logprobs"]["content"]
    if how == "fewer":
        del content[-1]
    elif how == "more":
        content.append(dict(content[-1]))
    else:
        content[0]["logprob"] = {"nan": math.nan, "positive": 0.5}[how]
    return Choice.model_validate(data)


@pytest.mark.parametrize("how", ["fewer", "more", "nan", "positive"])
def test_misaligned_or_invalid_logprobs_are_refused(live, make_choice, good, how):
    bad = _edit_logprobs(make_choice("a longer answer"), how)
    group = art.TrajectoryGroup([traj(make_choice("x"), reward=1.0), traj(bad, reward=0.0)])
    with pytest.raises(TrajectoryError) as info:
        rl(live, [good(), group])
    assert_clear(info, r"group 1, trajectory 1: messages_and_choices\[1\]",
                 "align one to one|must be finite and <= 0")


def test_choice_with_no_sampled_tokens_is_refused(live, make_choice, good):
    empty = make_choice("blue")
    empty.model_extra["token_ids"] = []
    with pytest.raises(TrajectoryError) as info:
        rl(live, [good(), art.TrajectoryGroup([traj(empty, reward=1.0), traj(make_choice("red"))])])
    assert_clear(info, r"group 1, trajectory 0: messages_and_choices\[1\] is a Choice with no sampled tokens")


BAD_CALL = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}


@pytest.mark.parametrize("arguments", ["{not json", "[1, 2]"])
@pytest.mark.parametrize("when", ["at_construction", "appended_later"])
def test_tool_call_with_invalid_json_arguments(live, arguments, when):
    call = copy.deepcopy(BAD_CALL)
    call["tool_calls"][0]["function"]["arguments"] = arguments
    fragments = (r"tool_calls\[0\]\.function\.arguments (is not valid JSON|must encode a JSON object)",)
    if when == "at_construction":
        t = traj({"role": "assistant", "content": "ok"}, call)  # accepted, as in ART: refused where it is used
    else:
        t = traj({"role": "assistant", "content": "ok"})
        t.messages_and_choices.append(call)  # appended after construction, as rollouts do
    with pytest.raises(TrajectoryError) as info:
        sft(live, [traj({"role": "assistant", "content": "fine"}), t])
    assert_clear(info, r"trajectories\[1\]: .*messages_and_choices\[2\]", *fragments)


@pytest.mark.parametrize("when", ["at_construction", "appended_later"])
def test_unknown_role(live, when):
    robot = {"role": "robot", "content": "beep"}
    if when == "at_construction":
        t = traj({"role": "assistant", "content": "ok"}, robot)  # accepted, as in ART: refused where it is used
    else:
        t = traj({"role": "assistant", "content": "ok"})
        t.messages_and_choices.append(robot)
    with pytest.raises(TrajectoryError) as info:
        sft(live, [t])
    assert_clear(info, r"trajectories\[0\]: .*messages_and_choices\[2\]\.role is 'robot'; expected one of")


PNG_URL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAE"
           "lFTkSuQmCC")  # one red pixel


@pytest.mark.parametrize("content,remedy", [
    (42, "string|text parts"), ({"text": "hi"}, "string|text parts"), (None, "string|text parts"),
    ([{"type": "image_url", "image_url": {"url": "x"}}], "an image URL is a data: URL"),
    ([{"type": "image_url", "image_url": {"url": PNG_URL}}], "has no vision tower: it reads text only"),
], ids=["int", "dict", "none_for_user", "image_part_without_a_url", "image_for_a_text_model"])
def test_non_string_content_is_refused(live, content, remedy):
    t = art.Trajectory(messages_and_choices=[{"role": "user", "content": content},
                                             {"role": "assistant", "content": "ok"}], reward=0.0)
    with pytest.raises(TrajectoryError) as info:
        sft(live, [t])
    assert_clear(info, r"trajectories\[0\]: .*messages_and_choices\[0\]\.content", remedy)


# --------------------------------------------------------------------------- length and templates


@pytest.mark.parametrize("policy", ["drop", "truncate", "error"])
def test_trajectory_longer_than_the_model_maximum(live, make_choice, good, policy):
    words = " ".join(["colour"] * 3 * MAX_LENGTH)
    long = art.TrajectoryGroup([traj(make_choice(words), reward=1.0), traj(make_choice("red"), reward=0.0)])
    if policy == "error":
        with pytest.raises(PackingError) as info:
            rl(live, [good(), long], on_too_long="error")
        assert_clear(info, r"group 1, trajectory 0 has \d+ tokens, more than the row length 128",
                     "on_too_long='drop' or 'truncate'")
        return
    result = rl(live, [good(), long], on_too_long=policy)
    assert result.metrics["data/dropped" if policy == "drop" else "data/truncated"] == 1
    assert result.metrics["data/row_length"] <= MAX_LENGTH


def test_chat_template_that_cannot_render_tools(tok, make_choice):
    no_tools = copy.deepcopy(tok)
    no_tools.chat_template = ("{% if tools %}{{ raise_exception('tools are not supported') }}{% endif %}"
                              "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    group = art.TrajectoryGroup([traj(make_choice("a"), reward=1.0, tools=TOOLS), traj(make_choice("b"), tools=TOOLS)])
    with pytest.raises(TrajectoryError) as info:
        tokenize_groups([group], no_tools)
    assert_clear(info, "group 0, trajectory 0: the chat template could not render", "may not support tools",
                 "tools are not supported")


# --------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A run directory with checkpoints 0 and 1 (the model is not registered anywhere any more)."""
    root = tmp_path_factory.mktemp("ckpt")

    async def main():
        model = art.TrainableModel(name="m", project="p", base_model="artrl/tiny")
        backend = art.LocalBackend(path=str(root), show_progress=False)
        await model.register(backend)
        await model.train_sft([traj({"role": "assistant", "content": "blue"})],
                              config=art.TrainSFTConfig(learning_rate=1e-3))
        backend.close()

    asyncio.run(main())
    return root


def _register_copy(trained_run: Path, dest: Path, edit, base_model: str = "artrl/tiny") -> None:
    shutil.copytree(trained_run, dest)
    edit(storage.run_dir(dest, "p", "m"))
    model = art.TrainableModel(name="m", project="p", base_model=base_model)
    backend = art.LocalBackend(path=str(dest), show_progress=False)
    try:
        asyncio.run(model.register(backend))
    finally:
        backend.close()


def _set_marker_base(run: Path) -> None:
    path = storage.checkpoint_dir(run, 1) / storage.COMPLETE_MARKER
    path.write_text(path.read_text().replace("artrl/tiny", "Qwen/Qwen3-8B"))


def _set_model_json_base(run: Path) -> None:
    storage.write_json_atomic(run / storage.MODEL_FILE, {"base_model": "Qwen/Qwen3-8B"})


@pytest.mark.parametrize("where", ["model_json", "checkpoint_marker"])
def test_checkpoint_directory_from_another_base_model(trained_run, tmp_path, where):
    edit = _set_model_json_base if where == "model_json" else _set_marker_base
    with pytest.raises(CheckpointError) as info:
        _register_copy(trained_run, tmp_path / "run", edit)
    assert_clear(info, "Qwen/Qwen3-8B", "artrl/tiny", "new model name|another model name")


class _Payload:
    """Unpickling this would create a directory: a checkpoint must never run code."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (os.mkdir, (self.target,))


def _corrupt(what: str, sentinel: Path):
    def edit(run: Path) -> None:
        ckpt = storage.checkpoint_dir(run, 1)
        adapter = ckpt / storage.ADAPTER_WEIGHTS_FILE
        if what == "adapter_truncated":
            data = adapter.read_bytes()
            adapter.write_bytes(data[: len(data) // 2])
        elif what == "adapter_garbage":
            adapter.write_bytes(os.urandom(4096))
        elif what == "adapter_missing":
            adapter.unlink()
        elif what == "adapter_without_tensors":
            from safetensors.torch import save_file

            save_file({"unrelated": torch.zeros(2)}, str(adapter))
        elif what == "adapter_wrong_shape":
            from safetensors.torch import load_file, save_file

            save_file({k: torch.zeros(v.shape[0] + 1, *v.shape[1:]) for k, v in load_file(str(adapter)).items()},
                      str(adapter))
        elif what == "optimizer_garbage":
            (ckpt / storage.OPTIMIZER_FILE).write_bytes(b"\x80\x04garbage")
        elif what == "optimizer_runs_code":
            torch.save({"optimizer": _Payload(str(sentinel)), "torch_rng": 0, "python_rng": 0},
                       ckpt / storage.OPTIMIZER_FILE)
        elif what == "trainer_state_garbage":
            (ckpt / storage.TRAINER_STATE_FILE).write_text("{")
        elif what == "marker_garbage":
            (ckpt / storage.COMPLETE_MARKER).write_text("not json")
        else:
            raise AssertionError(what)

    return edit


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
@pytest.mark.parametrize("what", ["adapter_truncated", "adapter_garbage", "adapter_missing", "adapter_without_tensors",
                                  "adapter_wrong_shape", "optimizer_garbage", "optimizer_runs_code",
                                  "trainer_state_garbage", "marker_garbage"])
def test_corrupted_checkpoint_is_refused(trained_run, tmp_path, what):
    sentinel = tmp_path / "code-ran"
    with pytest.raises(CheckpointError) as info:
        _register_copy(trained_run, tmp_path / "run", _corrupt(what, sentinel))
    assert_clear(info, re.escape(str(Path("checkpoints") / "0001")), "Delete that directory to resume from the "
                 "previous checkpoint", cause=True)
    assert not sentinel.exists(), "loading a checkpoint ran code from it"


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(("kind", "config", "fragment"), [
    ("rl", dict(per_device_train_batch_size=4, grad_accumulation_sequences=2),
     "per_device_train_batch_size=4 is larger than grad_accumulation_sequences=2.*Lower"),
    ("rl", dict(max_tokens_per_microbatch=64, row_length=128), "no row fits a micro-batch; raise"),
    ("rl", dict(row_length=128, max_row_length=64), "row_length=128 exceeds max_row_length=64"),
    ("rl", dict(ppo=True, loss="cispo"), "ppo=True and loss='cispo' contradict"),
    ("rl", dict(row_length=4096), "row_length=4096 exceeds the model's maximum length 128; lower"),
    ("rl", dict(per_device_train_batch_size=0), "per_device_train_batch_size"),
    ("rl", dict(learning_rate=-1.0), "learning_rate"),
    ("rl", dict(batch_sise=8), "batch_sise"),
    ("sft", dict(learning_rate=[1e-3, 1e-3, 1e-3], batch_size=1), "has 3 values but this call makes 2"),
    ("sft", dict(batch_size=0), r"batch_size=0; it must be >= 1 or 'auto'"),
], ids=["micro_over_step", "token_budget_under_row", "row_over_max_row", "ppo_vs_cispo", "row_over_model",
        "zero_micro_batch", "negative_lr", "unknown_field", "lr_list_length", "zero_sft_batch"])
def test_contradictory_or_invalid_batch_settings(live, make_choice, good, kind, config, fragment):
    step = asyncio.run(live.get_step())
    with pytest.raises((ConfigError, PackingError)) as info:
        if kind == "rl":
            rl(live, [good()], **config)
        else:
            sft(live, [traj({"role": "assistant", "content": c}) for c in ("a", "b")], **config)
    assert_clear(info, fragment)
    assert asyncio.run(live.get_step()) == step


def test_not_a_group_passed_to_train(live, make_choice):
    with pytest.raises(ConfigError) as info:
        rl(live, [traj(make_choice("blue"), reward=1.0)])
    assert_clear(info, r"trajectory_groups\[0\] is a Trajectory; expected a TrajectoryGroup")


# --------------------------------------------------------------------------- non-finite training


def test_non_finite_loss_refuses_the_optimizer_step(tmp_path, make_choice, good, caplog):
    """A diverged adapter: every step of the call is refused, NonFiniteError, nothing advances or is saved."""
    async def main():
        model = art.TrainableModel(name="nan", project="p", base_model="artrl/tiny")
        backend = art.LocalBackend(path=str(tmp_path), show_progress=False)
        await model.register(backend)
        trainer = backend._runs["nan"].trainer
        name, poisoned = next((n, p) for n, p in trainer.model.named_parameters() if "lora_B" in n)
        with torch.no_grad():
            poisoned.fill_(math.nan)  # a diverged adapter: every loss is NaN from here on
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        steps_before = trainer.optimizer_steps
        with pytest.raises(art.NonFiniteError, match="all 1 optimizer steps .* refused"):
            await model.train([good(), good()], config=art.TrainConfig(learning_rate=1e-3,
                                                                       grad_accumulation_sequences=2))
        after = {n: p.detach() for n, p in trainer.model.named_parameters() if p.requires_grad}
        step = await model.get_step()
        backend.close()
        return before, after, steps_before, trainer.optimizer_steps, name, step

    with caplog.at_level("ERROR"):
        before, after, steps_before, steps_after, name, step = asyncio.run(main())
    assert steps_after == steps_before and step == 0
    ckpts = storage.run_dir(tmp_path, "p", "nan") / storage.CHECKPOINTS_DIR
    assert [int(c.name) for c in ckpts.glob("[0-9]*") if int(c.name) > 0] == []  # nothing saved for step 1
    for n in before:
        assert torch.equal(before[n], after[n]) or (n == name and after[n].isnan().all()), n
    assert "optimizer step refused" in caplog.text


# --------------------------------------------------------------------------- random structures
#
# Clean structures (valid trajectories, any mix of what a rollout may legitimately produce, and a batch
# configuration that satisfies the documented rules) must go through tokenize -> build (steps, rows,
# micro-batches) with every figure accounted for, and through a real train call. Dirty ones are a clean
# structure with exactly ONE defect, which must raise that defect's own error naming the item.

ROLES = ["system", "user", "assistant", "tool", "developer"]
TEXT = st.text(alphabet="ab cd,.{}\"\n", min_size=0, max_size=12)


@st.composite
def _choice(draw, tok) -> Choice:
    """A sampled turn: ids with or without an end of turn, aligned logprobs or none (on-policy), the server's
    ids and prompt record or neither (the rendering fallback)."""
    text = draw(TEXT)
    end = draw(st.booleans()) or not text  # a choice samples at least one token
    ids = tok(text + ("<|im_end|>" if end else ""), add_special_tokens=False).input_ids
    data: dict[str, Any] = {"index": 0, "finish_reason": "stop" if end else "length",
                            "message": {"role": "assistant", "content": text}, "logprobs": None}
    if draw(st.booleans()):
        data["logprobs"] = {"content": [{"token": "t", "logprob": -draw(st.floats(0, 5)), "bytes": None,
                                         "top_logprobs": []} for _ in ids]}
    if draw(st.booleans()):
        data["token_ids"] = ids
        if draw(st.booleans()):  # the server's record of the prompt this turn was sampled from
            data["prompt_token_ids"] = tok("<|im_start|>user\n" + text + "<|im_end|>\n<|im_start|>assistant\n",
                                           add_special_tokens=False).input_ids
    return Choice.model_validate(data)


@st.composite
def _message(draw, tok):
    """One valid entry of messages_and_choices."""
    kind = draw(st.sampled_from(["plain"] * 4 + ["parts", "tool_call"] + ["choice"] * 5))
    if kind == "choice":
        return draw(_choice(tok))
    text = draw(TEXT)
    if kind == "plain":
        return {"role": draw(st.sampled_from(ROLES)), "content": text}
    if kind == "parts":
        return {"role": "user", "content": [{"type": "text", "text": text}]}
    return {"role": "assistant", "content": draw(st.sampled_from([None, text])),
            "tool_calls": [{"id": "c", "type": "function",
                            "function": {"name": "add", "arguments": draw(st.sampled_from(['{"a": 1}', "{}"]))}}]}


@st.composite
def _structure(draw, tok, max_length: int | None = None):
    """A clean structure: data and a batch configuration within the documented rules (types.TrainConfig.check,
    docs/batching.md): row_length <= the model maximum and <= max_tokens_per_microbatch, a micro-batch no larger
    than grad_accumulation_sequences, one way of cutting steps, and on_too_long 'drop' or 'truncate' ('error'
    asks for a refusal: a defect below)."""
    message = _message(tok)

    def trajectory():
        return {"messages_and_choices": draw(st.lists(message, min_size=1, max_size=5)),
                "reward": draw(st.sampled_from([0.0, 1.0, 0.5, -2.0])),
                "tools": draw(st.sampled_from([None, TOOLS])),
                "additional_histories": draw(st.lists(st.builds(dict, messages_and_choices=st.lists(
                    message, max_size=3)), max_size=1))}

    sizes = st.sampled_from([0, 1, 2, 2, 3, 3])  # empty groups and calls are counted skips, not errors
    sft = draw(st.booleans())
    max_length = max_length or draw(st.sampled_from([64, 512, 512]))
    row_length = draw(st.sampled_from([None, None, None] + [n for n in (16, 64, 256) if n <= max_length]))
    max_tokens = draw(st.sampled_from([None, None, 16, 128, 600]))
    if row_length is not None and max_tokens is not None and max_tokens < row_length:
        max_tokens = None
    per_device = draw(st.integers(1, 4))
    accumulation = None if sft else draw(st.sampled_from([None, 1, 3]))
    if accumulation is not None and max_tokens is None:
        per_device = min(per_device, accumulation)
    return {
        "sft": sft, "groups": [[trajectory() for _ in range(draw(sizes))] for _ in range(draw(sizes))],
        "failed_rollouts": draw(st.integers(0, 1)), "allow_missing": draw(st.booleans()),
        "scale": draw(st.booleans()), "max_length": max_length, "row_length": row_length,
        "on_too_long": draw(st.sampled_from(["drop", "truncate"])), "share": draw(st.booleans()),
        "per_device": per_device, "max_tokens": max_tokens, "accumulation": accumulation,
        "units_per_step": None if accumulation is not None else draw(st.sampled_from([None, 1, 2])),
        "require_logprobs": False,
    }


def _config(s: dict) -> art.TrainConfig | art.TrainSFTConfig:
    """The call's configuration, checked as a train call checks it."""
    batch = dict(row_length=s["row_length"], on_too_long=s["on_too_long"], share_prompts=s["share"],
                 per_device_train_batch_size=s["per_device"], max_tokens_per_microbatch=s["max_tokens"])
    if s["sft"]:
        cfg: Any = art.TrainSFTConfig(learning_rate=1e-4, batch_size=s["units_per_step"] or "auto", **batch)
    else:
        cfg = art.TrainConfig(learning_rate=1e-4, scale_rewards=s["scale"], require_logprobs=s["require_logprobs"],
                              allow_training_without_logprobs=s["allow_missing"],
                              grad_accumulation_sequences=s["accumulation"],
                              groups_per_optimizer_step=s["units_per_step"], **batch)
    cfg.check()
    return cfg


def _groups(s: dict) -> list[art.TrajectoryGroup]:
    return [art.TrajectoryGroup([art.Trajectory(**copy.deepcopy(t)) for t in g],
                                exceptions=[RuntimeError("x")] * s["failed_rollouts"]) for g in s["groups"]]


def _trajectories(s: dict) -> list[art.Trajectory]:
    return [art.Trajectory(**copy.deepcopy(t)) for g in s["groups"] for t in g]


def _has_trainable(t: art.Trajectory, dicts_too: bool) -> bool:
    """A Choice; with allow_training_without_logprobs (ART's meaning), an assistant dict as well."""
    return any(isinstance(m, Choice) or (dicts_too and m.get("role") == "assistant")
               for h in [t, *t.additional_histories] for m in h.messages_and_choices)


def _build(s: dict, units: list, cfg: Any):
    """What a train call builds from its tokenized units (train/rl.py, train/sft.py through build_batches)."""
    ctx = BuildContext(tokenizer=None, end_ids=frozenset(), max_length=s["max_length"], pad_id=0, device_type="cpu",
                       optimizer_steps=0)
    if s["sft"]:
        return build_batches(units, cfg, ctx, units_per_step=cfg.resolved_batch_size(len(units)))
    return build_rl(units, cfg, ctx)


def _run_structure(s: dict, tok) -> None:
    """config -> tokenize -> build, checking every figure against the input."""
    cfg = _config(s)
    if s["sft"]:
        trajectories = _trajectories(s)
        res = tokenize_sft(trajectories, tok)
        assert res.stats.trajectories == len(trajectories)
        expected_groups = len(trajectories) - res.stats.trajectories_without_trainable_tokens
    else:
        groups = _groups(s)
        res = tokenize_groups(groups, tok, scale_rewards=s["scale"], allow_training_without_logprobs=s["allow_missing"],
                              require_logprobs=s["require_logprobs"])
        st_ = res.stats
        assert st_.groups == len(groups) and st_.trajectories == sum(len(g.trajectories) for g in groups)
        assert st_.rollout_exceptions == len(groups) * s["failed_rollouts"]
        assert st_.groups_skipped_empty == sum(1 for g in groups if not g.trajectories)
        zero = [g for g in groups if g.trajectories and all(
            a == 0 for a in group_advantages([t.reward for t in g.trajectories], s["scale"]))]
        assert st_.groups_skipped_zero_advantage == len(zero)
        expected_groups = sum(1 for g in groups if g.trajectories and not any(g is z for z in zero)
                              and any(_has_trainable(t, s["allow_missing"]) for t in g.trajectories))
    assert len(res.groups) == expected_groups
    seqs = res.sequences
    assert res.stats.sequences == len(seqs) and res.stats.trainable_tokens == sum(x.n_trainable for x in seqs)
    for x in seqs:
        assert len(x.token_ids) == len(x.trainable_mask) == len(x.logprobs) and x.n_trainable > 0
        assert all(math.isnan(lp) for lp, m in zip(x.logprobs, x.trainable_mask) if not m)
        assert all(math.isnan(lp) or (math.isfinite(lp) and lp <= 1e-3) for lp in x.logprobs)
        assert math.isfinite(x.advantage)
    if not res.groups:
        event("clean input: nothing to train (counted)")
        return

    built = _build(s, res.groups, cfg)
    ps = built.stats
    bound = s["row_length"] or min(s["max_length"], s["max_tokens"] or s["max_length"])
    if built.packed is None:  # every sequence was longer than a row: dropped, each counted
        assert ps.dropped == len(seqs) and all(len(x) > bound for x in seqs)
        event("clean input: everything too long (counted)")
        return
    packed, plan = built.packed, built.plan
    assert ps.sequences + ps.dropped == len(seqs) and ps.truncated <= ps.sequences
    assert ps.dropped == sum(1 for x in seqs if len(x) > bound and (s["on_too_long"] == "drop" or x.first_trainable
                                                                   >= bound))
    assert ps.rows == packed.num_rows and ps.real_tokens == int(packed.lengths.sum())
    assert ps.trainable_tokens == int(packed.trainable_mask.sum()) <= res.stats.trainable_tokens
    assert all(len(x) <= packed.row_length <= bound for x in packed.sequences)
    assert bool((packed.weights[~packed.trainable_mask] == 0).all())
    assert int(packed.lengths.max()) <= packed.row_length
    assert sorted(r for step in plan.steps for r in step.rows) == list(range(packed.num_rows))
    assert sum(step.trainable_tokens for step in plan.steps) == ps.trainable_tokens
    for step in plan.steps:
        assert s["accumulation"] is None or len(step.rows) <= s["accumulation"]
        for mb in step.micro_batches:
            assert mb.tokens <= s["max_tokens"] if s["max_tokens"] else len(mb.rows) <= s["per_device"]
    event(f"clean input: {packed.num_rows} rows, {len(plan.steps)} steps")


# One defect each: how to put it into a clean structure, and the error (class, message) it must raise. A
# defect in a trajectory goes into one the call reads in full (RL: in a group of two different rewards); the
# error must name that trajectory and entry.

def _logprobs(values: list[float]) -> dict:
    return {"content": [{"token": "t", "logprob": v, "bytes": None, "top_logprobs": []} for v in values]}


def _sampled(tok, text: str = "blue", **fields: Any) -> Choice:
    """A sampled turn with our server's ids and aligned logprobs; `fields` replace its keys ('logprobs' may be a
    function of the number of sampled ids)."""
    ids = tok(text + "<|im_end|>", add_special_tokens=False).input_ids
    data = {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text},
            "logprobs": _logprobs([-0.5] * len(ids)), "token_ids": ids, **fields}
    if callable(data["logprobs"]):
        data["logprobs"] = data["logprobs"](len(ids))
    return Choice.model_validate(data)


def _trainable_place(s: dict, draw) -> tuple[int, int]:
    """(group, trajectory) of a trajectory the call reads in full: RL reads only groups whose rewards differ."""
    if not any(s["groups"]):
        s["groups"].append([])
    g = draw(st.sampled_from([i for i, grp in enumerate(s["groups"]) if grp] or [len(s["groups"]) - 1]))
    s["groups"][g] = [dict(t) for t in s["groups"][g]]
    while len(s["groups"][g]) < 2:
        s["groups"][g].append({"messages_and_choices": [USER], "reward": 0.0})
    t = draw(st.integers(0, len(s["groups"][g]) - 1))
    for i, other in enumerate(s["groups"][g]):
        other["reward"] = 1.0 if i == t else 0.0
    return g, t


def _where(s: dict, g: int, t: int) -> str:
    """How an error names that trajectory: its group and index (RL), its index in the call (SFT)."""
    if s["sft"]:
        i = sum(len(grp) for grp in s["groups"][:g]) + t
        return rf"(trajectories\[{i}\]|group {i}, trajectory 0)"  # SFT's record errors name each unit a group
    return rf"group {g}, trajectory {t}"


def _insert(s: dict, draw, entry: Any) -> str:
    """Put `entry` into the messages of a trajectory the call reads; returns how the error must name it."""
    g, t = _trainable_place(s, draw)
    entries = list(s["groups"][g][t]["messages_and_choices"])
    k = draw(st.integers(0, len(entries)))
    s["groups"][g][t]["messages_and_choices"] = entries[:k] + [entry] + entries[k:]
    return _where(s, g, t) + rf".*messages_and_choices\[{k}\]"


def _entry(make: Any):
    """A defect that is one bad entry of messages_and_choices (`make(tok)` builds it, or it is given)."""
    return lambda s, draw, tok: _insert(s, draw, make(tok) if callable(make) else make)


def _knobs(**knobs: Any):
    """A defect of the configuration (with something to train, so that a check after tokenizing is reached)."""
    def put(s: dict, draw, tok) -> None:
        _insert(s, draw, _sampled(tok))
        s.update(knobs)
    return put


def _nan_reward(s: dict, draw, tok) -> str:
    g, t = _trainable_place(s, draw)
    s["groups"][g][t]["reward"] = math.nan
    return _where(s, g, t)


def _too_long_for_error_policy(s: dict, draw, tok) -> str:
    s.update(on_too_long="error", max_length=64, row_length=None, max_tokens=None)
    _insert(s, draw, _sampled(tok, "blue " * 80))
    return r"group \d+, trajectory \d+ has \d+ tokens, more than the row length 64"  # the first one too long


def _missing_logprobs_required(s: dict, draw, tok) -> str:
    s.update(require_logprobs=True, allow_missing=False)
    _insert(s, draw, _sampled(tok, logprobs=None))
    return r"group \d+, trajectory \d+: a sampled turn carries no logprobs"  # the first such turn


TOOL_CALL = {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}
DEFECTS: dict[str, tuple[Any, type, str, bool]] = {
    # name: (put it in, error, message, RL only)
    "unknown role": (_entry({"role": "robot", "content": "x"}), TrajectoryError, "role is 'robot'", False),
    "non-string content": (_entry({"role": "user", "content": 3}), TrajectoryError, "has type int", False),
    "user content None": (_entry({"role": "user", "content": None}), TrajectoryError, "content is None", False),
    "no content": (_entry({"role": "user"}), TrajectoryError, "content is None", False),
    "not a message": (_entry("not a message"), TrajectoryError, "has type str", False),
    "tool call arguments not JSON": (
        _entry({"role": "assistant", "content": None,
                "tool_calls": [{**TOOL_CALL, "function": {"name": "add", "arguments": "{bad"}}]}),
        TrajectoryError, "not valid JSON", False),
    "tool call arguments not an object": (
        _entry({"role": "assistant", "content": None,
                "tool_calls": [{**TOOL_CALL, "function": {"name": "add", "arguments": "[1]"}}]}),
        TrajectoryError, "must encode a JSON object", False),
    "logprobs one short": (_entry(lambda tok: _sampled(tok, logprobs=lambda n: _logprobs([-0.5] * (n - 1)))),
                           TrajectoryError, r"sampled token ids but \d+ logprobs", False),
    "nan logprob": (_entry(lambda tok: _sampled(tok, logprobs=lambda n: _logprobs([math.nan] * n))),
                    TrajectoryError, "logprob is nan", False),
    "token ids not a list": (_entry(lambda tok: _sampled(tok, token_ids="not ids")), TrajectoryError,
                             "token_ids must be a non-empty list", False),
    "token id negative": (_entry(lambda tok: _sampled(tok, token_ids=[-2], logprobs=_logprobs([-0.5]))),
                          TrajectoryError, r"token_ids\[0\] is -2", False),
    "token id a float": (_entry(lambda tok: _sampled(tok, token_ids=[1.5], logprobs=_logprobs([-0.5]))),
                         TrajectoryError, r"token_ids\[0\] is 1.5", False),
    "no sampled tokens": (_entry(lambda tok: _sampled(tok, token_ids=[], logprobs=_logprobs([]))),
                          TrajectoryError, "no sampled tokens", False),
    "prompt ids empty": (_entry(lambda tok: _sampled(tok, prompt_token_ids=[])), TrajectoryError,
                         "prompt_token_ids must be a non-empty list", False),
    "prompt id out of vocabulary": (_entry(lambda tok: _sampled(tok, prompt_token_ids=[1, len(tok) + 5])),
                                    TrajectoryError, r"prompt_token_ids\[1\] is \d+, not a token id", False),
    "nan reward": (_nan_reward, TrajectoryError, "reward is nan", False),
    "missing logprobs with require_logprobs": (_missing_logprobs_required, TrajectoryError, "", True),
    "too long with on_too_long='error'": (_too_long_for_error_policy, PackingError, "", False),
    "zero rows per micro-batch": (_knobs(per_device=0), ConfigError, "per_device_train_batch_size", False),
    "row length over the model maximum": (_knobs(row_length=256, max_length=64, max_tokens=None, accumulation=None),
                                          ConfigError,
                                          "row_length=256 exceeds the model's maximum length 64", False),
    "token budget under the row length": (_knobs(row_length=64, max_tokens=16), ConfigError,
                                          "max_tokens_per_microbatch=16 is smaller than row_length=64", False),
    "micro-batch larger than a step": (_knobs(per_device=4, accumulation=2, max_tokens=None, units_per_step=None),
                                       ConfigError, "per_device_train_batch_size=4 is larger than "
                                       "grad_accumulation_sequences=2", True),
    "two ways of cutting steps": (_knobs(accumulation=2, units_per_step=2), ConfigError,
                                  "both define optimizer steps", True),
}


@settings(max_examples=150, suppress_health_check=[HealthCheck.data_too_large])
@given(data=st.data())
def test_random_clean_trajectory_structures_build_with_every_figure_accounted_for(tok, data):
    _run_structure(data.draw(_structure(tok)), tok)


@pytest.mark.parametrize("defect", list(DEFECTS))
@settings(max_examples=8, suppress_health_check=[HealthCheck.data_too_large])
@given(data=st.data())
def test_random_structures_with_one_defect_raise_its_named_error(tok, defect, data):
    put, error, message, rl_only = DEFECTS[defect]
    s = data.draw(_structure(tok))
    if rl_only:
        s["sft"] = False
    where = put(s, data.draw, tok)
    with pytest.raises(error) as info:
        _run_structure(s, tok)
    assert_clear(info, *(f for f in (where, message) if f))


@settings(max_examples=12, suppress_health_check=[HealthCheck.data_too_large])
@given(data=st.data())
def test_random_clean_trajectory_structures_train(live, tok, data):
    """Through the call itself: a clean structure trains (the step advances; nothing is refused); an empty list
    of RL groups trains nothing and advances the step too, as in ART, whose 2048 example passes one when its judge
    drops every group."""
    s = data.draw(_structure(tok, max_length=MAX_LENGTH))
    step = asyncio.run(live.get_step())
    cfg = _config(s)
    if s["sft"]:
        result = asyncio.run(live.train_sft(_trajectories(s), config=cfg))
    else:
        result = asyncio.run(live.train(_groups(s), config=cfg))
    assert result.step == step + 1 and not result.metrics.get("train/skipped_nonfinite_steps")


# --------------------------------------------------------------------------- the docs table


def test_the_docs_table_lists_every_test():
    """docs/reliability.md's bad-input table names exactly this file's bad-input tests."""
    text = DOCS.read_text()
    table = text[text.index("<!-- bad-input-table -->"):text.index("<!-- /bad-input-table -->")]
    documented = set(re.findall(r"`(test_\w+)`", table))
    here = {name for name in globals() if name.startswith("test_") and name != "test_the_docs_table_lists_every_test"}
    assert documented == here, (sorted(here - documented), sorted(documented - here))
