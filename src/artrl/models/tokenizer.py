"""Loading a model's tokenizer: `get_tokenizer` as ART 0.5.23 loads it (`art.get_tokenizer`, whose path
`artrl.tokenizer` re-exports it), and `load_tokenizer`, the one the server and the trainer share.

A base model name is one artrl knows (a built-in such as "artrl/tiny", a random shape, which borrows the
tiny tokenizer, a local directory or a Hugging Face id; models/source.py resolves it) and the tokenizer
comes from `transformers.AutoTokenizer.from_pretrained`, with `revision` and every other keyword passed on.
As in ART, `trust_remote_code` defaults to True for a local directory or when the environment variable
HF_TRUST_REMOTE_CODE is 1/true/yes, and to False otherwise; a keyword given by the caller wins.

As in ART, the chat template is edited to keep earlier assistant turns' reasoning (chat/preserved_thinking.py: Qwen3's
hybrid templates, Gemma 4, gpt-oss, MiniMax, Kimi K2.5 and GLM, and templates with a `preserve_thinking` /
`clear_thinking` switch), the same edit the server and the trainer load their tokenizer with. What ART adds and
this does not (docs/art-compatibility.md): DeepSeek V4's chat encoder, the fallback to a public Llama 3 tokenizer
when Meta's gated repository cannot be read, and the model-specific loaders of Kimi K2, DeepSeek V4,
Inkling and tinker-registered tokenizers. A tokenizer is not cached: each call loads a new one.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..chat.preserved_thinking import configure_preserved_thinking_chat_template
from ..config.model import InternalModelConfig
from ..errors import ConfigError
from .source import resolve_name

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TRUST_REMOTE_CODE_ENV = "HF_TRUST_REMOTE_CODE"


def get_tokenizer(base_model: str, *, revision: str | None = None, **kwargs: Any) -> "PreTrainedTokenizerBase":
    """Load `base_model`'s tokenizer (`revision` and `kwargs` go to `AutoTokenizer.from_pretrained`).

    Raises ConfigError naming the model when it cannot be found or read."""
    from transformers import AutoTokenizer

    path = resolve_name(base_model)
    kwargs.setdefault("trust_remote_code", os.path.isdir(path)
                      or os.environ.get(TRUST_REMOTE_CODE_ENV, "").lower() in ("1", "true", "yes"))
    if revision is not None:
        kwargs["revision"] = revision
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:  # no such repository or files; a directory without a tokenizer
        raise ConfigError(f"get_tokenizer({base_model!r}): could not load its tokenizer from {path!r}: {e}") from e
    return configure_preserved_thinking_chat_template(tokenizer)


def load_tokenizer(base_model: str, cfg: InternalModelConfig | None = None, *, path: str | None = None) -> Any:
    """The tokenizer the server and the trainer share, its chat template set to keep earlier turns' reasoning
    (chat/preserved_thinking.py). `path`: where `base_model`'s files are, when the caller resolved it already
    (models/resolved.py)."""
    from transformers import AutoTokenizer

    cfg = cfg or InternalModelConfig()
    path = path or resolve_name(base_model)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except OSError as e:
        raise ConfigError(f"could not load the tokenizer of {base_model!r} ({path}): {e}") from None
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"the tokenizer of {base_model!r} has no chat template; artrl renders trajectories "
                          "with it. Use an instruct/chat model or set tokenizer.chat_template.")
    configure_preserved_thinking_chat_template(tok)  # earlier turns keep their reasoning, as in ART
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
