"""`POST /v1/chat/completions`: OpenAI's Chat Completions over the request core, the protocol the core's canonical
request is shaped after (serve/http/request.py: `ChatCompletionRequest`).

The body is parsed here, not by FastAPI: a large body is counted, then parsed off the event loop, as every
protocol's is (protocols/common.py: `read_body`). `stream_options.include_usage` adds a usage chunk to a streamed
reply; the token record rides on each choice (docs/token-record.md). A `tool` message whose `tool_call_id` is
no earlier assistant tool call's id is a 400 naming `messages[i].tool_call_id`.
"""

from __future__ import annotations

import fastapi
from fastapi.responses import JSONResponse, StreamingResponse

from ..core import RequestCore
from ..request import ChatCompletionRequest, check_tool_results, include_usage
from ..streaming import chat_sse
from .common import read_body

PATH = "/v1/chat/completions"


def add_route(app: fastapi.FastAPI, core: RequestCore) -> None:
    """`POST /v1/chat/completions` on `app`."""

    @app.post(PATH)
    async def chat_completions(http: fastapi.Request) -> fastapi.Response:
        return await answer(await read_body(http, ChatCompletionRequest, core, items="messages"), http)

    async def answer(body: ChatCompletionRequest, http: fastapi.Request) -> fastapi.Response:
        check_tool_results(body.messages)  # the other protocols check theirs as they translate them
        prepared = await core.prepare(body)
        if body.stream:
            return StreamingResponse(chat_sse(await core.stream(prepared, http, include_usage(body))),
                                     media_type="text/event-stream")
        return JSONResponse(await core.complete(prepared, http))
