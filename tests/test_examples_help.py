"""The examples' --help is their whole docstring: what to run first, and what a step that trains nothing does."""

from __future__ import annotations

import pathlib
import runpy
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("script, says", [
    ("rl_loop.py", ["Run examples/sft_then_rl.py first", "still advances, with the same weights"]),
    ("sft_then_rl.py", ["SFT warm-up, then RL", "skips the warm-up"]),
    ("image_colour_quiz.py", ["An agent that sees", "image_url", "offline, on a CPU"]),
])
def test_help_shows_the_docstring(script, says, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    assert done.value.code == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    for text in says:
        assert text in flat, out
    assert "do not advance" not in flat
