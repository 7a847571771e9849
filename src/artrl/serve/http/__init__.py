"""The HTTP layer of the inference server: OpenAI-compatible routes over any engine.

    server.py          create_app: the FastAPI app (health, metrics, models, each protocol's route)
    core.py            the request core every protocol adapts to: prepare, complete, stream
    protocols/         one module per wire protocol (chat_completions, completions, responses, messages)
    request.py         the canonical request (Chat Completions' fields) and its limits
    prompts.py         request messages -> prompt ids (the chat format's rules), the record cache
    streaming.py       server-sent events; stream_text.py the text a stream releases
    guards.py          API key, body limits and deadlines, error responses, ServerMetrics
    served_models.py   ServedModels: "name" and "name@step" -> (engine, adapter)
    control_routes.py  the replicas' control plane (adapters pushed to a replica); headers.py its header names,
                       shared with the rollout's client (client/affinity.py)
    background.py      start_server / ServerHandle: uvicorn in a thread; h11_protocol.py its HTTP/1.1 protocol

Imports serve/engines/ and serve/'s shared modules; the engines never import this.
"""
