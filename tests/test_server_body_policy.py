"""What each route takes, and how it refuses the rest, through the HTTP path: unknown fields (refused in the route's
own error shape, or served with a bounded warning), fields typed strictly, tool results and tool schemas, each
protocol's terminal events and errors, and clients that leave mid-stream.

A scripted engine on the tiny tokenizer answers (no model): what is under test is the server around it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from artrl.models.tiny import build_tiny_tokenizer
from artrl.serve import ServedModels, ServerHandle, create_app, start_server
from artrl.serve.engines.base import GenerationRequest, GenerationResult
from artrl.serve.engines.scripted import ScriptedEngine
from artrl.serve.errors import EngineClosedError
from artrl.serve.http import body_policy
from artrl.serve.http.protocols import common
from test_server_transport import _response

TOOL = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
BAD_SCHEMA = {"type": "object", "properties": {"city": {"type": "strin"}}}


def body(route: str, **extra: Any) -> dict[str, Any]:
    """A small valid request for `route`, with `extra` fields."""
    if route == "completions":
        return {"model": "m", "prompt": "hi", "max_tokens": 4, **extra}
    if route == "responses":
        return {"model": "m", "input": "hi", "max_output_tokens": 4, **extra}
    return {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}


PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
         "messages": "/v1/messages"}


def refusal(answer: httpx.Response, route: str) -> tuple[str, str | None]:
    """(message, param) of a 400 in the route's own shape (Anthropic's names the field in its message)."""
    assert answer.status_code == 400, answer.text[:300]
    data = answer.json()
    if route == "messages":
        assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error", data
        return data["error"]["message"], None
    assert set(data["error"]) == {"message", "type", "param", "code"}, data
    return data["error"]["message"], data["error"]["param"]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def server(tokenizer: Any) -> Iterator[ServerHandle]:
    engine = ScriptedEngine.from_text(tokenizer, "ok", max_model_len=8192)
    app = create_app(ServedModels("m", engine))
    with start_server(app) as running:
        yield running


def post(server: ServerHandle, route: str, payload: dict[str, Any] | bytes) -> httpx.Response:
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return httpx.post(f"{server.url}{PATHS[route]}", content=content, timeout=60,
                      headers={"content-type": "application/json"})


# --------------------------------------------------------------------------- unknown fields


@pytest.mark.parametrize("route", sorted(PATHS))
def test_an_unknown_field_is_a_400_in_the_routes_shape_naming_it(server: ServerHandle, route: str) -> None:
    assert post(server, route, body(route)).status_code == 200
    message, param = refusal(post(server, route, body(route, frobnicate=1)), route)
    assert "frobnicate" in message, message
    if route == "messages":
        assert message == "frobnicate: Extra inputs are not permitted", message
    else:
        assert param == "frobnicate" and message == "Unrecognized request argument supplied: frobnicate", message


@pytest.mark.parametrize("route", ["responses", "messages"])
@pytest.mark.parametrize("n", [1, 1_000_000])
def test_n_is_refused_where_the_protocol_has_none(server: ServerHandle, route: str, n: int) -> None:
    message, _ = refusal(post(server, route, body(route, n=n)), route)
    assert message.startswith("n:") or message.endswith(": n"), message


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_n_over_the_limit_is_refused_where_the_protocol_has_n(server: ServerHandle, route: str) -> None:
    assert post(server, route, body(route, n=2)).status_code == 200
    _, param = refusal(post(server, route, body(route, n=1_000_000)), route)
    assert param == "n"


def test_a_large_unknown_field_is_refused_before_the_body_is_parsed(
        server: ServerHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 4 MB array under a name no route takes: refused from the scan of the names, never parsed into a request."""
    parsed: list[Any] = []
    parse = common.parse
    monkeypatch.setattr(common, "parse", lambda raw, model: parsed.append(model) or parse(raw, model))
    junk = [{"type": "function", "function": {"name": f"f{i}", "parameters": TOOL}} for i in range(30_000)]
    for route in sorted(PATHS):
        payload = json.dumps(body(route, junk=junk)).encode()
        assert len(payload) > 1_000_000
        message, _ = refusal(post(server, route, payload), route)
        assert "junk" in message
    assert parsed == []
    assert post(server, "completions", body("completions", tools=junk[:3])).status_code == 400  # no tools here


@pytest.fixture()
def lenient(tokenizer: Any) -> Iterator[tuple[ServerHandle, Any]]:
    engine = ScriptedEngine.from_text(tokenizer, "ok", max_model_len=8192)
    app = create_app(ServedModels("m", engine), unknown_fields="warn")
    with start_server(app) as running:
        yield running, app


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture()
def records() -> Iterator[_Records]:
    """Every record of artrl's loggers, at every level."""
    handler = _Records()
    logger = logging.getLogger("artrl")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_set_to_warn_many_unique_unknown_names_are_served_with_bounded_memory_and_lines(
        lenient: tuple[ServerHandle, Any], records: _Records) -> None:
    """Requests of 500 invented names each: served, at most one warning line each (and none once the remembered
    names are full), the remembered set at its bound, every request counted."""
    handle, app = lenient
    requests = 40
    with httpx.Client(timeout=60) as client:
        for r in range(requests):
            extra = {f"u{r}_{k:05d}_{'x' * 100}": 0 for k in range(500)}
            answer = client.post(f"{handle.url}/v1/chat/completions", json=body("chat", **extra))
            assert answer.status_code == 200, answer.text[:300]
        metrics = client.get(f"{handle.url}/metrics").json()
    warnings = [r for r in records.records if "Ignoring unsupported" in r.getMessage()]
    # a line per request until the remembered names are full, none after
    assert len(warnings) == body_policy.REMEMBERED_NAMES // body_policy.NAMES_PER_LINE < requests
    assert all(len(r.getMessage()) < 2_000 for r in warnings), max(len(r.getMessage()) for r in warnings)
    policy = app_policy(app)
    assert policy.remembered == body_policy.REMEMBERED_NAMES
    assert metrics["requests_with_unknown_fields"] == requests and metrics["unknown_fields_refused"] == 0


def app_policy(app: Any) -> body_policy.BodyPolicy:
    """The BodyPolicy the app's routes share."""
    return app.state.body_policy


def test_set_to_warn_a_large_unknown_field_is_served_without_building_it(
        lenient: tuple[ServerHandle, Any]) -> None:
    """The request model skips what it does not take: the parse of a 4 MB unknown array allocates a fraction of
    what building it does (tracemalloc, this process: the server's thread included)."""
    import gc
    import tracemalloc

    handle, _ = lenient
    junk = [{"type": "function", "function": {"name": f"f{i}", "parameters": TOOL}} for i in range(30_000)]
    payload = json.dumps(body("chat", junk=junk)).encode()
    del junk
    gc.collect()
    tracemalloc.start()
    try:
        built = json.loads(payload)
        whole = tracemalloc.get_traced_memory()[0]
        del built
        gc.collect()
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        with httpx.Client(timeout=60) as client:
            answer = client.post(f"{handle.url}/v1/chat/completions", content=payload,
                                 headers={"content-type": "application/json"})
        served = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert answer.status_code == 200, answer.text[:300]
    # the server holds the body's bytes (received, joined) and the small request, never the array's objects
    assert served < whole / 2, (served, whole, len(payload))


# --------------------------------------------------------------------------- typed fields


@pytest.mark.parametrize("options", [{"include_usage": "yes"}, "x", {"include_usage": True, "junk": 1}, [1]])
@pytest.mark.parametrize("route", ["chat", "completions", "responses"])
def test_stream_options_are_strictly_typed(server: ServerHandle, route: str, options: Any) -> None:
    _, param = refusal(post(server, route, body(route, stream=True, stream_options=options)), route)
    assert param is not None and param.startswith("stream_options"), param


def test_well_typed_stream_options_add_the_usage_chunk(server: ServerHandle) -> None:
    answer = post(server, "chat", body("chat", stream=True, stream_options={"include_usage": True}))
    assert answer.status_code == 200
    chunks = [json.loads(line[6:]) for line in answer.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize(("field", "value", "neutral"), [
    ("frequency_penalty", 0.5, 0), ("presence_penalty", -1, 0.0), ("logit_bias", {"5": 100}, {}),
    ("ignore_eos", True, False), ("skip_special_tokens", False, True)])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_fields_taken_at_their_neutral_value_only(server: ServerHandle, route: str, field: str, value: Any,
                                                  neutral: Any) -> None:
    assert post(server, route, body(route, **{field: neutral})).status_code == 200
    _, param = refusal(post(server, route, body(route, **{field: value})), route)
    assert param == field


@pytest.mark.parametrize("route", sorted(PATHS))
def test_fields_that_ask_nothing_of_sampling_are_taken(server: ServerHandle, route: str) -> None:
    extra = {"metadata": {"run": "a"}, "service_tier": "auto"}
    if route != "messages":
        extra.update(user="u1", prompt_cache_key="k", safety_identifier="s")
    assert post(server, route, body(route, **extra)).status_code == 200


# --------------------------------------------------------------------------- tools


def test_a_tool_result_with_no_matching_call_is_refused(server: ServerHandle) -> None:
    call = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get", "input": {}}]}
    answered = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "9"}]}
    stray = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "9"}]}
    ask = {"role": "user", "content": "hi"}
    assert post(server, "messages", body("messages", messages=[ask, call, answered])).status_code == 200
    message, _ = refusal(post(server, "messages", body("messages", messages=[ask, call, stray])), "messages")
    assert "toolu_2" in message and "messages[2].content[0]" in message, message
    message, _ = refusal(post(server, "messages", body("messages", messages=[stray])), "messages")
    assert "toolu_2" in message

    function_call = {"type": "function_call", "call_id": "call_1", "name": "get", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "call_1", "output": "9"}
    stray_output = {"type": "function_call_output", "call_id": "call_2", "output": "9"}
    assert post(server, "responses", body("responses", input=[function_call, output])).status_code == 200
    message, param = refusal(post(server, "responses", body("responses", input=[function_call, stray_output])),
                             "responses")
    assert param == "input[1].call_id" and "call_2" in message, message

    chat_call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": "{}"}}]}
    chat_answer = {"role": "tool", "tool_call_id": "call_1", "content": "9"}
    chat_stray = {"role": "tool", "tool_call_id": "call_2", "content": "9"}
    assert post(server, "chat", body("chat", messages=[ask, chat_call, chat_answer])).status_code == 200
    for messages, at in (([ask, chat_call, chat_answer, chat_stray], 3), ([ask, chat_stray], 1),
                         ([ask, chat_stray, chat_call], 1)):  # a call after its answer answers nothing
        message, param = refusal(post(server, "chat", body("chat", messages=messages)), "chat")
        assert param == f"messages[{at}].tool_call_id" and "call_2" in message, message


def test_a_function_call_output_may_answer_the_call_of_a_previous_response(tokenizer: Any) -> None:
    engine = ScriptedEngine.from_text(
        tokenizer, '<tool_call>\n{"name": "get", "arguments": {"city": "Paris"}}\n</tool_call>', max_model_len=8192)
    with start_server(create_app(ServedModels("m", engine))) as handle:
        first = post(handle, "responses", body("responses", max_output_tokens=64,
                                               tools=[{"type": "function", "name": "get", "parameters": TOOL}]))
        assert first.status_code == 200, first.text[:300]
        call = next(item for item in first.json()["output"] if item["type"] == "function_call")
        follow = body("responses", previous_response_id=first.json()["id"],
                      input=[{"type": "function_call_output", "call_id": call["call_id"], "output": "9"}])
        assert post(handle, "responses", follow).status_code == 200
        follow["input"][0]["call_id"] = "call_other"
        _, param = refusal(post(handle, "responses", follow), "responses")
        assert param == "input[0].call_id"


@pytest.mark.parametrize("choice", [None, "auto", "none", "required"])
def test_an_invalid_tool_schema_is_refused_under_any_tool_choice_in_the_protocols_words(
        server: ServerHandle, choice: str | None) -> None:
    chat_tool = {"type": "function", "function": {"name": "get", "parameters": BAD_SCHEMA}}
    chat = body("chat", tools=[chat_tool], **({"tool_choice": choice} if choice else {}))
    message, param = refusal(post(server, "chat", chat), "chat")
    assert param == "tools[0].function.parameters" and "strin" in message, (param, message)

    responses_tool = {"type": "function", "name": "get", "parameters": BAD_SCHEMA}
    responses = body("responses", tools=[responses_tool], **({"tool_choice": choice} if choice else {}))
    _, param = refusal(post(server, "responses", responses), "responses")
    assert param == "tools[0].parameters", param

    messages_tool = {"name": "get", "input_schema": BAD_SCHEMA}
    anthropic_choice = {None: None, "auto": {"type": "auto"}, "none": {"type": "none"}, "required": {"type": "any"}}
    messages = body("messages", tools=[messages_tool],
                    **({"tool_choice": anthropic_choice[choice]} if choice else {}))
    message, _ = refusal(post(server, "messages", messages), "messages")
    assert message.startswith("tools[0].input_schema") and "function" not in message.split(":")[0], message


def test_a_tool_without_a_name_is_named_in_the_protocols_words(server: ServerHandle) -> None:
    _, param = refusal(post(server, "responses", body("responses", tools=[{"type": "function", "parameters": TOOL}])),
                       "responses")
    assert param == "tools[0].name", param
    message, _ = refusal(post(server, "messages", body("messages", tools=[{"input_schema": TOOL}])), "messages")
    assert message.startswith("tools[0].name"), message


# --------------------------------------------------------------------------- each protocol's events and errors


def sse_events(text: str) -> list[tuple[str | None, Any]]:
    out = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        name = next((line[7:] for line in block.splitlines() if line.startswith("event: ")), None)
        data = next(line[6:] for line in block.splitlines() if line.startswith("data: "))
        out.append((name, data if data == "[DONE]" else json.loads(data)))
    return out


def test_an_incomplete_responses_stream_ends_with_response_incomplete(tokenizer: Any) -> None:
    engine = ScriptedEngine.from_text(tokenizer, "one two three four five six seven", max_model_len=8192)
    with start_server(create_app(ServedModels("m", engine))) as handle:
        whole = post(handle, "responses", body("responses", max_output_tokens=64)).json()
        assert whole["status"] == "completed"
        engine.next = (engine.next[0][:-1], engine.next[1][:-1])  # no end of turn: cut by the budget
        answer = post(handle, "responses", body("responses", stream=True))
        names = [name for name, _ in sse_events(answer.text)]
        assert names[-1] == "response.incomplete" and "response.completed" not in names, names
        final = sse_events(answer.text)[-1][1]["response"]
        assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.fixture(scope="module")
def strict(tokenizer: Any) -> Iterator[ServerHandle]:
    """Short deadlines: 0.5 s for a request head, 0.5 s between two parts of a body."""
    engine = ScriptedEngine.from_text(tokenizer, "ok", max_model_len=8192)
    with start_server(create_app(ServedModels("m", engine), body_timeout=0.5), head_timeout=0.5) as running:
        yield running


@pytest.mark.parametrize("route", ["messages", "chat"])
@pytest.mark.parametrize("where", ["head", "body"])
def test_a_408_is_in_the_routes_shape(strict: ServerHandle, route: str, where: str) -> None:
    sock = socket.create_connection((strict.host, strict.port), timeout=20)
    head = f"POST {PATHS[route]} HTTP/1.1\r\nhost: x\r\n".encode()
    if where == "head":
        sock.sendall(head)  # and never the rest of the head
    else:
        sock.sendall(head + b"content-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\"")
    status, _, answer = _response(sock)
    sock.close()
    data = json.loads(answer)
    assert status == 408
    if route == "messages":
        assert data["type"] == "error" and data["error"]["type"] == "timeout_error", data
    else:
        assert data["error"]["code"] == "request_timeout", data


class ClosedEngine(ScriptedEngine):
    """An engine whose program is exiting: every request fails as a closed engine's do."""

    async def generate(self, request: GenerationRequest) -> list[GenerationResult]:
        raise EngineClosedError("the engine was closed")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", sorted(PATHS))
def test_a_503_is_in_the_routes_shape(tokenizer: Any, route: str, stream: bool) -> None:
    """The one status the server answers when it cannot serve (it has no request limit of its own, so no 429): a
    closed engine is a 503 in the route's error shape, plain or streamed (nothing was sent yet)."""
    with start_server(create_app(ServedModels("m", ClosedEngine(tokenizer, max_model_len=8192)))) as handle:
        answer = post(handle, route, body(route, stream=stream))
    assert answer.status_code == 503 and answer.headers["content-type"] == "application/json", answer.text[:300]
    data = answer.json()
    if route == "messages":
        assert data == {"type": "error", "error": {"type": "overloaded_error", "message": "the engine was closed"}}
    else:
        assert data == {"error": {"message": "the engine was closed", "type": "server_error", "param": None,
                                  "code": "engine_closed"}}


# --------------------------------------------------------------------------- clients that leave mid-stream


class HeldStream(ScriptedEngine):
    """Hands over one token per row, then holds its generation until it is cancelled (`cancelled` is set then)."""

    streams_tokens = True

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer, max_model_len=8192)
        ids = tokenizer("hello there", add_special_tokens=False).input_ids
        self.next = (ids, [-1.0] * len(ids))
        self.cancelled = threading.Event()

    async def generate(self, request: GenerationRequest, on_token: Any = None) -> list[GenerationResult]:
        self.check(request)
        ids, lps = self.next
        for sample in range(request.n):
            on_token(sample, ids[0], lps[0], None)
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return []


@pytest.mark.parametrize("route", sorted(PATHS))
def test_a_client_that_leaves_mid_stream_is_counted_and_logged_at_debug(
        tokenizer: Any, route: str, records: _Records) -> None:
    engine = HeldStream(tokenizer)
    with start_server(create_app(ServedModels("m", engine))) as handle:
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{handle.url}{PATHS[route]}", json=body(route, stream=True)) as answer:
                assert answer.status_code == 200
                next(answer.iter_lines())  # the stream began; then the client leaves
        assert engine.cancelled.wait(30), "the generation was not dropped"
        metrics = httpx.get(f"{handle.url}/metrics", timeout=20).json()
    assert metrics["disconnects_while_generating"] == 1, metrics
    ours = [r for r in records.records if "disconnected" in r.getMessage()]
    assert len(ours) == 1 and ours[0].levelno == logging.DEBUG, [(r.levelname, r.getMessage()) for r in ours]


# --------------------------------------------------------------------------- the Responses store


def test_the_responses_store_holds_no_more_memory_than_its_bound() -> None:
    """Conversations of 200 empty messages (their JSON about a sixth of their objects): what the store holds,
    measured by tracemalloc, stays within 10% of its bound once it is full, and the oldest are out."""
    import gc
    import tracemalloc

    from artrl.serve.http.protocols.responses import ResponseStore

    bound = 512 * 1024
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        store = ResponseStore(bound)
        held = []
        for k in range(600):
            store.put(f"resp_{k:032x}", [{"role": "user", "content": ""} for _ in range(200)])
            if k % 100 == 99:
                gc.collect()
                held.append(tracemalloc.get_traced_memory()[0] - base)
    finally:
        tracemalloc.stop()
    assert store.get("resp_" + "0" * 32) is None and store.get(f"resp_{599:032x}") is not None
    assert store.held <= bound
    assert max(held) <= 1.1 * bound, (held, bound)
    assert held[-1] >= 0.8 * bound, (held, bound)  # the bound is used, not undercounted the other way


# --------------------------------------------------------------------------- vLLM's extras


THINKING = "{%- if enable_thinking is defined and not enable_thinking %}NO THINKING {% endif %}"


@pytest.fixture(scope="module")
def thinking(tokenizer: Any) -> Iterator[ServerHandle]:
    """A server whose tokenizer's chat template reads `enable_thinking` (as Qwen3's does)."""
    template_tokenizer = build_tiny_tokenizer()
    template_tokenizer.chat_template = THINKING + tokenizer.chat_template
    with start_server(create_app(ServedModels("m", ScriptedEngine.from_text(template_tokenizer, "ok",
                                                                           max_model_len=8192)))) as handle:
        yield handle


def test_chat_template_kwargs_reach_the_chat_template(thinking: ServerHandle, tokenizer: Any) -> None:
    def prompt(**extra: Any) -> str:
        answer = post(thinking, "chat", body("chat", **extra))
        assert answer.status_code == 200, answer.text[:300]
        return tokenizer.decode(answer.json()["choices"][0]["prompt_token_ids"])

    assert "NO THINKING" not in prompt() and "NO THINKING" not in prompt(chat_template_kwargs={})
    assert prompt(chat_template_kwargs={"enable_thinking": False}).startswith("NO THINKING")
    assert "NO THINKING" not in prompt(chat_template_kwargs={"enable_thinking": True})
    # a variable the template does not read would change nothing; one the server sets is not the client's
    for kwargs, key in (({"preserve_thinking": True}, "preserve_thinking"), ({"tokenize": True}, "tokenize"),
                        ({"add_generation_prompt": False}, "add_generation_prompt")):
        message, param = refusal(post(thinking, "chat", body("chat", chat_template_kwargs=kwargs)), "chat")
        assert param == f"chat_template_kwargs.{key}", (param, message)
    for value in ("enable_thinking", ["enable_thinking"], 1):
        _, param = refusal(post(thinking, "chat", body("chat", chat_template_kwargs=value)), "chat")
        assert param.startswith("chat_template_kwargs"), param
    _, param = refusal(post(thinking, "completions", body("completions", chat_template_kwargs={})), "completions")
    assert param == "chat_template_kwargs"  # no chat template there: not a field the route takes


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_vllm_sampling_extras_are_taken_at_their_neutral_values_only(server: ServerHandle, route: str) -> None:
    for neutral in ({"top_k": -1}, {"top_k": 0}, {"min_p": 0}, {"min_p": 0.0}, {"repetition_penalty": 1},
                    {"repetition_penalty": 1.0}):
        assert post(server, route, body(route, **neutral)).status_code == 200, neutral
    for name, value in (("top_k", 20), ("min_p", 0.05), ("repetition_penalty", 1.1), ("top_k", "20")):
        message, param = refusal(post(server, route, body(route, **{name: value})), route)
        assert param == name, (param, message)
