"""Structured outputs: replies held to a JSON schema, or to tool calls, by a grammar.

A chat completion request may ask (OpenAI's API) for

- `response_format={"type": "json_object"}`: the reply is one JSON object;
- `response_format={"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`:
  the reply is one JSON value valid against `schema`;
- `tool_choice="required"`: the reply calls one or more of the offered tools (exactly
  one with `parallel_tool_calls=false`), each with arguments valid against that
  tool's `parameters`;
- `tool_choice={"type": "function", "function": {"name": ...}}`: the reply calls that
  tool, once.

`structured_output` reads those request fields into a `StructuredOutput` (plain data);
`lark_grammar` writes one as an llguidance grammar (Lark with embedded JSON schemas);
`GrammarCompiler` compiles grammars for one tokenizer, once per distinct
`StructuredOutput` (a small LRU cache), and hands out a fresh `RowGrammar` per sampled
row, which the decode loop asks for a token bitmask before each step and tells each
sampled token. The vLLM engine runs the same compiled grammars in vLLM's worker
(serve/engines/vllm_grammar.py), so both engines hold replies to one language. The choices
made here:

1. **JSON is written as `json.dumps` writes it**: `", "` between items, `": "` after
   keys, no other whitespace. It is the form chat templates render tool-call arguments
   in (`tojson`), so a sampled tool call re-renders as exactly the text sampled and the
   next turn's prompt extends the token record (docs/token-record.md). An object's
   properties come in the order its schema lists them (as OpenAI's strict mode writes
   them; llguidance's rule), so that order is the one rendered back. Nothing else is
   bounded beyond what the schema says (string lengths, digits, nesting): a reply cut
   by `max_tokens` ends with `finish_reason: "length"`, as in OpenAI, and is not
   valid JSON.
2. **Tool calls in the chat family's own syntax** (`tool_calls.ToolCallSyntax`;
   Qwen/Hermes `<tool_call>` blocks), with nothing else in the reply: what the
   template renders for an assistant message that only calls tools, and what the
   server's parser reads back. A marker the tokenizer holds as one added token
   (`<tool_call>`) must be sampled as that token, the spelling the template's text
   tokenizes to.
3. **A JSON `response_format` with tools offered under `tool_choice` "auto"** lets the
   reply be either the JSON or tool calls; `tool_choice` "none" leaves the tools out of the constraint (they
   stay in the prompt: serve/http/core.py).
4. **Anything the grammar library cannot compile** (an invalid schema, an unknown
   keyword, a `$ref` to nowhere) is a `StructuredOutputError`: an `InvalidRequestError`
   naming the request field (`param`), which the server answers as a 400. A **recursive
   schema** is compiled as it is (llguidance follows `$ref` cycles) when its recursion can
   end, such as a tree whose child is optional; one with a part that cannot end (a required
   self-reference, a non-empty array of itself: serve/schema_ends.py) is refused the same
   way, since the grammar library would let its reply stop mid-value (`{"a": ` answered as
   a normal stop).
5. **The grammar ends the reply**: once it is complete only an end-of-turn id may
   follow; before that, no end-of-turn id can be sampled. The end-of-turn ids are
   written into the grammar itself (`start: reply end_of_turn`), so the grammar text
   alone says where a reply may end, whichever engine runs it.

What logprobs mean under a grammar is the engine's concern (serve/engines/base.py): they are
the raw model logprobs of the sampled tokens, before the mask.
"""

from __future__ import annotations

import collections
import functools
import json
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .errors import InvalidRequestError, RequestProblem
from .schema_ends import unending_part
from .tool_calls import ToolCallSyntax

Kind = Literal["json_object", "json_schema", "tool_calls"]

JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
"""llguidance's JSON options for every schema in a grammar: json.dumps's separators (point 1 above)."""

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
"""The arguments of a function whose tool entry gives no `parameters` (OpenAI: an empty parameter list)."""

DEFAULT_CACHE_SIZE = 64


class StructuredOutputError(InvalidRequestError):
    """A structured-output request that cannot be served; `param` names the chat completion field at fault
    (`response_format`, `tool_choice` or `tools`), and so does its one `RequestProblem`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, (RequestProblem(param, message),))
        self.param = param


@dataclass(frozen=True)
class ToolSchema:
    """A function a reply may call: its name and the JSON schema of its arguments (an object)."""

    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class StructuredOutput:
    """What a reply is held to.

    kind "json_object" / "json_schema": the reply is one JSON value valid against
    `schema` (`{"type": "object"}` for json_object), or, when `tools` is not empty,
    tool calls instead (point 3 of the module docstring). kind "tool_calls": the reply
    is one or more calls (one unless `parallel_tool_calls`) of `tools`, written in
    `syntax`. `param` is the request field the constraint came from, for errors.
    """

    kind: Kind
    schema: dict[str, Any] | None = None
    tools: tuple[ToolSchema, ...] = ()
    syntax: ToolCallSyntax | None = None
    parallel_tool_calls: bool = True
    param: str = field(default="response_format", compare=False)

    def key(self) -> str:
        """A cache key: equal for equal constraints (property order included: it is the order written)."""
        return json.dumps(
            [self.kind, self.schema, [[t.name, t.parameters] for t in self.tools],
             self.syntax and [self.syntax.begin, self.syntax.end, self.syntax.separator], self.parallel_tool_calls],
            ensure_ascii=False,
        )


# --------------------------------------------------------------------------- request fields


def structured_output(
    response_format: Any,
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    syntax: ToolCallSyntax | None,
) -> StructuredOutput | None:
    """The constraint a request asks for (module docstring), or None when it asks for none.

    `tool_choice` is already checked for shape and for naming an offered function (the
    server's `_check_tool_choice`); `syntax` is the chat template's tool-call syntax, None
    when the server cannot write or parse this family's calls.
    """
    schema, kind = _response_schema(response_format)
    for k, tool in enumerate(tools or []):  # every offered tool, whatever tool_choice says (a call is parsed by them)
        _tool_schema(tool, k)
    if tool_choice == "none":
        tools = None
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    parallel = parallel_tool_calls is not False
    if forced:
        offered = [_tool_schema(t, k) for k, t in enumerate(tools or [])]
        if not offered:
            raise StructuredOutputError(
                f"tool_choice={tool_choice!r:.200} needs at least one tool in `tools`; none was given.", "tool_choice")
        if isinstance(tool_choice, dict):
            offered = [t for t in offered if t.name == tool_choice["function"]["name"]]
            parallel = False
        _need_syntax(syntax, "tool_choice")
        return StructuredOutput("tool_calls", None, tuple(offered), syntax, parallel, param="tool_choice")
    if kind is None:
        return None
    optional: tuple[ToolSchema, ...] = ()
    if tools:
        _need_syntax(syntax, "tools")
        optional = tuple(_tool_schema(t, k) for k, t in enumerate(tools))
    return StructuredOutput(kind, schema, optional, syntax if optional else None, parallel, param="response_format")


def _response_schema(response_format: Any) -> tuple[dict[str, Any] | None, Kind | None]:
    if response_format is None:
        return None, None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None, None
    if kind == "json_object":
        return {"type": "object"}, "json_object"
    if kind != "json_schema":
        raise StructuredOutputError(
            'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
            f'"json_schema": {{"name": ..., "schema": {{...}}}}}}; got {response_format!r:.200}.', "response_format")
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise StructuredOutputError(
            f"response_format.json_schema.schema must be a JSON schema object, got {schema!r:.200}; send "
            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}.',
            "response_format")
    return _finite(schema, "response_format's schema", "response_format"), "json_schema"


def _finite(schema: dict[str, Any], what: str, param: str) -> dict[str, Any]:
    """`schema`, unless a part of it cannot end (module docstring, point 4; serve/schema_ends.py)."""
    found = unending_part(schema)
    if found is not None:
        where, why = found
        raise StructuredOutputError(
            f"{what} cannot end: the schema at {where} has no finite value ({why}), so a reply held to it could "
            "never stop. Make the recursion optional: leave the recursive property out of `required`, allow an "
            "empty array (minItems 0), or give it a non-recursive alternative (anyOf).", param)
    return schema


def _tool_schema(tool: Any, k: int) -> ToolSchema:
    """Tool `k`'s name and parameters, checked: an object schema that can end and that a grammar can be made of
    (a 400 naming `tools[k].function.parameters` otherwise, under any tool_choice)."""
    function = tool.get("function", tool) if isinstance(tool, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise StructuredOutputError(f"tools[{k}] has no function name: {tool!r:.200}.", f"tools[{k}].function.name")
    parameters = function.get("parameters")
    if parameters is None:
        return ToolSchema(name, NO_PARAMETERS)
    param = f"tools[{k}].function.parameters"
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise StructuredOutputError(
            f"tools[{k}] ({name!r}) has parameters {parameters!r:.200}; a function's parameters must be a JSON "
            'schema of an object ({"type": "object", "properties": {...}}): its arguments are a JSON object.',
            param)
    schema = _finite({"type": "object", **parameters}, f"tools[{k}] ({name!r}) parameters", param)
    problem = schema_problem(json.dumps(schema, sort_keys=True))
    if problem:
        raise StructuredOutputError(f"tools[{k}] ({name!r}) parameters are not a JSON schema a reply can be held to: "
                                    f"{problem:.300}", param)
    return ToolSchema(name, schema)


SCHEMA_CHECK_CACHE_CHARS = 8192
"""Schemas up to this many characters of JSON keep their check's answer (`schema_problem`, 256 of them)."""


def schema_problem(schema_json: str) -> str:
    """What llguidance finds wrong with the JSON schema `schema_json` (an unknown type or format, a dangling
    `$ref`, a bad pattern...), or "" when a grammar can be made of it."""
    if len(schema_json) <= SCHEMA_CHECK_CACHE_CHARS:
        return _cached_schema_problem(schema_json)
    return _schema_problem(schema_json)


def _schema_problem(schema_json: str) -> str:
    import llguidance

    matcher = llguidance.LLMatcher
    try:
        return matcher.validate_grammar(matcher.grammar_from_json_schema(json.loads(schema_json)))
    except (ValueError, TypeError) as error:  # a schema the grammar builder cannot even read
        return str(error) or type(error).__name__


_cached_schema_problem = functools.lru_cache(maxsize=256)(_schema_problem)


def _need_syntax(syntax: ToolCallSyntax | None, param: str) -> None:
    if syntax is None:
        raise StructuredOutputError(
            "This model's chat template writes tool calls in a syntax the server does not know (it reads Qwen/Hermes "
            "<tool_call> blocks), so a reply cannot be held to calling a tool. Use tool_choice \"auto\" or \"none\", "
            "or a model whose template writes <tool_call> blocks.", param)


# --------------------------------------------------------------------------- grammar


def lark_grammar(structured: StructuredOutput, added_tokens: Mapping[str, int] | None = None,
                 end_ids: Iterable[int] = ()) -> str:
    """The llguidance Lark grammar for `structured`.

    `added_tokens` (text -> id, the tokenizer's `get_added_vocab()`) names the markers
    that must be sampled as one token (module docstring, point 2); `end_ids`, when
    given, are the ids one of which must end the reply (point 5). For a reply that
    must call `get_weather` (city: string) in Hermes syntax, with `<tool_call>` and
    `</tool_call>` added tokens 2042 and 2043 and end-of-turn ids 0 and 2:

        %llguidance {}
        start: reply end_of_turn
        end_of_turn: <[0]> | <[2]>
        reply: calls
        calls: call
        call: call_0
        call_0: <[2042]> "\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": " %json {...} "}\\n" <[2043]>
    """
    added = dict(added_tokens or {})
    ends = sorted({int(t) for t in end_ids})
    lines = ["%llguidance {}"]
    if ends:
        lines.append("start: reply end_of_turn")
        lines.append("end_of_turn: " + " | ".join(f"<[{t}]>" for t in ends))
    reply = "reply" if ends else "start"
    if structured.kind != "tool_calls":
        assert structured.schema is not None
        lines.append(f"{reply}: json" + (" | calls" if structured.tools else ""))
        lines.append("json: " + _json(structured.schema))
    else:
        lines.append(f"{reply}: calls")
    if structured.tools:
        syntax = structured.syntax
        assert syntax is not None, "tool calls need the chat family's tool-call syntax"
        repeat = f" ({_literal(syntax.separator, added)} call)*" if structured.parallel_tool_calls else ""
        lines.append("calls: call" + repeat)
        lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(structured.tools))))
        for i, tool in enumerate(structured.tools):
            head = syntax.begin + '{"name": ' + json.dumps(tool.name, ensure_ascii=False) + ', "arguments": '
            tail = _literal("}" + syntax.end, added)
            lines.append(f"call_{i}: {_literal(head, added)} {_json(tool.parameters)} {tail}")
    return "\n".join(lines) + "\n"


def _json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE}, ensure_ascii=False)


def _literal(text: str, added: Mapping[str, int]) -> str:
    """`text` as a sequence of Lark atoms: quoted strings, and `<[id]>` for each added token it contains."""
    atoms, rest = [], text
    markers = sorted((t for t in added if t and t in text), key=len, reverse=True)
    while rest:
        hits = [(rest.find(t), -len(t), t) for t in markers if t in rest]
        if not hits:
            atoms.append(json.dumps(rest, ensure_ascii=False))
            break
        at, _, token = min(hits)
        if at:
            atoms.append(json.dumps(rest[:at], ensure_ascii=False))
        atoms.append(f"<[{added[token]}]>")
        rest = rest[at + len(token):]
    return " ".join(atoms)


# --------------------------------------------------------------------------- compiling and matching


class RowGrammar:
    """The grammar state of one sampled row: which tokens may come next, and the tokens sampled so far."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into `row` ([words] int32, CPU, contiguous): bit j of word w is token 32w+j."""
        assert row.dtype == torch.int32 and row.is_contiguous() and row.device.type == "cpu"
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it (the state is then an error)."""
        return bool(self._matcher.consume_token(token))

    @property
    def error(self) -> str:
        return self._matcher.get_error()


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a token bitmask over `vocab_size` tokens."""
    return (vocab_size + 31) // 32


@dataclass
class CompiledGrammar:
    """A grammar checked for one tokenizer; `row()` starts a fresh matcher for one sampled sequence. `lark` is
    its text (what the vLLM engine hands to vLLM's worker); `structured` is None for a grammar compiled from
    its text."""

    structured: StructuredOutput | None
    lark: str
    _prototype: Any

    def row(self) -> RowGrammar:
        return RowGrammar(self._prototype.deep_copy())


class GrammarCompiler:
    """Compiles StructuredOutputs for one tokenizer with llguidance; keeps the last `cache_size` distinct ones.

    `vocab_size` is the model's (its logits' width, which may exceed the tokenizer's);
    `end_ids` are the ids that end a turn, the only ones allowed once a grammar is complete.
    Thread-safe; compiling is pure CPU work that a caller may run off its event loop.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, end_ids: Iterable[int], *,
                 cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self._end_ids = sorted(int(t) for t in end_ids)
        self.cache_size = cache_size
        self._ll_tokenizer: Any = None
        self._added: dict[str, int] = {}
        self._cache: collections.OrderedDict[str, CompiledGrammar] = collections.OrderedDict()
        self._lock = threading.Lock()
        #: Grammars compiled (cache misses) so far.
        self.compiled = 0

    def _llg_tokenizer(self, param: str) -> Any:
        if self._ll_tokenizer is None:
            import llguidance.hf

            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._tokenizer, n_vocab=self.vocab_size, eos_token=self._end_ids)
            except ValueError as e:
                raise StructuredOutputError(
                    f"Structured outputs need a fast (Rust-backed) Hugging Face tokenizer; this model's is "
                    f"{type(self._tokenizer).__name__} ({e}).", param) from e
            self._added = {text: int(i) for text, i in self._tokenizer.get_added_vocab().items()}
        return self._ll_tokenizer

    def cached(self, structured: StructuredOutput) -> CompiledGrammar | None:
        """The compiled grammar for `structured` if the cache holds it, else None (never compiles)."""
        key = structured.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
            return hit

    def compile(self, structured: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar for `structured` (cached); StructuredOutputError if it cannot be compiled."""
        return self._compile(structured.key(), structured, None)

    def compile_lark(self, lark: str) -> CompiledGrammar:
        """The compiled grammar for a Lark text that `compile` wrote for this tokenizer (cached by the text): what
        vLLM's worker process receives (serve/engines/vllm_grammar.py). StructuredOutputError if it cannot be compiled."""
        return self._compile(lark, None, lark)

    def _compile(self, key: str, structured: StructuredOutput | None, lark: str | None) -> CompiledGrammar:
        import llguidance

        param = structured.param if structured is not None else "response_format"
        what = _what(structured) if structured is not None else "This Lark text"
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            ll_tokenizer = self._llg_tokenizer(param)
            if lark is None:
                assert structured is not None
                lark = lark_grammar(structured, self._added, self._end_ids)
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
            problem = llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer)
            if problem:
                raise StructuredOutputError(f"{what} cannot be compiled into a grammar: {problem}", param)
            prototype = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
            if prototype.is_error():
                raise StructuredOutputError(f"{what} cannot be compiled into a grammar: {prototype.get_error()}", param)
            compiled = CompiledGrammar(structured, lark, prototype)
            self._cache[key] = compiled
            self.compiled += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return compiled


def _what(structured: StructuredOutput) -> str:
    if structured.kind == "tool_calls":
        return f"The parameters of tools {[t.name for t in structured.tools]}"
    return "response_format's schema" + (f" (or the parameters of tools {[t.name for t in structured.tools]})"
                                          if structured.tools else "")
