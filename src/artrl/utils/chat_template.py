"""ART's `art.utils.chat_template`: the chat-template edit that keeps earlier turns' reasoning.

`configure_preserved_thinking_chat_template(tokenizer)` and `chat_template_with_preserved_thinking(template)`
are artrl's own (`artrl.chat.preserved_thinking`, which says what they edit and what they leave to ART).
"""

from __future__ import annotations

from ..chat.preserved_thinking import chat_template_with_preserved_thinking, configure_preserved_thinking_chat_template

__all__ = ["chat_template_with_preserved_thinking", "configure_preserved_thinking_chat_template"]
