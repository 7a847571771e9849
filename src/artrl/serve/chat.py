"""OpenAI chat messages -> prompt token ids, the way the trainer will see them.

The prompt is `tokenizer.apply_chat_template(messages, tools=tools,
add_generation_prompt=True, tokenize=False)` tokenized with
`add_special_tokens=False`: rendering to text first and tokenizing the text is
also how the trainer tokenizes a trajectory, so the ids match.

Messages are checked (roles, content types, tool call shape) and otherwise passed
to the template as given, because the trainer (`preprocess/tokenize.py`) renders
the same history unchanged and the two must produce the same prompt tokens. The
one rewrite both sides make: content given as a list of `{"type": "text"}` parts
is concatenated into one string (this server is text only). In particular tool
call `arguments` stay the JSON string the OpenAI API carries; templates written
for dicts (`arguments | tojson` without an `is string` check) would render them
quoted, on both sides alike.
"""

from __future__ import annotations

from typing import Any

from artrl.serve.engine import InvalidRequestError

ROLES = ("system", "developer", "user", "assistant", "tool")


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    f"{where}.content[{j}] must be a text part {{'type': 'text', 'text': '...'}} "
                    f"(this server is text only), got {part!r:.200}"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(
        f"{where}.content must be a string or a list of text parts, got {type(content).__name__}"
    )


def _check_tool_call(call: Any, where: str) -> None:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(
            f"{where} must look like {{'id': ..., 'type': 'function', "
            f"'function': {{'name': str, 'arguments': str}}}}, got {call!r:.200}"
        )
    if not isinstance(function.get("arguments", ""), (str, dict)):
        raise InvalidRequestError(
            f"{where}.function.arguments must be a JSON string, got {function['arguments']!r:.200}"
        )


def normalise_messages(messages: Any) -> list[dict[str, Any]]:
    """Check OpenAI chat `messages`; return copies with list content joined (see module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequestError(f"{where} must be an object, got {type(message).__name__}")
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequestError(f"{where}.role must be one of {list(ROLES)}, got {role!r}")
        normalised = dict(message)
        tool_calls = message.get("tool_calls")
        if tool_calls is not None and role != "assistant":
            raise InvalidRequestError(f"{where}: only assistant messages may have tool_calls (role is {role!r})")
        if "content" not in message and not tool_calls:
            raise InvalidRequestError(f"{where} has no content")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            normalised["content"] = _content_text(content, where)
        if tool_calls is not None:
            if not isinstance(tool_calls, list):
                raise InvalidRequestError(f"{where}.tool_calls must be a list")
            for j, call in enumerate(tool_calls):
                _check_tool_call(call, f"{where}.tool_calls[{j}]")
        out.append(normalised)
    return out


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
    """Token ids of the chat prompt (normalised `messages`, optional OpenAI `tools`)."""
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=True, tokenize=False
        )
    except Exception as error:  # jinja's TemplateError, raise_exception(...) in templates, bad values
        raise InvalidRequestError(f"The chat template could not render these messages: {error}") from error
    return list(tokenizer(text, add_special_tokens=False).input_ids)
