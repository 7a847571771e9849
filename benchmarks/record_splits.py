"""How much context the token record repeats when a chat template rewrites earlier turns.

A sampled turn is trained on the prompt the server saw; where a later prompt does not extend
the earlier record (the template rewrote an earlier turn), that turn is a sequence of its own
and repeats the context before it (docs/token-record.md). This script plays realistic agent
conversations through the real HTTP server (a scripted engine returns fixed completions) for
the tiny model and for in-process tokenizers with the real chat templates of Qwen2.5, Qwen3,
Llama 3.1/3.2, Mistral v0.3 and Gemma 2/3 (tests/data/chat_templates), tokenizes them as
training does, packs each group with prefix sharing, and prints, per family and conversation
shape: turns, sequences, repeated context tokens, and the packed tokens against the tokens of
the same conversation as one sequence. Counts only (no timing); token counts are those of the
test tokenizers' small vocabulary, so compare ratios, not absolute numbers.

    PYTHONPATH=src python benchmarks/record_splits.py
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

from fastapi.testclient import TestClient
from openai.types.chat.chat_completion import Choice

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from chat_families import FAMILIES, family_tokenizer, generation_config  # noqa: E402

from artrl.chat.format import end_of_turn_ids, message_of  # noqa: E402
from artrl.preprocess.pack import pack  # noqa: E402
from artrl.trajectories.sequences import TokenizeStats, tokenize_history  # noqa: E402
from artrl.serve import ServedModels, create_app  # noqa: E402
from artrl.serve.engines.scripted import ScriptedEngine  # noqa: E402
from artrl.models.tiny import build_tiny_tokenizer  # noqa: E402

SYSTEM = "You are a research assistant. Use the search tool to find facts, then answer in one paragraph. " * 3
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the web.", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]
ANSWER = "The harbour was built in 1862 by the river company, and it was widened twice after the war."
CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "harbour history %d"}}\n</tool_call>'
RESULT = "Result %d: the harbour opened in 1862; widened 1921 and 1958; 14 berths; owned by the city since 1990."
THINK = "<think>\nThe user wants dates. I should check the sources again before answering.\n</think>\n\n"


def play(tok: Any, ends: frozenset[int], turn_end: str, shape: str, tools: bool, think: bool) -> list[Any]:
    """One conversation: 'agent' = tool calls answered by tool results; 'chat' = user follow-ups."""
    engine = ScriptedEngine(tok, ends, max_model_len=1_000_000)
    client = TestClient(create_app(ServedModels("m", engine)))
    history: list[Any] = [{"role": "system", "content": SYSTEM}] if shape != "chat-nosystem" else []
    history.append({"role": "user", "content": "When was the harbour built, and when was it widened?"})
    for k in range(6):
        agent_turn = shape == "agent" and k < 5
        text = (THINK if think else "") + (CALL % k if agent_turn else ANSWER)
        ids = tok(text, add_special_tokens=False).input_ids + [tok.convert_tokens_to_ids(turn_end)]
        engine.next = (ids, [-0.5] * len(ids))
        messages = [m if isinstance(m, dict) else json.loads(json.dumps(message_of(m))) for m in history]
        response = client.post("/v1/chat/completions", json={"model": "m", "messages": messages,
                                                             **({"tools": TOOLS} if tools else {})})
        response.raise_for_status()
        choice = Choice.model_validate(response.json()["choices"][0])
        history.append(choice)
        if agent_turn and choice.message.tool_calls:
            history.append({"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": RESULT % k})
        else:
            history.append({"role": "user", "content": f"Thanks. And what happened in {1900 + 10 * k}?"})
    return history


def measure(name: str, tok: Any, ends: frozenset[int], turn_end: str, shape: str, tools: bool, think: bool) -> str:
    group = []
    for member in range(4):  # a group of four rollouts of one task (they share the system + user prompt)
        history = play(tok, ends, turn_end, shape, tools, think)
        stats = TokenizeStats()
        seqs = tokenize_history(history, TOOLS if tools else None, tok, end_ids=ends, stats=stats)
        for s in seqs:
            s.trajectory_index = member
        group.append((seqs, stats, history))
    seqs, stats, history = group[0]
    last = [m for m in history if isinstance(m, Choice)][-1]
    whole = len(last.model_extra["prompt_token_ids"]) + len(last.model_extra["token_ids"])
    packed = pack([[s for g in group for s in g[0]]], max_length=1_000_000).stats
    one_seq = 4 * whole  # the group's conversations as one sequence each (nothing shared)
    label = f"{name} {shape}" + (" +think" if think else "") + (" +tools" if tools else "")
    return (f"{label:34s} turns {stats.record_turns}  sequences {len(seqs)}  "
            f"repeated context {stats.repeated_context_tokens:5d}"
            f"  one sequence {whole:5d} tokens  packed group {packed.real_tokens:6d} / {one_seq:6d} unshared")


def main() -> None:
    tiny = build_tiny_tokenizer()
    cases: list[tuple[str, Any, frozenset[int], str, str, bool, bool]] = [
        ("tiny", tiny, end_of_turn_ids(tiny), "<|im_end|>", "agent", True, False),
        ("tiny", tiny, end_of_turn_ids(tiny), "<|im_end|>", "chat", False, False),
    ]
    for name, spec in FAMILIES.items():
        tok = family_tokenizer(name)
        ends = end_of_turn_ids(tok, generation_config(name))
        if spec["hermes_tools"]:
            cases.append((name, tok, ends, spec["turn_end"], "agent", True, name == "qwen3"))
        cases.append((name, tok, ends, spec["turn_end"], "chat" if "system" in spec["roles"] else "chat-nosystem",
                      False, name == "qwen3"))
    for case in cases:
        print(measure(*case))


if __name__ == "__main__":
    main()
