"""`generate_scenarios`: an OpenAI-compatible model writes task scenarios for an MCP server's tools.

ART's function, same parameters and defaults (OpenRouter's `openai/gpt-4.1-mini`, key from
`OPENROUTER_API_KEY`): the model is shown the tools and resources and asked for
`num_scenarios` tasks, each with a difficulty from 1 to 5, under a JSON-schema
`response_format` that fixes the count. On artrl's own server that schema is enforced by a
grammar (docs/art-compatibility.md, `response_format`), so even the tiny model answers
valid JSON: point `generator_base_url` / `generator_model` / `generator_api_key` at
`model.inference_base_url` / `model.get_inference_name()` / `model.inference_api_key`.

Beyond ART: `max_task_chars` adds a `maxLength` to each task (a small model under a grammar
otherwise writes until `max_tokens` cuts the JSON), `max_tokens` (ART's 8000) and
`temperature`; the call is async (ART's blocks the event loop with a sync client).
A reply that is not valid JSON, or has the wrong count, is a `ValueError` quoting it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from .types import MAX_DIFFICULTY, MIN_DIFFICULTY, GeneratedScenarioCollection, MCPResource, MCPTool

log = logging.getLogger(__name__)

DEFAULT_GENERATOR_MODEL = "openai/gpt-4.1-mini"
DEFAULT_GENERATOR_BASE_URL = "https://openrouter.ai/api/v1"
API_KEY_ENV = "OPENROUTER_API_KEY"


def scenario_schema(num_scenarios: int, max_task_chars: int | None = None) -> dict[str, Any]:
    """The JSON schema of the reply: `{"scenarios": [{"task": str, "difficulty": 1..5}] * num_scenarios}`."""
    task: dict[str, Any] = {"type": "string"}
    if max_task_chars is not None:
        task["maxLength"] = max_task_chars
    return {
        "type": "object",
        "properties": {"scenarios": {
            "type": "array",
            "items": {"type": "object",
                      "properties": {"task": task, "difficulty": {"type": "integer", "minimum": MIN_DIFFICULTY,
                                                                  "maximum": MAX_DIFFICULTY}},
                      "required": ["task", "difficulty"], "additionalProperties": False},
            "minItems": num_scenarios, "maxItems": num_scenarios}},
        "required": ["scenarios"],
        "additionalProperties": False,
    }


def scenario_prompt(tools: list[dict[str, Any]], resources: list[dict[str, Any]], num_scenarios: int,
                    custom_instructions: str | None = None) -> str:
    """The instruction the generator model gets."""
    prompt = (
        "You write test scenarios for an AI agent that works through the tools of an MCP (Model Context "
        f"Protocol) server.\n\nTOOLS:\n{json.dumps(tools, indent=2)}\n\nRESOURCES:\n"
        f"{json.dumps(resources, indent=2) if resources else 'none'}\n\n"
        f"Write {num_scenarios} different tasks a real user could ask this agent to do with these tools. Vary "
        "them: some need one tool call, some several; cover different tools and combinations, without naming "
        "the tools to use. Rate each from 1 (one easy call) to 5 (a long multi-step analysis). Every task asks "
        "the agent to finish with a summary of what it did and what it found.\n\n"
        f'Answer with a JSON object {{"scenarios": [...]}} holding exactly {num_scenarios} objects, each '
        'with "task" (a string) and "difficulty" (an integer from 1 to 5).')
    if custom_instructions:
        prompt += f"\n\nFollow these instructions too:\n\n{custom_instructions}"
    return prompt


def _as_dicts(items: list[Any], kind: type) -> list[dict[str, Any]]:
    out = []
    for item in items or []:
        if isinstance(item, kind):
            out.append(item.to_dict())
        elif isinstance(item, dict):
            out.append(item if kind is MCPResource else
                       {k: item.get(k, d) for k, d in (("name", ""), ("description", ""), ("parameters", {}))})
        else:
            out.append(kind.from_dict({k: getattr(item, k, None) for k in ("name", "description", "parameters",
                                                                           "uri", "mime_type")}).to_dict())
    return out


async def generate_scenarios(
    tools: list[MCPTool] | list[dict[str, Any]],
    resources: list[MCPResource] | list[dict[str, Any]] | None = None,
    num_scenarios: int = 24,
    show_preview: bool = True,
    custom_instructions: str | None = None,
    generator_model: str = DEFAULT_GENERATOR_MODEL,
    generator_api_key: str | None = None,
    generator_base_url: str = DEFAULT_GENERATOR_BASE_URL,
    *,
    max_task_chars: int | None = None,
    max_tokens: int = 8000,
    temperature: float | None = None,
) -> GeneratedScenarioCollection:
    """`num_scenarios` task scenarios for `tools` (and `resources`), written by `generator_model`."""
    from openai import AsyncOpenAI

    if generator_api_key is None:
        generator_api_key = os.getenv(API_KEY_ENV)
        if not generator_api_key:
            raise ValueError(f"generator_api_key is required or {API_KEY_ENV} env var must be set "
                             f"(generator_base_url={generator_base_url!r})")
    if not tools and not resources:
        raise ValueError("At least one tool or resource must be provided")
    tools_info, resources_info = _as_dicts(list(tools), MCPTool), _as_dicts(list(resources or []), MCPResource)
    log.info("Generating %d scenarios with %s for %d tool(s), %d resource(s)", num_scenarios, generator_model,
             len(tools_info), len(resources_info))

    t0 = time.perf_counter()
    request: dict[str, Any] = dict(
        model=generator_model,
        messages=[{"role": "user", "content": scenario_prompt(tools_info, resources_info, num_scenarios,
                                                              custom_instructions)}],
        max_completion_tokens=max_tokens,
        response_format={"type": "json_schema", "json_schema": {
            "name": "scenario_list", "schema": scenario_schema(num_scenarios, max_task_chars)}},
    )
    if temperature is not None:
        request["temperature"] = temperature
    async with AsyncOpenAI(api_key=generator_api_key, base_url=generator_base_url) as client:
        response = await client.chat.completions.create(**request)
    content = response.choices[0].message.content
    if content is None:
        raise ValueError(f"{generator_model} returned no content (finish_reason="
                         f"{response.choices[0].finish_reason!r})")
    try:
        collection = GeneratedScenarioCollection.from_json(content)
    except (ValueError, KeyError, TypeError, StopIteration) as e:
        raise ValueError(f"{generator_model}'s reply is not a valid scenario list (finish_reason="
                         f"{response.choices[0].finish_reason!r}; max_tokens={max_tokens}): {e}; the reply begins "
                         f"{content[:500]!r}") from e
    if len(collection) != num_scenarios:
        raise ValueError(f"Expected {num_scenarios} scenarios, got {len(collection)}")
    collection.print_difficulty_distribution()
    if show_preview:
        collection.preview(n=min(5, num_scenarios))
    log.info("Generated %d scenarios in %.2fs", len(collection), time.perf_counter() - t0)
    return collection
