"""Shared fixtures: one tiny model cache per test session, nothing downloaded."""

from __future__ import annotations

import os
import pathlib

import pytest

# Every test session builds (once) its own tiny model under a temporary cache,
# unless the caller points ARTRL_CACHE_DIR somewhere on purpose.
# litellm (RULER's judge client when installed) fetches its price map from the network at import unless told
# to use the one it ships; tests download nothing.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

if "ARTRL_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["ARTRL_CACHE_DIR"] = tempfile.mkdtemp(prefix="artrl-test-cache-")


@pytest.fixture(scope="session")
def tiny_path() -> pathlib.Path:
    from artrl.tiny import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="session")
def tok(tiny_path: pathlib.Path):
    from artrl.train.modeling import load_tokenizer

    return load_tokenizer(str(tiny_path))


@pytest.fixture(scope="session")
def make_choice(tok):
    """Build an OpenAI Choice as our server returns it: sampled token ids + aligned logprobs."""
    import random

    from openai.types.chat.chat_completion import Choice

    rng = random.Random(1234)

    def make(text: str, *, end: bool = True, logprobs: bool = True, token_ids: bool = True,
             tool_calls: list | None = None) -> Choice:
        ids = tok(text + ("<|im_end|>" if end else ""), add_special_tokens=False).input_ids
        data = {
            "index": 0,
            "finish_reason": "stop" if end else "length",
            "message": {"role": "assistant", "content": text, "tool_calls": tool_calls},
            "logprobs": {"content": [{"token": tok.decode([i]), "logprob": -rng.uniform(0.01, 4.0), "bytes": None,
                                      "top_logprobs": []} for i in ids]} if logprobs else None,
        }
        if token_ids:
            data["token_ids"] = ids
        return Choice.model_validate(data)

    return make
