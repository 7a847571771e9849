"""The rollout's side of the wire: what a user's rollout code talks to the model's server through.

    openai.py     the `openai.AsyncOpenAI` clients `Model.openai_client()` hands out (aiohttp for a loopback server)
    affinity.py   one X-Session-ID per rollout, so a router keeps a rollout's turns on one inference replica

It imports the serving package's shared headers (serve/http/headers.py) and nothing above it: model.py,
pipeline_trainer/ and replicas/ import it.
"""
