"""Recording a rollout's requests to a model into the open trajectory, as ART 0.5.23's `_capture` package does:
core.py holds the scopes and what is done with a response's bytes; clients.py wraps the HTTP clients a rollout
uses (httpx, aiohttp, requests) to feed it. Imports exchanges.py only."""
