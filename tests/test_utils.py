"""ART's art.utils helpers: retry, limit_concurrency, strip_logprobs, iterate_dataset, get_model_step, ..."""

from __future__ import annotations

import asyncio
import logging
import random

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

import artrl as art
from artrl.run import storage
from artrl.utils import (format_message, get_model_step, iterate_dataset, limit_concurrency, log_http_errors,
                         retry, strip_logprobs)

# --------------------------------------------------------------------------- retry


def test_retry_calls_again_with_backoff_then_succeeds():
    calls, waits = [], []

    @retry(max_attempts=3, delay=0.001, backoff_factor=3.0, on_retry=lambda e, n: waits.append((str(e), n)))
    def flaky(x):
        calls.append(x)
        if len(calls) < 3:
            raise ConnectionError(f"try {len(calls)}")
        return x * 2

    assert flaky(21) == 42 and calls == [21, 21, 21]
    assert waits == [("try 1", 1), ("try 2", 2)]


def test_retry_gives_up_with_the_last_error_and_only_retries_the_named_exceptions(caplog):
    attempts = []

    @retry(max_attempts=2, delay=0, exceptions=(TimeoutError,))
    async def always(kind):
        attempts.append(kind)
        raise kind(f"attempt {len(attempts)}")

    with caplog.at_level(logging.WARNING), pytest.raises(TimeoutError, match="attempt 2"):
        asyncio.run(always(TimeoutError))
    assert "Retry 1/2 for always" in caplog.text
    attempts.clear()
    with pytest.raises(KeyError):
        asyncio.run(always(KeyError))
    assert len(attempts) == 1  # not one of `exceptions`: raised at once


def test_art_retry_is_the_utils_retry():
    assert art.retry is art.utils.retry is retry


# --------------------------------------------------------------------------- limit_concurrency


def test_limit_concurrency_per_key():
    running: dict[str, int] = {}
    peak: dict[str, int] = {}

    @limit_concurrency(2, derive_key=lambda key, i: key)
    async def work(key, i):
        running[key] = running.get(key, 0) + 1
        peak[key] = max(peak.get(key, 0), running[key])
        for _ in range(3):  # give the loop's other ready calls their turn (no timer: load cannot change it)
            await asyncio.sleep(0)
        running[key] -= 1
        return i

    async def main():
        return await asyncio.gather(*(work(k, i) for k in ("a", "b") for i in range(5)))

    assert asyncio.run(main()) == [0, 1, 2, 3, 4] * 2
    assert peak == {"a": 2, "b": 2}


# --------------------------------------------------------------------------- strip_logprobs


def test_strip_logprobs_of_a_trajectory_leaves_the_original_alone(make_choice):
    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}, make_choice("blue")])
    stripped = strip_logprobs(trajectory)
    assert stripped.messages_and_choices[1].logprobs is None
    assert stripped.messages_and_choices[1].message.content == "blue"
    assert trajectory.messages_and_choices[1].logprobs is not None
    assert strip_logprobs([{"logprobs": 1, "x": ({"logprobs": 2, "y": 3},)}]) == [{"x": ({"y": 3},)}]


# --------------------------------------------------------------------------- iterate_dataset


@given(st.integers(0, 23), st.integers(1, 7), st.integers(1, 3), st.integers(0, 12))
def test_iterate_dataset_visits_each_item_once_per_epoch_in_arts_order(size, per_step, epochs, initial_step):
    data = list(range(size))
    state = random.getstate()
    batches = list(iterate_dataset(data, groups_per_step=per_step, num_epochs=epochs, initial_step=initial_step,
                                   use_tqdm=False))
    assert random.getstate() == state  # the global random state is left alone
    steps_per_epoch = -(-size // per_step)
    assert [b.step for b in batches] == list(range(initial_step, steps_per_epoch * epochs)) if size else batches == []
    for epoch in range(epochs):
        order = list(range(size))
        random.seed(epoch)  # how ART shuffles: the same permutation
        random.shuffle(order)
        of_epoch = [b for b in batches if b.epoch == epoch]
        expected = [order[i:i + per_step] for i in range(0, size, per_step)]
        assert [b.items for b in of_epoch] == expected[len(expected) - len(of_epoch):]
        assert [b.epoch_step for b in of_epoch] == list(range(len(expected) - len(of_epoch), len(expected)))
    random.setstate(state)


def test_iterate_dataset_shows_a_progress_bar(capsys):
    assert len(list(iterate_dataset(list(range(5)), groups_per_step=2))) == 3
    assert "Iterating dataset" in capsys.readouterr().err


# --------------------------------------------------------------------------- get_model_step, format_message


def test_get_model_step_reads_the_latest_complete_checkpoint(tmp_path):
    model = art.Model(name="agent", project="proj")
    assert get_model_step(model, str(tmp_path)) == 0
    run = storage.run_dir(tmp_path, "proj", "agent")
    for step in (1, 3):
        storage.write_checkpoint(run, step, lambda d: (d / "x").write_text("w"), {"step": step})
    (run / storage.CHECKPOINTS_DIR / "0007").mkdir()  # a write that never finished
    assert get_model_step(model, str(tmp_path)) == 3


def test_format_message():
    assert format_message({"role": "user", "content": "Hi"}) == "User:\nHi\n"
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}]}
    assert format_message(call) == 'Assistant:\nadd({"a": 1})'


def test_log_http_errors_adds_the_servers_detail():
    def handler(request):
        return httpx.Response(422, json={"detail": "bad field"})

    @log_http_errors
    async def call():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            (await c.post("http://server/x")).raise_for_status()

    with pytest.raises(Exception, match=r"\[HTTP 422\] http://server/x bad field") as info:
        asyncio.run(call())
    assert isinstance(info.value.__cause__, httpx.HTTPStatusError)
