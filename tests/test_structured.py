"""Structured outputs without a model: request fields -> StructuredOutput -> grammar (the one both engines run).

The grammar tests run llguidance on the tiny model's real tokenizer: what a tool-call grammar
accepts must be exactly what the chat template renders for that call and what the server's
parser reads back (serve/structured.py, point 2).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from artrl.chat.format import end_of_turn_ids, template_message
from artrl.serve.engines.sampling import mask_logits
from artrl.serve.structured import (
    NO_PARAMETERS,
    GrammarCompiler,
    StructuredOutput,
    StructuredOutputError,
    ToolSchema,
    bitmask_words,
    lark_grammar,
    structured_output,
)
from artrl.serve.tool_calls import HERMES, parse_tool_calls, tool_call_syntax

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}}, "required": ["colour"]}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def compiler(tok: Any) -> GrammarCompiler:
    return GrammarCompiler(tok, len(tok), end_of_turn_ids(tok))


def accepts(compiler: GrammarCompiler, structured: StructuredOutput, ids: list[int]) -> bool:
    """Whether the grammar takes `ids` one by one, each allowed by the bitmask before it, and then lets the turn end."""
    row = compiler.compile(structured).row()
    mask = torch.empty(bitmask_words(compiler.vocab_size), dtype=torch.int32)
    for token in ids:
        row.fill_bitmask(mask)
        if not (int(mask[token // 32]) >> (token % 32)) & 1:
            return False
        assert row.accept(token)
    row.fill_bitmask(mask)  # complete: an end-of-turn id may follow
    return any((int(mask[t // 32]) >> (t % 32)) & 1 for t in end_of_turn_ids(compiler._tokenizer))


def rendered_reply(tok: Any, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """The text the chat template renders for an assistant turn that only calls tools (without its end tokens)."""
    message = {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{k}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for k, (n, a) in enumerate(calls)]}
    text = tok.apply_chat_template([{"role": "user", "content": "q"}, template_message(message)], tokenize=False)
    return text.split("<|im_start|>assistant\n", 1)[1].rsplit("<|im_end|>", 1)[0]


# ---- request fields -> StructuredOutput ----------------------------------------------------------------


def test_request_fields_become_one_constraint() -> None:
    assert structured_output(None, None, None, None, HERMES) is None
    assert structured_output({"type": "text"}, [WEATHER], "auto", None, HERMES) is None
    assert structured_output(None, [WEATHER], "auto", None, HERMES) is None  # the model chooses: nothing to hold

    obj = structured_output({"type": "json_object"}, None, None, None, None)
    assert (obj.kind, obj.schema, obj.tools) == ("json_object", {"type": "object"}, ())
    schema = structured_output(JSON_SCHEMA, [WEATHER], "none", None, None)
    assert (schema.kind, schema.schema, schema.tools) == ("json_schema", SCHEMA, ())  # "none" drops the tools
    either = structured_output(JSON_SCHEMA, [WEATHER], "auto", None, HERMES)
    assert [t.name for t in either.tools] == ["get_weather"] and either.syntax == HERMES

    required = structured_output(JSON_SCHEMA, [WEATHER, TIME], "required", None, HERMES)
    assert required.kind == "tool_calls" and required.param == "tool_choice" and required.parallel_tool_calls
    assert required.tools == (ToolSchema("get_weather", WEATHER["function"]["parameters"]),
                              ToolSchema("get_time", NO_PARAMETERS))
    assert not structured_output(None, [WEATHER], "required", False, HERMES).parallel_tool_calls
    named = structured_output(None, [WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None,
                              HERMES)
    assert [t.name for t in named.tools] == ["get_time"] and not named.parallel_tool_calls


@pytest.mark.parametrize(("fields", "param", "words"), [
    (({"type": "xml"}, None, None), "response_format", "json_object"),
    (({"type": "json_schema", "json_schema": {"name": "a"}}, None, None), "response_format", "schema"),
    (("json", None, None), "response_format", "json_schema"),
    ((None, None, "required"), "tool_choice", "at least one tool"),
    ((None, [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "required"),
     "tools[0].function.parameters", "object"),
])
def test_bad_fields_name_the_field(fields: tuple[Any, Any, Any], param: str, words: str) -> None:
    with pytest.raises(StructuredOutputError, match=words) as caught:
        structured_output(*fields, None, HERMES)
    assert caught.value.param == param


def test_tool_calls_need_a_known_syntax(tok: Any) -> None:
    assert tool_call_syntax(tok) == HERMES
    with pytest.raises(StructuredOutputError, match="<tool_call>") as caught:
        structured_output(None, [WEATHER], "required", None, None)
    assert caught.value.param == "tool_choice"


# ---- grammars ---------------------------------------------------------------------------------------------


def test_added_tokens_are_required_as_one_token() -> None:
    structured = structured_output(None, [WEATHER], "required", None, HERMES)
    grammar = lark_grammar(structured, {"<tool_call>": 7, "</tool_call>": 8, "<think>": 9})
    assert '<[7]> "\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": " %json' in grammar
    assert '"}\\n" <[8]>' in grammar and "<[9]>" not in grammar
    only_start = lark_grammar(structured, {"<tool_call>": 7})
    assert '"<tool_call>' not in only_start and '"}\\n</tool_call>"' in only_start  # not an added token: text


@settings(max_examples=25)
@given(calls=st.lists(st.tuples(
    st.sampled_from(["get_weather", "get_time"]),
    # (control characters aside: llguidance never writes U+007F unescaped, which json.dumps does)
    st.fixed_dictionaries({"city": st.text(st.characters(blacklist_categories=["Cc", "Cs"]), max_size=12)},
                          optional={"days": st.integers(-10**6, 10**6)})),
    min_size=1, max_size=3))
def test_tool_call_grammar_accepts_what_the_template_renders(tok: Any, compiler: GrammarCompiler,
                                                             calls: list[tuple[str, dict[str, Any]]]) -> None:
    # under a grammar, properties come in the order the schema lists them (city, then days)
    calls = [(name, {} if name == "get_time" else {k: args[k] for k in ("city", "days") if k in args})
             for name, args in calls]
    text = rendered_reply(tok, calls)
    parsed = parse_tool_calls(text)[1]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed] == calls
    ids = tok(text, add_special_tokens=False).input_ids
    required = structured_output(None, [WEATHER, TIME], "required", None, HERMES)
    assert accepts(compiler, required, ids)
    single = structured_output(None, [WEATHER, TIME], "required", False, HERMES)
    assert accepts(compiler, single, ids) == (len(calls) == 1)


def test_tool_call_grammar_refuses_other_spellings(tok: Any, compiler: GrammarCompiler) -> None:
    required = structured_output(None, [WEATHER], "required", None, HERMES)
    good = rendered_reply(tok, [("get_weather", {"city": "Paris"})])
    assert accepts(compiler, required, tok(good, add_special_tokens=False).input_ids)
    for bad in [good.replace('": "', '":"'),  # not json.dumps's spacing
                good.replace('{"city"', '{ "city"'),  # nor is any more whitespace
                good.replace("get_weather", "get_time"),  # a function not offered
                good.replace('"Paris"', "7"),  # arguments against the parameters
                "Sure. " + good,  # text around the calls
                good.replace("<tool_call>", "<tool_call> ")]:
        assert not accepts(compiler, required, tok(bad, add_special_tokens=False).input_ids), bad
    # "<tool_call>" spelled in pieces is not the template's tokenization: refused
    pieces = tok("<", add_special_tokens=False).input_ids + tok("tool_call>", add_special_tokens=False).input_ids
    rest = tok(good[len("<tool_call>"):], add_special_tokens=False).input_ids
    assert not accepts(compiler, required, pieces + rest)


def test_json_schema_grammar(tok: Any, compiler: GrammarCompiler) -> None:
    structured = structured_output(JSON_SCHEMA, None, None, None, HERMES)

    def ids(text: str) -> list[int]:
        return tok(text, add_special_tokens=False).input_ids

    assert accepts(compiler, structured, ids('{"colour": "red"}'))
    assert not accepts(compiler, structured, ids('{"colour": "blue"}'))
    assert not accepts(compiler, structured, ids('{"colour": "red"'))  # incomplete: no end of turn yet
    either = structured_output(JSON_SCHEMA, [WEATHER], "auto", None, HERMES)
    call = rendered_reply(tok, [("get_weather", {"city": "Oslo"})])
    assert accepts(compiler, either, ids('{"colour": "green"}')) and accepts(compiler, either, ids(call))
    assert not accepts(compiler, structured, ids(call))


def test_grammars_compile_once_per_distinct_constraint(tok: Any) -> None:
    compiler = GrammarCompiler(tok, len(tok), end_of_turn_ids(tok), cache_size=2)
    a = structured_output(JSON_SCHEMA, None, None, None, None)
    b = structured_output({"type": "json_object"}, None, None, None, None)
    first = compiler.compile(a)
    assert compiler.compile(structured_output(JSON_SCHEMA, None, None, None, None)) is first
    assert compiler.cached(a) is first and compiler.compiled == 1
    compiler.compile(b)
    assert compiler.compiled == 2
    compiler.compile(structured_output(None, [WEATHER], "required", None, HERMES))  # evicts a (least recent)
    assert compiler.cached(a) is None and compiler.cached(b) is not None
    rows = [first.row(), first.row()]  # one matcher per sampled row: they advance independently
    brace = tok("{", add_special_tokens=False).input_ids
    assert len(brace) == 1 and rows[0].accept(brace[0]) and not rows[0].accept(brace[0])  # "{{" is not JSON
    assert rows[1].accept(brace[0])


@pytest.mark.parametrize("schema", [{"type": "bogus"}, {"$ref": "#/$defs/missing"}, {"type": "string", "pattern": "("}])
def test_a_schema_that_does_not_compile_is_a_clear_error(compiler: GrammarCompiler, schema: dict[str, Any]) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(StructuredOutputError, match="cannot be compiled") as caught:
        compiler.compile(structured_output(fmt, None, None, None, None))
    assert caught.value.param == "response_format"
    parameters = {"type": "object", "properties": {"a": schema}}
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with pytest.raises(StructuredOutputError, match="'f'") as caught:  # refused before compiling, any tool_choice
        compiler.compile(structured_output(None, [tool], "required", None, HERMES))
    assert caught.value.param == "tools[0].function.parameters"


def test_mask_logits_touches_only_constrained_rows() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 70)  # [batch, vocab]; 70 tokens need 3 words
    bitmask = torch.zeros(1, 3, dtype=torch.int32)  # [rows, words]
    bitmask[0, 0] = 1 << 5
    bitmask[0, 2] = 1 << 1  # token 65
    masked = mask_logits(logits, bitmask, torch.tensor([1]))
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    assert torch.isfinite(masked[1]).nonzero().flatten().tolist() == [5, 65]
    assert torch.equal(masked[1, [5, 65]], logits[1, [5, 65]])
    assert torch.equal(logits, logits.clone())  # the input is not changed in place


# ---- the grammar text (what the vLLM engine hands to vLLM's worker) ----------------------------------------


def test_the_turn_ends_on_an_end_of_turn_id_written_into_the_grammar(tok: Any, compiler: GrammarCompiler) -> None:
    """The grammar text alone says where a reply may end (vLLM's llguidance tokenizer knows one eos only)."""
    structured = structured_output(JSON_SCHEMA, None, None, None, None)
    ends = sorted(end_of_turn_ids(tok))
    assert len(ends) == 2  # <|endoftext|> and <|im_end|>
    text = compiler.compile(structured).lark
    end_rule = "end_of_turn: " + " | ".join(f"<[{t}]>" for t in ends)
    assert text.splitlines()[1:3] == ["start: reply end_of_turn", end_rule]
    # compiled from the text alone, on a tokenizer that knows only its own eos, it still ends on either id

    only_eos = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    assert only_eos.eos_token == tok.eos_token_id
    body = tok('{"colour": "red"}', add_special_tokens=False).input_ids
    for end in ends:
        matcher = llguidance.LLMatcher(only_eos, llguidance.LLMatcher.grammar_from_lark(text), log_level=0)
        assert all(matcher.consume_token(t) for t in body) and matcher.consume_token(end) and matcher.is_stopped()
    early = llguidance.LLMatcher(only_eos, llguidance.LLMatcher.grammar_from_lark(text), log_level=0)
    assert not early.consume_token(ends[0])  # nor before the JSON is complete


def test_a_grammar_compiles_again_from_its_text(tok: Any, compiler: GrammarCompiler) -> None:
    """vLLM's worker compiles the text the engine compiled: the same language, cached by the text."""
    structured = structured_output(None, [WEATHER, TIME], "required", False, HERMES)
    text = compiler.compile(structured).lark
    worker = GrammarCompiler(tok, len(tok), end_of_turn_ids(tok))
    again = worker.compile_lark(text)
    assert again.structured is None and again.lark == text and worker.compile_lark(text) is again
    good = tok(rendered_reply(tok, [("get_weather", {"city": "Oslo"})]), add_special_tokens=False).input_ids
    two = tok(rendered_reply(tok, [("get_time", {}), ("get_time", {})]), add_special_tokens=False).input_ids
    for ids, expected in ((good, True), (two, False)):
        row = again.row()
        taken = all(row.accept(t) for t in ids)
        assert (taken and row.accept(tok.convert_tokens_to_ids("<|im_end|>"))) == expected
    with pytest.raises(StructuredOutputError, match="cannot be compiled"):
        worker.compile_lark(text.replace("start:", "start"))


# --------------------------------------------------------------------------- recursion that can end

from artrl.serve.schema_ends import unending_part  # noqa: E402

_BAD = {"type": "object", "properties": {"z": {"$ref": "#/$defs/bad"}}, "required": ["z"]}
ENDS = {
    # name: (schema, the JSON pointer of the part that cannot end, or None)
    "tree_with_optional_child": ({"type": "object", "properties": {"v": {"type": "integer"}, "child": {"$ref": "#"}},
                                  "required": ["v"]}, None),
    "tree_without_type": ({"properties": {"v": {"type": "integer"}, "child": {"$ref": "#"}}, "required": ["v"]}, None),
    "arrays_of_itself": ({"type": "array", "items": {"$ref": "#"}}, None),
    "linked_list_ending_in_null": ({"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "string"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
        "required": ["v", "next"]}}, "$ref": "#/$defs/node"}, None),
    "a_ref_to_nothing": ({"$ref": "#/$defs/nothing"}, None),  # the grammar library's to refuse
    "itself": ({"$ref": "#"}, "#"),
    "required_self": ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "#"),
    "non_empty_array_of_itself": ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, "#"),
    "optional_property_that_cannot_end": ({"type": "object", "properties": {"x": {"$ref": "#/$defs/bad"}},
                                           "$defs": {"bad": _BAD}}, "#/properties/x"),
    "any_of_branch_that_cannot_end": ({"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/bad"}],
                                       "$defs": {"bad": _BAD}}, "#/anyOf/1"),
    "object_form_that_cannot_end": ({"type": ["object", "null"], "properties": {"x": {"$ref": "#/$defs/bad"}},
                                     "required": ["x"], "$defs": {"bad": _BAD}}, "#"),
    "a_cycle_of_two_definitions": ({"$defs": {
        "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
        "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 2}}, "$ref": "#/$defs/a"}, "#"),
}


@pytest.mark.parametrize("name", sorted(ENDS))
def test_which_recursive_schemas_can_end(name):
    schema, where = ENDS[name]
    found = unending_part(schema)
    assert (found and found[0]) == where, found
