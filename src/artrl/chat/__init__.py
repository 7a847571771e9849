"""The chat format: messages and roles, tool calls, rendering with the tokenizer's template, end-of-turn ids
(format.py), images in messages (images.py) and a conversation's images as the model reads them (media.py),
earlier turns' reasoning kept in the template (preserved_thinking.py), streamed reply chunks (chunks.py).

Imports errors, types and runtime only: the data model, the tokenizer path, the trainer and the server all
read it.
"""
