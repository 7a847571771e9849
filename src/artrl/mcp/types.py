"""ART's MCP data types: a server's tools and resources, and the task scenarios written for them.

`MCPTool` / `MCPResource` hold what an MCP server lists (name, description, JSON-schema
parameters; uri, name, description, MIME type); `MCPTool.to_tool_schema()` is the OpenAI
tool schema a chat completion takes. `GeneratedScenario` is one task with a difficulty from 1
to 5; `GeneratedScenarioCollection` holds them with ART's helpers (JSON round trip, shuffle,
split, filter, difficulty counts, preview). Same names, fields and behaviour as ART's
`art.mcp.types`; previews and distributions go to `logging` instead of coloured prints.
None of this needs the `mcp` package.
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

MIN_DIFFICULTY, MAX_DIFFICULTY = 1, 5


@dataclass
class MCPTool:
    """A tool an MCP server offers: its name, description and JSON-schema parameters."""

    name: str
    description: str
    parameters: dict[str, Any]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MCPTool:
        return cls(name=data.get("name", ""), description=data.get("description", ""),
                   parameters=data.get("parameters", {}))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    def to_tool_schema(self) -> dict[str, Any]:
        """The OpenAI chat-completions tool schema (`{"type": "function", "function": {...}}`)."""
        return {"type": "function", "function": self.to_dict()}


@dataclass
class MCPResource:
    """A resource an MCP server offers (read with `resources/read`)."""

    uri: str
    name: str
    description: str
    mime_type: str | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MCPResource:
        return cls(uri=data.get("uri", ""), name=data.get("name", ""), description=data.get("description", ""),
                   mime_type=data.get("mimeType") or data.get("mime_type"))

    def to_dict(self) -> dict[str, Any]:
        out = {"uri": self.uri, "name": self.name, "description": self.description}
        if self.mime_type:
            out["mimeType"] = self.mime_type
        return out


@dataclass
class GeneratedScenario:
    """One task for an agent, with a difficulty from 1 (one tool call) to 5 (a long analysis)."""

    task: str
    difficulty: int

    def __post_init__(self) -> None:
        if isinstance(self.difficulty, bool) or not isinstance(self.difficulty, int) or not (
                MIN_DIFFICULTY <= self.difficulty <= MAX_DIFFICULTY):
            raise ValueError(f"Difficulty must be an integer between {MIN_DIFFICULTY} and {MAX_DIFFICULTY}; "
                             f"got {self.difficulty!r} for task {self.task[:80]!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GeneratedScenario:
        return cls(task=data["task"], difficulty=data["difficulty"])

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "difficulty": self.difficulty}

    def preview(self, max_length: int = 120) -> str:
        """The task, cut to `max_length` characters (with an ellipsis) where longer."""
        return self.task if len(self.task) <= max_length else self.task[:max_length].strip() + "…"


class GeneratedScenarioCollection:
    """Scenarios with ART's helpers: JSON round trip, shuffle, split, filter by difficulty, summaries."""

    def __init__(self, scenarios: list[GeneratedScenario]) -> None:
        self.scenarios = scenarios

    @classmethod
    def from_dicts(cls, data: list[dict[str, Any]]) -> GeneratedScenarioCollection:
        return cls([GeneratedScenario.from_dict(item) for item in data])

    @classmethod
    def from_json(cls, json_str: str) -> GeneratedScenarioCollection:
        """From `{"scenarios": [...]}`, a bare list, or an object whose first value is the list (as ART)."""
        data = json.loads(json_str)
        if isinstance(data, dict) and "scenarios" in data:
            items = data["scenarios"]
        else:
            items = data if isinstance(data, list) else next(iter(data.values()))
        return cls.from_dicts(items)

    def to_dicts(self) -> list[dict[str, Any]]:
        return [s.to_dict() for s in self.scenarios]

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps({"scenarios": self.to_dicts()}, indent=indent)

    def __len__(self) -> int:
        return len(self.scenarios)

    def __iter__(self) -> Iterator[GeneratedScenario]:
        return iter(self.scenarios)

    def __getitem__(self, index: Any) -> Any:
        return self.scenarios[index]

    def shuffle(self) -> GeneratedScenarioCollection:
        """A new collection in a random order (the module-level `random`, as ART)."""
        shuffled = list(self.scenarios)
        random.shuffle(shuffled)
        return GeneratedScenarioCollection(shuffled)

    def split(self, train_size: int) -> tuple[GeneratedScenarioCollection, GeneratedScenarioCollection]:
        """The first `train_size` scenarios and the rest."""
        if train_size > len(self.scenarios):
            raise ValueError(f"train_size ({train_size}) cannot be larger than total scenarios "
                             f"({len(self.scenarios)})")
        return (GeneratedScenarioCollection(self.scenarios[:train_size]),
                GeneratedScenarioCollection(self.scenarios[train_size:]))

    def filter_by_difficulty(self, min_difficulty: int = MIN_DIFFICULTY,
                             max_difficulty: int = MAX_DIFFICULTY) -> GeneratedScenarioCollection:
        return GeneratedScenarioCollection([s for s in self.scenarios
                                            if min_difficulty <= s.difficulty <= max_difficulty])

    def get_difficulty_distribution(self) -> Counter[int]:
        return Counter(s.difficulty for s in self.scenarios)

    def preview(self, n: int = 5, max_task_length: int = 120) -> None:
        """Log the first `n` tasks (INFO, logger `artrl.mcp.types`)."""
        for i, s in enumerate(self.scenarios[:n]):
            log.info("   %d. %s  (difficulty %d/5)", i + 1, s.preview(max_task_length), s.difficulty)

    def print_difficulty_distribution(self) -> None:
        """Log how many scenarios each difficulty has (INFO)."""
        counts = self.get_difficulty_distribution()
        log.info("Difficulty distribution: %s",
                 ", ".join(f"{d}/5: {counts.get(d, 0)}" for d in range(MIN_DIFFICULTY, MAX_DIFFICULTY + 1)))

    def get_summary(self) -> dict[str, Any]:
        n = len(self.scenarios)
        return {
            "total_scenarios": n,
            "difficulty_distribution": dict(self.get_difficulty_distribution()),
            "avg_difficulty": sum(s.difficulty for s in self.scenarios) / n if n else 0,
            "avg_task_length": sum(len(s.task) for s in self.scenarios) / n if n else 0,
        }
