"""`format_message`: a chat message as readable text (ART's), e.g. for logs and judge prompts.

    Assistant:
    Let me look that up.
    search({"q": "weather"})
"""

from __future__ import annotations

from typing import Any


def format_message(message: Any) -> str:
    """'Role:' on the first line, then the content (or refusal), then one line per tool call."""
    role = message["role"].capitalize()
    content = message.get("content", message.get("refusal", "")) or ""
    calls = "\n".join(f"{call['function']['name']}({call['function']['arguments']})"
                      for call in message.get("tool_calls") or [] if "function" in call)
    separator = "\n" if content else ""
    return f"{role}:\n{content}{separator}{calls}"
