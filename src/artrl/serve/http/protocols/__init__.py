"""The wire protocols the server speaks, one module each, every one a thin adapter over the request core
(serve/http/core.py): `chat_completions` (OpenAI Chat Completions), `messages` (Anthropic Messages), `responses`
(OpenAI Responses), `completions` (OpenAI's legacy Completions). Each turns its body into the core's canonical
request and the core's choice, with its token record, into its own response and stream events
(docs/token-record.md, *Other wire protocols*); `common` holds what they share. A new protocol is a module here
with `add_route(app, core)`, listed in server.py's PROTOCOLS."""
