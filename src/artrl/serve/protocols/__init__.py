"""The wire protocols the server speaks besides OpenAI's Chat Completions, each a thin adapter over the request
core (serve/core.py): `messages` (Anthropic Messages), `responses` (OpenAI Responses), `completions` (OpenAI's
legacy Completions). Each turns its body into the core's canonical request and the core's choice, with its token
record, into its own response and stream events (docs/token-record.md, *Other wire protocols*)."""
