"""Tests of the offline tiny model: deterministic build, tokenizer, chat template, cache."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import threading
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen3ForCausalLM

from artrl.models import tiny
from artrl.errors import CheckpointError

# ---- fixtures ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tiny.tiny_model_path(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: pathlib.Path) -> PreTrainedTokenizerFast:
    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def model(tiny_dir: pathlib.Path) -> Qwen3ForCausalLM:
    return AutoModelForCausalLM.from_pretrained(tiny_dir)


def render(tok: PreTrainedTokenizerFast, messages: list[dict[str, Any]], tools: Any = None, agp: bool = False) -> str:
    out = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=agp)
    assert isinstance(out, str)
    return out


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

# ---- build and cache -------------------------------------------------------------------


def test_build_twice_is_bit_identical(tiny_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    other = tiny.tiny_model_path(tmp_path)
    assert other != tiny_dir and other.name == tiny_dir.name
    files = sorted(p.name for p in tiny_dir.iterdir())
    assert files == sorted(p.name for p in other.iterdir())
    for name in files:  # weights, config, tokenizer, template: byte for byte
        assert (tiny_dir / name).read_bytes() == (other / name).read_bytes(), name
    a = AutoModelForCausalLM.from_pretrained(tiny_dir).state_dict()
    b = AutoModelForCausalLM.from_pretrained(other).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_in_memory_build_matches_cache_and_keeps_global_rng(tiny_dir: pathlib.Path) -> None:
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    tok = tiny.build_tiny_tokenizer()
    fresh = tiny.build_tiny_model(tok)
    assert torch.equal(torch.random.get_rng_state(), before)
    cached = AutoModelForCausalLM.from_pretrained(tiny_dir).state_dict()
    assert all(torch.equal(v, cached[k]) for k, v in fresh.state_dict().items())
    saved = json.loads((tiny_dir / "tokenizer.json").read_text(encoding="utf-8"))
    built = json.loads(tok.backend_tokenizer.to_str())
    assert built["model"] == saved["model"] and built["added_tokens"] == saved["added_tokens"]


def test_cached_build_is_reused(tiny_dir: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    marker = tiny_dir / tiny.BUILD_MARKER_FILE
    mtime = marker.stat().st_mtime_ns
    with caplog.at_level(logging.INFO, logger="artrl.models.tiny"):
        assert tiny.tiny_model_path(tiny_dir.parent) == tiny_dir
    assert marker.stat().st_mtime_ns == mtime
    assert not any("Building" in r.message for r in caplog.records)


def test_default_cache_dir_and_resolve(tiny_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tiny.CACHE_DIR_ENV, str(tiny_dir.parent))
    assert tiny.tiny_model_path() == tiny_dir
    assert tiny.resolve_model_path(tiny.TINY_MODEL_NAME) == str(tiny_dir)
    assert tiny.resolve_model_path("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"
    assert tiny.resolve_model_path("/some/local/dir") == "/some/local/dir"


def test_build_logs(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="artrl.models.tiny"):
        tiny.tiny_model_path(tmp_path)
    assert any("Building artrl/tiny" in r.message for r in caplog.records)


def test_losing_the_race_discards_own_build(
    tiny_dir: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = tmp_path / tiny_dir.name
    real_build = tiny._build_into

    def build_then_lose(directory: pathlib.Path, *args: Any) -> None:
        real_build(directory)
        shutil.copytree(tiny_dir, final)  # another process publishes first

    monkeypatch.setattr(tiny, "_build_into", build_then_lose)
    assert tiny.tiny_model_path(tmp_path) == final
    assert sorted(p.name for p in tmp_path.iterdir()) == [final.name]  # our temporary dir is gone


def test_concurrent_builders_agree(tmp_path: pathlib.Path) -> None:
    results: list[pathlib.Path] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            results.append(tiny.tiny_model_path(tmp_path))
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    (path,) = set(results)
    assert (path / tiny.BUILD_MARKER_FILE).is_file()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_incomplete_dir_is_refused_with_remedy(tiny_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    stale = tmp_path / tiny_dir.name
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="Delete"):
        tiny.tiny_model_path(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [stale.name]


def test_stale_temporary_dirs_are_removed(tiny_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    stale = tmp_path / f".{tiny_dir.name}.tmp-crashed"
    fresh = tmp_path / f".{tiny_dir.name}.tmp-running"
    for d in (stale, fresh):
        d.mkdir()
        (d / "config.json").write_text("{}")
    os.utime(stale, (0, 0))
    tiny.tiny_model_path(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([fresh.name, tiny_dir.name])


def test_empty_dir_in_place_is_replaced(tiny_dir: pathlib.Path, tmp_path: pathlib.Path) -> None:
    (tmp_path / tiny_dir.name).mkdir()
    path = tiny.tiny_model_path(tmp_path)
    assert (path / tiny.BUILD_MARKER_FILE).is_file()


# ---- loading and the model -----------------------------------------------------------


def test_loads_offline_with_auto_classes(tiny_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert isinstance(model, Qwen3ForCausalLM)
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert model.config.vocab_size == len(tok) == tiny.VOCAB_SIZE
    assert model.config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert model.config.pad_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert tok.model_max_length == model.config.max_position_embeddings == 8192
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config._attn_implementation == "sdpa"


def test_load_tiny(tiny_dir: pathlib.Path) -> None:
    model, tok = tiny.load_tiny(tiny_dir.parent)
    assert next(model.parameters()).dtype == torch.float32
    assert isinstance(tok, PreTrainedTokenizerFast)
    model16, _ = tiny.load_tiny(tiny_dir.parent, dtype=torch.bfloat16)
    assert next(model16.parameters()).dtype == torch.bfloat16


def test_parameter_count(model: Qwen3ForCausalLM) -> None:
    n = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= n <= 10_000_000, n


def test_forward_and_generate(model: Qwen3ForCausalLM, tokenizer: PreTrainedTokenizerFast) -> None:
    batch = tokenizer(["Hello there, how are you?", "3 + 4 = 7"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits  # [batch, seq, vocab]
    assert logits.shape == (2, batch["input_ids"].shape[1], len(tokenizer))
    assert torch.isfinite(logits).all()
    prompt = tokenizer(["3 + 4 ="], return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False)  # [1, prompt + new]
    assert out.shape[0] == 1 and prompt["input_ids"].shape[1] < out.shape[1] <= prompt["input_ids"].shape[1] + 4


# ---- tokenizer ----------------------------------------------------------------------------


@settings(max_examples=200,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(text=st.text(max_size=200))
def test_unicode_round_trips(tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_exotic_text_round_trips(tokenizer: PreTrainedTokenizerFast) -> None:
    text = "  Zürich 日本語 🙂🚀\t\r\n\x00 é (e\u0301) <|im_end|><think>x</think>\n\n  end "
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("token", tiny.SPECIAL_TOKENS + tiny.MARKUP_TOKENS)
def test_markers_are_single_tokens(tokenizer: PreTrainedTokenizerFast, token: str) -> None:
    tid = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(tid, int) and tid != tokenizer.unk_token_id
    assert tokenizer.encode(token, add_special_tokens=False) == [tid]
    ids = tokenizer.encode(f"a{token}b\n", add_special_tokens=False)
    assert tid in ids
    assert tokenizer.decode(ids) == f"a{token}b\n"


def test_special_tokens_and_no_bos(tokenizer: PreTrainedTokenizerFast) -> None:
    assert tokenizer.convert_tokens_to_ids(list(tiny.SPECIAL_TOKENS)) == [0, 1, 2]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    assert tokenizer("hi").input_ids == tokenizer.encode("hi", add_special_tokens=False)
    # specials are dropped by skip_special_tokens, the tool/think markers are kept (as in Qwen)
    ids = tokenizer.encode("<|im_start|>a<tool_call>b<|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a<tool_call>b"


# ---- chat template --------------------------------------------------------------------------


def test_template_exact_with_tools(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
            ],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": '{"temp": 3}'},
        {"role": "assistant", "content": "Paris 21, Oslo 3."},
    ]
    tool_json = json.dumps(WEATHER_TOOL)
    expected = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{tool_json}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Oslo"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n'
        '<tool_response>\n{"temp": 3}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\nParis 21, Oslo 3.<|im_end|>\n"
    )
    assert render(tokenizer, messages, tools=[WEATHER_TOOL]) == expected


def test_template_without_system_or_tools(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nsay hi\n</think>\n\nHello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert render(tokenizer, messages, agp=True) == (
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nsay hi\n</think>\n\nHello!<|im_end|>\n"  # history kept as is
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_template_tools_without_system_creates_one(tokenizer: PreTrainedTokenizerFast) -> None:
    out = render(tokenizer, [{"role": "user", "content": "Hi"}], tools=[WEATHER_TOOL])
    assert out.startswith("<|im_start|>system\n# Tools\n\n")
    assert out.endswith("</tool_call><|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_template_content_and_flat_tool_call(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "user", "content": "Add"},
        {"role": "assistant", "content": "Calling.", "tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}]},
    ]
    assert render(tokenizer, messages).endswith(
        '<|im_start|>assistant\nCalling.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
        "</tool_call><|im_end|>\n"
    )


def test_template_marks_assistant_tokens(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]
    out = tokenizer.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
    ids = [i for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tokenizer.decode(ids) == "Hello!<|im_end|>"


# A small vocabulary of contents that exercises newlines, markers, unicode and emptiness.
_pieces = [*"ab 1\n{}\"é🙂<>/", "<think>", "</think>", "<|im_end|>"]
_texts = st.lists(st.sampled_from(_pieces), max_size=12).map("".join)
_args = st.one_of(
    st.dictionaries(st.sampled_from(["city", "a", "q"]), st.one_of(st.integers(-5, 5), _texts), max_size=2),
    st.builds(json.dumps, st.dictionaries(st.sampled_from(["x", "y"]), st.integers(0, 9), max_size=2)),
)
_tool_call = st.builds(
    lambda name, args, nested: {"type": "function", "function": {"name": name, "arguments": args}}
    if nested
    else {"name": name, "arguments": args},
    st.sampled_from(["get_weather", "add", "search"]),
    _args,
    st.booleans(),
)
_message = st.one_of(
    st.fixed_dictionaries({"role": st.just("user"), "content": _texts}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": _texts}),
    st.fixed_dictionaries(
        {
            "role": st.just("assistant"),
            "content": st.one_of(st.none(), _texts),
            "tool_calls": st.lists(_tool_call, min_size=1, max_size=2),
        }
    ),
    st.fixed_dictionaries({"role": st.just("tool"), "content": _texts}),
    st.fixed_dictionaries({"role": st.just("system"), "content": _texts}),
)
_conversation = st.builds(
    lambda system, rest: ([{"role": "system", "content": system}] if system is not None else []) + rest,
    st.one_of(st.none(), _texts),
    st.lists(_message, min_size=1, max_size=7),
)
_tools = st.one_of(st.none(), st.just([WEATHER_TOOL]), st.just([WEATHER_TOOL, {"name": "add", "parameters": {}}]))


@settings(max_examples=300,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(messages=_conversation, tools=_tools)
def test_template_is_prefix_stable(
    tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, Any]], tools: Any
) -> None:
    full = render(tokenizer, messages, tools=tools)
    for i in range(1, len(messages)):
        if messages[i]["role"] == "assistant":
            assert full.startswith(render(tokenizer, messages[:i], tools=tools, agp=True)), i
        # the one documented exception: a cut between two tool messages that share a user turn
        if not (messages[i - 1]["role"] == "tool" and messages[i]["role"] == "tool"):
            assert full.startswith(render(tokenizer, messages[:i], tools=tools)), i


def test_cut_between_tool_messages_is_not_a_prefix(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [
        {"role": "user", "content": "q"},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
    ]
    assert not render(tokenizer, messages).startswith(render(tokenizer, messages[:2]))


def test_corpus_size_is_reasonable() -> None:
    size = os.path.getsize(pathlib.Path(tiny.__file__).parents[1] / "data" / tiny.CORPUS_FILE)
    assert 40_000 <= size <= 120_000, size
