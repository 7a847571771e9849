"""The chat format, in one place: messages, rendering, end-of-turn ids, stops.

The data model (`trajectories/data.py`), the tokenizer of training data
(`trajectories/sequences.py`) and the inference server (`serve/`) all read chat
messages; this module is the one set of rules they share:

1. **Validation.** Roles are `VALID_ROLES`; content is a string, a list of
   `{"type": "text"}` parts and (in any role but the assistant's) `{"type":
   "image_url"}` parts (artrl/chat/images.py), or None (assistant turns only); a tool call has a
   non-empty function name and arguments that are a JSON object (a dict, or a
   string that parses to one). Every failure is a `TrajectoryError` whose
   message starts with the item's place (`Trajectory.messages_and_choices[3]`,
   `messages[1]`); the server answers it as a 400.
2. **Normalisation for the template** (`template_message`): text parts are
   joined into one string (with image parts, the content stays a list of text
   parts and `{"type": "image"}` markers, the form vision-language templates
   read), a missing content becomes "", tool call `arguments`
   become dicts (the form Hugging Face chat templates are written for, as vLLM
   passes them; a JSON string would render quoted), and keys whose value is None
   are dropped (templates test `'tool_calls' in message`).
3. **Rendering** (`render_text`) is the tokenizer's own chat template; a
   vision-language model's images are then expanded to their image tokens
   (`ImageTokens`, counts from the model's processor: models/vision.py);
   `encode` tokenizes text without adding special tokens (templates write them).
   `render_prompt` renders a prompt with the generation prompt and, given the
   completions the server returned (its cache, serve/http/prompts.py), tokenizes it piecewise so that an assistant
   message the server itself produced is spelled with the exact ids it sampled
   (see "Prompts that extend the record" below).
4. **End of turn** (`end_of_turn_ids`): the tokenizer's eos, the model's
   generation-config eos ids, and the chat end tokens of the common families
   (`KNOWN_END_TOKENS`). The inference engine stops on exactly these ids and the
   trainer treats exactly these ids as the end of an assistant turn, so an id
   that stops sampling always closes the turn for training too.
5. **Stops** (`completion_text`, `cut_at_stop`): the text of a completion is its
   ids without the final end-of-turn id; a stop string cuts the text before it
   and the ids after the token that completed it.

Prompts that extend the record
------------------------------
A sampled turn is trained on the prompt ids the server saw plus the ids it
sampled (docs/token-record.md). Turns of one trajectory share a training
sequence only when each prompt starts with the previous prompt + sampled ids.
Re-tokenizing the decoded text of an earlier turn breaks that (a byte-level BPE
spells the same text in several ways, and the model sampled one of them), so
`render_prompt` renders the conversation once with each assistant message the
server recently returned replaced by a placeholder, tokenizes the template text
between placeholders piece by piece, and puts the sampled ids in the
placeholders' place. It does so only where the template renders that message
exactly as the model wrote it (the rendered text equals the sampled text,
checked against the rendering of the real messages) and closes it with the
very end-of-turn token the model sampled; the sampled end token then stands for
the template's. Where the template rewrites an earlier turn (Qwen3 drops the
`<think>` block of turns before the last user message, Llama trims whitespace,
Mistral moves the system prompt into the last user turn), the prompt is the
template's text and the trainer starts a new sequence at that turn, which is
right: that is the context the model saw. The first prompt of a conversation
has no placeholder and is tokenized whole, as every later prompt tokenizes its
first piece.
"""

from __future__ import annotations

import json
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import pydantic
from openai.types.chat.chat_completion import Choice
from tokenizers import Tokenizer as _RustTokenizer

from ..errors import ImageError, TrajectoryError
from .images import check_part, image_parts, is_image_part
from ..types import Message, MessageOrChoice


VALID_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

KNOWN_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<end_of_turn>",
                    "<|end|>")
"""Chat end tokens of common model families (Qwen/ChatML, Llama 3, Gemma, Phi); those in the vocabulary end a turn."""

PLACEHOLDER = "@@ARTRL_TURN_{}@@"
"""Stands for an assistant turn's content while a template renders the rest of the conversation."""


def turn_marker(k: int, content: Any) -> str:
    """What stands for assistant turn `k` (content `content`) while a template renders the rest: PLACEHOLDER, and
    after it the `</think>` that closes a reasoning block the content did not open. Such content was sampled after
    a generation prompt that opened the block (Qwen3.5 and later, thinking on), and a template that keeps it
    (chat/preserved_thinking.py) writes it after that opening only when it holds the closing tag: so must the
    placeholder, for the template to put it where the sampled text goes."""
    ph = PLACEHOLDER.format(k)
    if isinstance(content, str) and "</think>" in content and "<think>" not in content:
        return ph + "</think>"
    return ph


# --------------------------------------------------------------------------- validation


def check_content(content: Any, where: str, role: str, has_tool_calls: bool) -> None:
    if content is None:
        if role == "assistant":
            return  # a tool-call turn, or an empty assistant turn (renders as empty text)
        raise TrajectoryError(f"{where}.content is None; a {role!r} message needs string content.")
    if isinstance(content, str):
        return
    if isinstance(content, list):
        for k, part in enumerate(content):
            if is_image_part(part):
                if role == "assistant":
                    raise ImageError(f"{where}.content[{k}] is an image in an assistant message; images go in user, "
                                     "system or tool messages (the model writes text).")
                check_part(part, f"{where}.content[{k}]")
                continue
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise TrajectoryError(
                    f"{where}.content[{k}] is {part!r:.200}; only text parts "
                    "({'type': 'text', 'text': str}) and image parts ({'type': 'image_url', 'image_url': "
                    "{'url': ...}}) are supported."
                )
        return
    raise TrajectoryError(
        f"{where}.content has type {type(content).__name__} ({content!r:.80}); "
        "content must be a string or a list of text and image parts."
    )


def check_tool_calls(tool_calls: Any, where: str) -> None:
    if tool_calls is None:
        return
    if not isinstance(tool_calls, list):
        raise TrajectoryError(f"{where}.tool_calls must be a list, got {type(tool_calls).__name__}.")
    for k, call in enumerate(tool_calls):
        at = f"{where}.tool_calls[{k}]"
        if hasattr(call, "model_dump"):
            call = call.model_dump()
        if not isinstance(call, dict):
            raise TrajectoryError(f"{at} must be a dict, got {type(call).__name__}.")
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn.get("name"):
            raise TrajectoryError(f"{at}.function.name is missing or not a non-empty string: {call!r:.200}.")
        args = fn.get("arguments")
        if isinstance(args, dict):
            continue
        if not isinstance(args, str):
            raise TrajectoryError(f"{at}.function.arguments must be a JSON string, got {type(args).__name__}.")
        try:
            parsed = json.loads(args)
        except json.JSONDecodeError as e:
            raise TrajectoryError(
                f"{at}.function.arguments is not valid JSON ({e.msg} at char {e.pos}): {args!r:.200}. "
                "Fix the arguments, or record the turn as plain assistant content."
            ) from None
        if not isinstance(parsed, dict):
            raise TrajectoryError(f"{at}.function.arguments must encode a JSON object, got {args!r:.200}.")


def check_item(item: Any, where: str) -> MessageOrChoice:
    """Validate one entry of messages_and_choices; returns it (dict-shaped choices become Choice)."""
    if isinstance(item, Choice):
        msg = item.message
        if msg.role != "assistant":
            raise TrajectoryError(f"{where} is a Choice whose message.role is {msg.role!r}; expected 'assistant'.")
        check_tool_calls([tc.model_dump() for tc in msg.tool_calls or []], f"{where}.message")
        return item
    if isinstance(item, pydantic.BaseModel):
        # e.g. an openai ChatCompletionMessage passed instead of a dict
        item = item.model_dump(exclude_none=True)
    if not isinstance(item, dict):
        raise TrajectoryError(
            f"{where} has type {type(item).__name__}; expected an OpenAI chat message dict or a Choice."
        )
    if "message" in item and "finish_reason" in item and "role" not in item:
        try:
            return check_item(Choice.model_validate(item), where)
        except pydantic.ValidationError as e:
            raise TrajectoryError(f"{where} looks like a Choice but is malformed: {e}") from None
    role = item.get("role")
    if role not in VALID_ROLES:
        raise TrajectoryError(f"{where}.role is {role!r}; expected one of {sorted(VALID_ROLES)}.")
    has_tool_calls = bool(item.get("tool_calls"))
    if has_tool_calls and role != "assistant":
        raise TrajectoryError(f"{where} has tool_calls but role {role!r}; only assistant messages call tools.")
    check_content(item.get("content"), where, role, has_tool_calls)
    check_tool_calls(item.get("tool_calls"), where)
    return item


def check_tools(tools: Any, where: str) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise TrajectoryError(f"{where} must be a list of tool schemas, got {type(tools).__name__}.")
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise TrajectoryError(f"{where}[{k}] must be a dict, got {type(tool).__name__}.")
        fn = tool.get("function", tool)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise TrajectoryError(f"{where}[{k}] has no function name: {tool!r:.200}.")


def check_messages(items: Any, where: str) -> list[MessageOrChoice]:
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise TrajectoryError(f"{where} must be a list of messages and choices, got {type(items).__name__}.")
    return [check_item(item, f"{where}[{i}]") for i, item in enumerate(items)]


def message_of(item: MessageOrChoice) -> Message:
    """The chat message dict for an entry (a Choice becomes its assistant message)."""
    if isinstance(item, Choice):
        m = item.message
        out: Message = {"role": "assistant", "content": m.content}
        if m.tool_calls:
            out["tool_calls"] = [tc.model_dump() for tc in m.tool_calls]
        return out
    return item


# --------------------------------------------------------------------------- normalisation


def content_text(content: Any) -> str:
    """Content as one string: None is "", text parts are joined (image parts are not text)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)


def template_content(content: Any) -> Any:
    """Content as templates read it: one string, or, with images, text parts and `{"type": "image"}` markers
    (adjacent text parts joined)."""
    if not isinstance(content, list) or not any(is_image_part(part) for part in content):
        return content_text(content)
    out: list[dict[str, Any]] = []
    for part in content:
        if is_image_part(part):
            out.append({"type": "image"})
        elif out and out[-1]["type"] == "text":
            out[-1] = {"type": "text", "text": out[-1]["text"] + part.get("text", "")}
        else:
            out.append({"type": "text", "text": part.get("text", "")})
    return out


def image_urls(items: Sequence[Any], where: str) -> list[tuple[int, str, str]]:
    """(message index, the part's place for errors, url) of every image part of `items` (messages; a Choice has
    none), in order."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, Choice):
            continue
        content = item.get("content") if isinstance(item, dict) else None
        for k, part in image_parts(content):
            out.append((i, f"{where}[{i}].content[{k}]", part["image_url"]["url"]))
    return out


@dataclass(frozen=True)
class ImageTokens:
    """How a conversation's images appear in its prompt: the template writes `token` once per image (Qwen's
    `<|image_pad|>`), and image k takes `counts[k]` of them (its processor's grid; models/vision.py)."""

    token: str
    counts: tuple[int, ...]

    def expand(self, text: str, where: str) -> str:
        pieces = text.split(self.token)
        if len(pieces) - 1 != len(self.counts):
            raise ImageError(f"{where}: the chat template wrote {len(pieces) - 1} image placeholders "
                             f"({self.token}) for {len(self.counts)} images; a template that does not render image "
                             "parts in some role (e.g. tool results) cannot show them to the model. Move the images "
                             "into user messages, or use a template that renders them.")
        out = [pieces[0]]
        for count, piece in zip(self.counts, pieces[1:]):
            out += [self.token * count, piece]
        return "".join(out)


def _template_tool_call(call: Any) -> dict[str, Any]:
    if hasattr(call, "model_dump"):
        call = call.model_dump()
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except json.JSONDecodeError:
            pass  # validated data never gets here; an unparsable string renders as it is
    return {k: v for k, v in {**call, "function": fn}.items() if v is not None}


def template_message(item: MessageOrChoice) -> Message:
    """The message as chat templates expect it (see the module docstring, point 2)."""
    msg = message_of(item)
    out = {k: v for k, v in msg.items() if v is not None and k not in ("content", "tool_calls")}
    out["content"] = template_content(msg.get("content"))
    if msg.get("tool_calls"):
        out["tool_calls"] = [_template_tool_call(call) for call in msg["tool_calls"]]
    return out


def message_key(message: Message) -> tuple[str, tuple[tuple[str, str], ...]]:
    """What identifies an assistant message's text: its content and its calls (name, canonical arguments)."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = (call.model_dump() if hasattr(call, "model_dump") else call).get("function") or {}
        args = fn.get("arguments")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
            canonical = json.dumps(parsed, ensure_ascii=False, sort_keys=True)
        except (TypeError, ValueError):
            canonical = str(args)
        calls.append((str(fn.get("name")), canonical))
    return content_text(message.get("content")), tuple(calls)


# --------------------------------------------------------------------------- rendering


def render_text(tokenizer: Any, messages: Sequence[Message], tools: list[dict[str, Any]] | None, *,
                add_generation_prompt: bool, where: str, images: ImageTokens | None = None,
                template_kwargs: dict[str, Any] | None = None) -> str:
    """The chat template's text for normalised `messages`, its image placeholders expanded by `images`;
    `template_kwargs`: variables the template reads besides the messages (`{"enable_thinking": False}`); a
    template failure is a TrajectoryError."""
    try:
        text = tokenizer.apply_chat_template(list(messages), tools=tools or None,
                                             add_generation_prompt=add_generation_prompt, tokenize=False,
                                             **(template_kwargs or {}))
    except Exception as e:  # template errors come in many types (jinja's TemplateError, TypeError, ...)
        hint = " (the chat template may not support tools)" if tools else ""
        raise TrajectoryError(f"{where}: the chat template could not render the conversation{hint}: "
                              f"{type(e).__name__}: {e}") from None
    return images.expand(text, where) if images is not None else text


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text`, no special tokens added (the template wrote those it wants).

    A fast (Rust) tokenizer in its plain state encodes through its backend's single-text `encode`: the
    same ids without the wrapper's batch of one, which hands the text to the backend's thread pool (a
    thread wake-up in every chat request, ~0.2 ms on a busy CPU). Anything else (padding or truncation
    left set on the backend, special tokens split, a slow tokenizer) goes through `tokenizer(...)`.
    """
    if not text:
        return []
    backend = getattr(tokenizer, "_tokenizer", None)
    # only a Rust `tokenizers.Tokenizer` itself (a wrapper may hold another transformers tokenizer there)
    if isinstance(backend, _RustTokenizer) and getattr(tokenizer, "is_fast", False) and backend.padding is None \
            and backend.truncation is None \
            and backend.encode_special_tokens == bool(getattr(tokenizer, "split_special_tokens", False)):
        return backend.encode(text, add_special_tokens=False).ids
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def split_at_placeholders(text: str, indices: Sequence[int], markers: Sequence[str] | None = None
                          ) -> list[str] | None:
    """`text` cut at PLACEHOLDER.format(i) for each i in order (or at `markers`, one per index: `turn_marker`);
    None unless each occurs exactly once, in order."""
    pieces, rest = [], text
    for n, i in enumerate(indices):
        ph = markers[n] if markers is not None else PLACEHOLDER.format(i)
        if rest.count(ph) != 1:
            return None
        before, rest = rest.split(ph, 1)
        pieces.append(before)
    pieces.append(rest)
    return pieces


@dataclass(frozen=True, eq=True)
class SampledCompletion:
    """One completion the server returned: the prompt it came from, its ids, and their text."""

    prompt_hash: int
    token_ids: array  # array("i"): 4 bytes per id, a tenth of a list of Python ints
    text: str  # decoded ids without a final end-of-turn id
    end_id: int | None  # the final end-of-turn id, if the completion ended with one


class CompletionLookup(Protocol):
    """Where `render_prompt` finds the completions a server returned for an assistant message (the server's
    bounded cache, serve/http/prompts.py's `RecentCompletions`)."""

    def __len__(self) -> int: ...

    def get(self, message: Message) -> list[SampledCompletion]:
        """The completions returned for `message`, newest first (none: [])."""
        ...


Fits = list[list[tuple[SampledCompletion, int]] | None]


def _fitting(text: str, pieces: list[str], options: list[list[SampledCompletion]], end_text: dict[int, str],
             ) -> Fits | None:
    """For each placeholder, the completions whose text fills its slot so the pieces rebuild `text`.

    Returns, per placeholder, (completion, characters of the next piece it stands for) pairs:
    a completion that ended with the same end-of-turn token the template writes next stands
    for that token too. A placeholder no completion fills (the template rewrote that turn) gets
    None, and the walk resumes where the next piece is found. None if the pieces do not rebuild
    `text` at all.
    """
    if not text.startswith(pieces[0]):
        return None
    pos, out = len(pieces[0]), []
    for k, entries in enumerate(options):
        nxt = pieces[k + 1]
        fits, after = [], None
        for e in entries:
            # the real text must read: the completion's text, then the template's next piece
            if not (text.startswith(e.text, pos) and text.startswith(nxt, pos + len(e.text))):
                continue
            if after is not None and pos + len(e.text) + len(nxt) != after:
                continue  # another completion's text fits here too; keep the newest reading
            skip = 0
            if e.end_id is not None:
                tail = end_text.get(e.end_id, "")
                if not tail or not nxt.startswith(tail):
                    continue  # the model ended with another token than the template closes the turn with
                skip = len(tail)
            fits.append((e, skip))
            after = pos + len(e.text) + len(nxt)
        if fits:
            out.append(fits)
            pos = after
            continue
        found = text.find(nxt, pos) if nxt else -1
        if found < 0:
            return None
        out.append(None)
        pos = found + len(nxt)
    return out if pos == len(text) else None


def render_prompt(tokenizer: Any, messages: Sequence[Message], tools: list[dict[str, Any]] | None = None, *,
                  recent: CompletionLookup | None = None, end_ids: frozenset[int] = frozenset(),
                  where: str = "messages", images: ImageTokens | None = None,
                  template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Prompt ids for normalised `messages` with the generation prompt (module docstring: the record); `images`:
    how the messages' images expand (a vision-language model's); `template_kwargs`: the template's other
    variables (a remembered completion is reused only where it fits the text they render)."""
    text = render_text(tokenizer, messages, tools, add_generation_prompt=True, where=where, images=images,
                       template_kwargs=template_kwargs)
    candidates = {}
    if recent is not None and len(recent):
        candidates = {i: got for i, m in enumerate(messages) if m.get("role") == "assistant" and (got := recent.get(m))}
    if not candidates:
        return encode(tokenizer, text)
    end_text = {e: tokenizer.decode([e], skip_special_tokens=False) for e in end_ids}

    def attempt(indices: list[int]) -> tuple[list[str], Fits] | None:
        markers = {i: turn_marker(i, messages[i].get("content")) for i in indices}
        ph = [({"role": "assistant", "content": markers[i]} if i in indices else m) for i, m in enumerate(messages)]
        try:
            ph_text = render_text(tokenizer, ph, tools, add_generation_prompt=True, where=where, images=images,
                                  template_kwargs=template_kwargs)
        except TrajectoryError:
            return None
        pieces = split_at_placeholders(ph_text, indices, [markers[i] for i in indices])
        if pieces is None:
            return None
        fits = _fitting(text, pieces, [candidates[i] for i in indices], end_text)
        return (pieces, fits) if fits is not None else None

    # All at once; then without the turns the template rewrote (the first walk names them); then,
    # if a template renders a turn differently when another one is a placeholder, one at a time.
    order = sorted(candidates)
    found = attempt(order)
    if found is not None and None in found[1]:
        order = [i for i, fit in zip(order, found[1]) if fit is not None]
        found = attempt(order) if order else None
    if found is None or None in found[1]:
        order = [i for i in sorted(candidates) if (one := attempt([i])) is not None and None not in one[1]]
        found = attempt(order) if order else None
    if found is None or None in found[1]:
        return encode(tokenizer, text)
    pieces, fits = found
    ids = encode(tokenizer, pieces[0])
    skip = 0
    for k, options in enumerate(fits):
        assert options is not None
        if k:
            ids += encode(tokenizer, pieces[k][skip:])
        here = hash(tuple(ids))
        entry, skip = next(((e, s) for e, s in options if e.prompt_hash == here), options[0])
        ids += entry.token_ids
    return ids + encode(tokenizer, pieces[-1][skip:])


# --------------------------------------------------------------------------- end of turn and stops


def end_of_turn_ids(tokenizer: Any, model: Any = None) -> frozenset[int]:
    """Ids that end an assistant turn: eos, the model's generation-config eos ids, known chat end tokens.

    `model` is a transformers model, or its GenerationConfig, or None. The inference engine
    stops sampling on these ids and the trainer closes a turn on them.
    """
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config = getattr(model, "generation_config", model)
    extra = getattr(config, "eos_token_id", None)
    if isinstance(extra, int):
        ids.add(extra)
    elif extra is not None:
        ids.update(int(t) for t in extra)
    vocab = tokenizer.get_vocab()
    ids.update(int(vocab[tok]) for tok in KNOWN_END_TOKENS if tok in vocab)
    return frozenset(ids)


def completion_text(tokenizer: Any, token_ids: Sequence[int], end_ids: frozenset[int]) -> tuple[str, int | None]:
    """(text of the sampled ids without a final end-of-turn id, that id or None)."""
    end = token_ids[-1] if token_ids and token_ids[-1] in end_ids else None
    body = token_ids[:-1] if end is not None else token_ids
    return tokenizer.decode(list(body), skip_special_tokens=False), end


def cut_at_stop(tokenizer: Any, token_ids: Sequence[int], text: str, stops: Sequence[str]) -> tuple[str, int] | None:
    """(text before the first stop string, ids to keep through the token that completed it), or None."""
    hits = [text.find(s) for s in stops if s and s in text]
    if not hits:
        return None
    ids = list(token_ids)

    def contains_stop(k: int) -> bool:  # monotone in k: once a prefix holds a stop string, longer ones do
        return any(s and s in tokenizer.decode(ids[:k], skip_special_tokens=False) for s in stops)

    keep = bisect_left(range(1, len(ids) + 1), True, key=contains_stop) + 1
    return text[: min(hits)], keep
