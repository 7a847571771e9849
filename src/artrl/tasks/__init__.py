"""Small synthetic tasks that the tiny model can learn on a laptop CPU in minutes.

Each task module ships its scenarios (with a held-out validation split), a reward
function, a rollout that talks to the served model through the real `openai`
client, and SFT examples for a warm-up. `artrl demo` and `examples/` use them.
"""

from . import colours

__all__ = ["colours"]
