"""The OpenAI-compatible server, end to end through the real `openai` client.

A server on 127.0.0.1 serves the tiny model (wrapped in a peft LoRA, as the
trainer serves it) as "m", its checkpoint adapter as "m@1", and a scripted engine
as "scripted" (the untrained tiny model never emits a tool call by itself). The
central property: every logprob the server returns equals an unbatched forward of
prompt_token_ids + token_ids through the same weights, whatever else shared the
batch.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from peft import LoraConfig, PeftModel, get_peft_model

from artrl.serve import (
    GenerationRequest,
    InvalidRequestError,
    ServedModels,
    ServerHandle,
    TransformersEngine,
    create_app,
    parse_tool_calls,
    start_server,
)
from artrl.serve.engines.scripted import ScriptedEngine
from artrl.models.tiny import load_tiny
from engine_helpers import recompute

TOLERANCE = 1e-4
LORA = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


# ---- fixtures ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("tiny-cache")


@pytest.fixture(scope="module")
def live(cache_dir: pathlib.Path) -> tuple[PeftModel, Any]:
    """The served model: the tiny model with a fresh LoRA adapter ("default"), as a trainer holds it."""
    base, tokenizer = load_tiny(cache_dir)
    return get_peft_model(base, LORA), tokenizer


@pytest.fixture(scope="module")
def checkpoint(cache_dir: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, PeftModel]:
    """A saved LoRA adapter with non-zero weights, and a reference model with it active."""
    base, _ = load_tiny(cache_dir)
    torch.manual_seed(1)
    trained = get_peft_model(base, LoraConfig(**{**LORA.to_dict(), "init_lora_weights": False}))
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_" in name:
                p.mul_(8.0)  # make the adapter change the logits clearly
    path = tmp_path_factory.mktemp("ckpt") / "step-1"
    trained.save_pretrained(path)
    reference_base, _ = load_tiny(cache_dir)
    return path, PeftModel.from_pretrained(reference_base, path).eval()


SCRIPTED_TEXT = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def engine(live: tuple[PeftModel, Any]) -> Iterator[TransformersEngine]:
    model, tokenizer = live
    engine = TransformersEngine(model, tokenizer, max_batch_size=16, shares_trainer_weights=True)  # as a trainer would
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def server(
    engine: TransformersEngine, live: tuple[PeftModel, Any], checkpoint: tuple[pathlib.Path, PeftModel]
) -> Iterator[ServerHandle]:
    path, _ = checkpoint
    corrupt = path.parent / "step-3-corrupt"  # a checkpoint whose weights file was cut short
    corrupt.mkdir(exist_ok=True)
    (corrupt / "adapter_config.json").write_bytes((path / "adapter_config.json").read_bytes())
    (corrupt / "adapter_model.safetensors").write_bytes((path / "adapter_model.safetensors").read_bytes()[:100])
    paths = {1: str(path), 3: str(corrupt)}
    models = ServedModels("m", engine, checkpoint_path=lambda name, step: paths.get(step))
    models.add("scripted", ScriptedEngine.from_text(live[1], SCRIPTED_TEXT, max_model_len=8192))
    handle = start_server(create_app(models))
    yield handle
    handle.stop()


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=60)


# ---- helpers -------------------------------------------------------------------------


def token_ids(choice: Any) -> list[int]:
    return choice.model_extra["token_ids"]


def assert_logprobs_match(completion: Any, model: Any) -> None:
    prompt_ids = completion.model_extra["prompt_token_ids"]
    for choice in completion.choices:
        ids = token_ids(choice)
        served = [entry.logprob for entry in choice.logprobs.content]
        assert len(served) == len(ids) > 0
        expected = recompute(model, prompt_ids, ids)
        assert max(abs(a - b) for a, b in zip(served, expected)) < TOLERANCE, (served, expected)


# ---- the server, through the openai client --------------------------------------------


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    ids = [model.id for model in client.models.list()]
    assert "m" in ids and "scripted" in ids


def test_completion_returns_text_token_ids_and_exact_logprobs(
    client: openai.OpenAI, live: tuple[PeftModel, Any]
) -> None:
    model, tokenizer = live
    messages = [{"role": "system", "content": "Be brief."}, *user("What is the weather like in Paris?")]
    completion = client.chat.completions.create(
        model="m", messages=messages, max_tokens=12, logprobs=True, top_logprobs=3, seed=7
    )
    choice = completion.choices[0]
    ids = token_ids(choice)
    expected_prompt = tokenizer(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    ).input_ids
    assert completion.model_extra["prompt_token_ids"] == expected_prompt
    assert isinstance(choice.message.content, str)
    text_ids = ids[:-1] if ids[-1] == tokenizer.eos_token_id else ids
    assert choice.message.content == tokenizer.decode(text_ids)
    assert len(choice.logprobs.content) == len(ids)
    assert all(len(entry.top_logprobs) == 3 for entry in choice.logprobs.content)
    assert all(entry.logprob <= entry.top_logprobs[0].logprob + TOLERANCE for entry in choice.logprobs.content)
    assert completion.usage.prompt_tokens == len(expected_prompt)
    assert completion.usage.completion_tokens == len(ids)
    assert_logprobs_match(completion, model)


def test_concurrent_requests_are_batched_and_left_padding_changes_nothing(
    server: ServerHandle, engine: TransformersEngine, live: tuple[PeftModel, Any]
) -> None:
    model, _ = live
    prompts = [user("tell me about the weather " * (1 + 3 * i)) for i in range(8)]
    temperatures = [0.0, 0.3, 0.7, 1.0, 1.3, 2.0, 0.5, 1.0]
    batches_before = engine.batches_served

    async def run_all() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=600) as aclient:
            tasks = [
                asyncio.ensure_future(
                    aclient.chat.completions.create(
                        model="m", messages=p, max_tokens=6 + i, temperature=t, top_p=0.95 if i % 2 else 1.0,
                        logprobs=True, seed=i,
                    )
                )
                for i, (p, t) in enumerate(zip(prompts, temperatures))
            ]
            # Hold the device (as a trainer would) until all 8 are queued, so they run as one batch: however
            # long that takes (the deadline only bounds a hung test, and fails it)
            deadline = time.monotonic() + 300
            while engine.pending_requests < len(tasks) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            queued = engine.pending_requests
            engine.model_lock.release()
            assert queued == len(tasks), f"only {queued} of {len(tasks)} requests reached the engine"
            return await asyncio.gather(*tasks)

    engine.model_lock.acquire()
    completions = asyncio.run(run_all())
    assert engine.batches_served == batches_before + 1
    lengths = {len(c.model_extra["prompt_token_ids"]) for c in completions}
    assert len(lengths) == 8
    for completion in completions:
        assert_logprobs_match(completion, model)


def test_n_gives_n_choices(client: openai.OpenAI, live: tuple[PeftModel, Any]) -> None:
    completion = client.chat.completions.create(
        model="m", messages=user("hi"), n=3, max_tokens=8, logprobs=True,
        extra_body={"return_tokens_as_token_ids": True},  # vLLM's extension, which ART reads
    )
    assert [c.index for c in completion.choices] == [0, 1, 2]
    for choice in completion.choices:
        assert [entry.token for entry in choice.logprobs.content] == [f"token_id:{t}" for t in token_ids(choice)]
    assert len({tuple(token_ids(c)) for c in completion.choices}) > 1
    assert completion.usage.completion_tokens == sum(len(token_ids(c)) for c in completion.choices)
    assert_logprobs_match(completion, live[0])


def test_max_tokens_ends_with_length(client: openai.OpenAI) -> None:
    for limit in ({"max_tokens": 5}, {"max_completion_tokens": 5}):
        completion = client.chat.completions.create(model="m", messages=user("count"), temperature=0, **limit)
        assert completion.choices[0].finish_reason == "length"
        assert len(token_ids(completion.choices[0])) == 5


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> list[list[int]]:
        completion = client.chat.completions.create(model="m", messages=user("go"), n=2, max_tokens=8, seed=seed)
        return [token_ids(c) for c in completion.choices]

    first = sample(123)
    assert sample(123) == first
    assert first[0] != first[1]
    assert sample(124) != first


def test_stop_string_cuts_text_after_the_completing_token(
    client: openai.OpenAI, live: tuple[PeftModel, Any]
) -> None:
    _, tokenizer = live
    free = client.chat.completions.create(model="m", messages=user("say something"), temperature=0, max_tokens=24)
    text, ids = free.choices[0].message.content, token_ids(free.choices[0])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    cut = client.chat.completions.create(
        model="m", messages=user("say something"), temperature=0, max_tokens=24, stop=[stop]
    )
    choice = cut.choices[0]
    cut_ids = token_ids(choice)
    assert choice.finish_reason == "stop"
    assert choice.message.content == text[: text.find(stop)]
    assert cut_ids == ids[: len(cut_ids)]
    assert stop in tokenizer.decode(cut_ids) and stop not in tokenizer.decode(cut_ids[:-1])


def test_tool_round_trip_prompt_renders_tools_and_history(
    client: openai.OpenAI, live: tuple[PeftModel, Any]
) -> None:
    _, tokenizer = live
    messages = [
        *user("What is the weather in Paris?"),
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    completion = client.chat.completions.create(
        model="m", messages=messages, tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=6
    )
    rendered = tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False)
    assert completion.model_extra["prompt_token_ids"] == tokenizer(rendered, add_special_tokens=False).input_ids
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in rendered
    no_tools = client.chat.completions.create(
        model="m", messages=messages, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=2
    )
    # "none": the tools stay in the prompt (OpenAI's meaning, vLLM's default), so the prompt is the same as with
    # "auto"; the reply is text
    assert "# Tools" in rendered
    assert no_tools.model_extra["prompt_token_ids"] == completion.model_extra["prompt_token_ids"]
    assert not no_tools.choices[0].message.tool_calls


def test_generated_tool_call_is_returned_as_tool_calls(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model="scripted", messages=user("weather in Paris?"), tools=[WEATHER_TOOL], logprobs=True
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert len(choice.logprobs.content) == len(token_ids(choice))
    without_tools = client.chat.completions.create(model="scripted", messages=user("weather in Paris?"))
    assert without_tools.choices[0].finish_reason == "stop"
    assert without_tools.choices[0].message.tool_calls is None
    assert "<tool_call>" in without_tools.choices[0].message.content
    # tool_choice "none": the tools are offered (in the prompt) but the reply is text, nothing parsed
    refused = client.chat.completions.create(model="scripted", messages=user("weather in Paris?"),
                                             tools=[WEATHER_TOOL], tool_choice="none")
    assert refused.choices[0].finish_reason == "stop" and refused.choices[0].message.tool_calls is None
    assert "<tool_call>" in refused.choices[0].message.content


def test_server_cuts_at_stop_strings_an_engine_ignored(client: openai.OpenAI, live: tuple[PeftModel, Any]) -> None:
    _, tokenizer = live
    completion = client.chat.completions.create(
        model="scripted", messages=user("hi"), stop=["check", "never"], logprobs=True
    )
    choice = completion.choices[0]
    ids = token_ids(choice)
    assert choice.message.content == "Let me "
    assert choice.finish_reason == "stop"
    assert "check" in tokenizer.decode(ids) and "check" not in tokenizer.decode(ids[:-1])
    assert len(choice.logprobs.content) == len(ids) == completion.usage.completion_tokens


def test_checkpoint_adapter_is_served_as_name_at_step(
    client: openai.OpenAI, live: tuple[PeftModel, Any], checkpoint: tuple[pathlib.Path, PeftModel],
    engine: TransformersEngine,
) -> None:
    model, _ = live
    _, reference = checkpoint
    grads_before = {name: p.requires_grad for name, p in model.named_parameters()}
    model.train()  # a trainer may leave the model in train mode; serving must not change that
    completion = client.chat.completions.create(
        model="m@1", messages=user("hello there"), max_tokens=10, logprobs=True, seed=3
    )
    assert completion.model == "m@1"
    with engine.model_lock:  # as a trainer does: the batch restores the modes before it lets the lock go, which
        assert model.training  # may be after its request was answered
    assert_logprobs_match(completion, reference)  # the adapter's weights were used ...
    prompt_ids, ids = completion.model_extra["prompt_token_ids"], token_ids(completion.choices[0])
    served = [entry.logprob for entry in completion.choices[0].logprobs.content]
    live_logprobs = recompute(model.eval(), prompt_ids, ids)
    assert max(abs(a - b) for a, b in zip(served, live_logprobs)) > 1e-2  # ... not the live ones
    # The live adapter is active again, with the trainer's requires_grad flags.
    assert model.active_adapter == "default"
    grads_after = {name: p.requires_grad for name, p in model.named_parameters()}
    assert {name: grads_after[name] for name in grads_before} == grads_before
    assert any(grads_before.values())
    assert not any(grads_after[name] for name in set(grads_after) - set(grads_before))  # the checkpoint is frozen
    assert "m@1" in [m.id for m in client.models.list()]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="m@2", messages=user("hi"), max_tokens=2)


def test_model_lock_holds_inference_back(client: openai.OpenAI, engine: TransformersEngine) -> None:
    done = threading.Event()

    def request() -> None:
        client.chat.completions.create(model="m", messages=user("wait"), max_tokens=2)
        done.set()

    served = engine.batches_served
    with engine.model_lock:
        thread = threading.Thread(target=request)
        thread.start()
        # the request must really be waiting in the engine (not merely slow to arrive) while the lock is held
        deadline = time.monotonic() + 300  # bounds a hung test only
        while engine.pending_requests < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.pending_requests >= 1, "the request never reached the engine"
        assert not done.wait(0.2)
        assert engine.batches_served == served and engine.pending_requests >= 1
    thread.join(30)
    assert done.is_set() and engine.batches_served == served + 1


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"n": 0}, "n"),
        ({"n": 1000}, "n"),
        ({"top_p": 0.0}, "top_p"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"messages": [{"role": "robot", "content": "beep"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ],
)
def test_invalid_parameters_are_400(client: openai.OpenAI, kwargs: dict[str, Any], param: str) -> None:
    kwargs = {"model": "m", "messages": user("hi"), "max_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**kwargs)
    assert info.value.param == param


def test_unreadable_checkpoint_is_a_clear_error_and_serving_goes_on(
    client: openai.OpenAI, live: tuple[PeftModel, Any]
) -> None:
    for _ in range(2):  # a retry gets the same answer (no half-loaded adapter left behind)
        with pytest.raises(openai.InternalServerError) as info:
            client.chat.completions.create(model="m@3", messages=user("hi"), max_tokens=2)
        assert info.value.code == "checkpoint_unreadable"
        assert "m@3" in info.value.message and "step-3-corrupt" in info.value.message
    assert not any("_3_" in name for name in live[0].peft_config)
    for model in ("m", "m@1"):
        assert client.chat.completions.create(model=model, messages=user("hi"), max_tokens=2).choices


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=user("hi"), max_tokens=2)
    assert info.value.code == "model_not_found"


def test_malformed_bodies_get_openai_errors_not_500(server: ServerHandle) -> None:
    url = f"{server.base_url}/chat/completions"
    for body in ({"model": "m"}, {"model": "m", "messages": "hi"}, {"model": "m", "messages": [], "n": "three"}):
        response = httpx.post(url, json=body, timeout=30)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
    response = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400 and "error" in response.json()


def test_body_size_limit(engine: TransformersEngine) -> None:
    with start_server(create_app(ServedModels("m", engine), max_body_bytes=1000)) as handle:
        body = {"model": "m", "messages": user("x" * 2000), "max_tokens": 1}
        response = httpx.post(f"{handle.base_url}/chat/completions", json=body, timeout=30)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


# ---- engine and parser units ------------------------------------------------------------


def test_engine_splits_large_n_and_reports_top_logprobs(live: tuple[PeftModel, Any]) -> None:
    model, tokenizer = live
    engine = TransformersEngine(model, tokenizer, max_batch_size=2)
    try:
        prompt = tokenizer("hello", add_special_tokens=False).input_ids
        request = GenerationRequest(prompt_ids=prompt, n=5, max_tokens=4, top_p=0.5, top_logprobs=2, seed=0)
        results = asyncio.run(engine.generate(request))
    finally:
        engine.close()
    assert len(results) == 5
    for result in results:
        assert len(result.token_ids) == len(result.logprobs) == len(result.top_logprobs)
        assert all(len(top) == 2 for top in result.top_logprobs)
        expected = recompute(model, prompt, result.token_ids)
        assert max(abs(a - b) for a, b in zip(result.logprobs, expected)) < TOLERANCE


def test_plain_model_refuses_adapters(cache_dir: pathlib.Path, checkpoint: tuple[pathlib.Path, PeftModel]) -> None:
    model, tokenizer = load_tiny(cache_dir)
    engine = TransformersEngine(model, tokenizer)
    with pytest.raises(InvalidRequestError, match="not a peft PeftModel"):
        engine.load_adapter("a", str(checkpoint[0]))
    with pytest.raises(InvalidRequestError, match="adapter 'a' is not loaded"):
        asyncio.run(engine.generate(GenerationRequest(prompt_ids=[5, 6], adapter="a")))
    engine.close()


def test_parse_tool_calls_crafted_text() -> None:
    text = (
        "Checking both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
        "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>\n"
        "<tool_call>\n{not json}\n</tool_call>"
    )
    content, calls = parse_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[1]["function"]["arguments"] == "{}"
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert calls[0]["id"] != calls[1]["id"]
    assert content == "Checking both.\n\n\n<tool_call>\n{not json}\n</tool_call>"
    assert parse_tool_calls("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>")[0] is None
    assert parse_tool_calls("") == (None, [])
    assert parse_tool_calls("<tool_call>\n{\"name\": \"f\"") == ("<tool_call>\n{\"name\": \"f\"", [])


@settings(max_examples=60)
@example(before="", name="</tool_call>", arguments={"x": "<tool_call>"})  # the tags inside strings
@given(
    before=st.text().filter(lambda s: "<tool_call>" not in s),
    name=st.text(min_size=1),
    arguments=st.dictionaries(st.text(), st.one_of(st.integers(), st.text(), st.booleans())),
)
def test_parse_tool_calls_round_trips(before: str, name: str, arguments: dict[str, Any]) -> None:
    block = "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"
    content, calls = parse_tool_calls(before + block)
    assert content == (before.strip() or None)
    assert len(calls) == 1
    assert calls[0]["function"]["name"] == name
    assert json.loads(calls[0]["function"]["arguments"]) == arguments


# ---- security defaults ------------------------------------------------------------------


def test_api_key_is_checked_on_every_route(engine: TransformersEngine) -> None:
    app = create_app(ServedModels("keyed", engine), api_key="s3cret")
    with start_server(app) as handle:
        anonymous = openai.OpenAI(base_url=handle.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            anonymous.models.list()
        with pytest.raises(openai.AuthenticationError):
            anonymous.chat.completions.create(model="keyed", messages=user("hi"), max_tokens=2)
        assert httpx.get(handle.url + "/health").status_code == 401
        keyed = openai.OpenAI(base_url=handle.base_url, api_key="s3cret", max_retries=0)
        assert [m.id for m in keyed.models.list()] == ["keyed"]
        assert keyed.chat.completions.create(model="keyed", messages=user("hi"), max_tokens=2).choices


def test_binding_off_loopback_needs_an_api_key(engine: TransformersEngine) -> None:
    from artrl.errors import ConfigError

    with pytest.raises(ConfigError, match="without an API key"):
        start_server(create_app(ServedModels("open", engine)), host="0.0.0.0")
