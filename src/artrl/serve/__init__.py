"""OpenAI-compatible inference: engines that sample tokens (engines/), and the HTTP layer around them (http/).

    errors.py        the serving errors both sides share (InvalidRequestError, EngineClosedError)
    structured.py    response_format / tool_choice -> grammars (llguidance); vLLM's keywords
    schema_ends.py   where a JSON schema's values may end (the grammars' stop points)
    tool_calls.py    <tool_call> blocks -> OpenAI tool_calls; the syntax grammars write
    engines/         the engine contract (base.py), the built-in engine, vLLM, sampling, adapter versions
    http/            the FastAPI server: request core, one module per wire protocol (http/protocols/), guards,
                     streaming, the served-model table, the server in a thread

The engines never import http/; both import the four modules above. Nothing here imports train/, local/ or
the model handle.
"""


from .http.background import ServerHandle, start_server
from .engines.base import GenerationRequest, GenerationResult, InferenceEngine
from .errors import InvalidRequestError
from .engines.factory import open_engine, resolve_engine_kind
from .http.served_models import ModelNotFoundError, ServedModels
from .http.server import create_app
from .tool_calls import parse_tool_calls
from .engines.transformers_engine import TransformersEngine

__all__ = [
    "GenerationRequest",
    "GenerationResult",
    "InferenceEngine",
    "InvalidRequestError",
    "ModelNotFoundError",
    "ServedModels",
    "ServerHandle",
    "TransformersEngine",
    "create_app",
    "open_engine",
    "parse_tool_calls",
    "resolve_engine_kind",
    "start_server",
]
