"""OpenAI-compatible inference: engines that sample tokens, and the HTTP server around them.

    engine.py               GenerationRequest / GenerationResult / InferenceEngine
    transformers_engine.py  TransformersEngine, the default (CPU or GPU) engine
    sampling.py             per-row temperature / top-p / seeded sampling, grammar masks on logits
    structured.py           response_format / tool_choice -> grammars (llguidance); vLLM's keywords
    chat.py                 request messages -> prompt ids (chat_format rules), the record cache
    tool_calls.py           <tool_call> blocks -> OpenAI tool_calls; the syntax grammars write
    models.py               ServedModels: "name" and "name@step" -> (engine, adapter)
    server.py               create_app: the FastAPI app
    background.py           start_server / ServerHandle: uvicorn in a thread
"""

from artrl.serve.background import ServerHandle, start_server
from artrl.serve.engine import GenerationRequest, GenerationResult, InferenceEngine, InvalidRequestError
from artrl.serve.models import ModelNotFoundError, ServedModels
from artrl.serve.server import create_app
from artrl.serve.tool_calls import parse_tool_calls
from artrl.serve.transformers_engine import TransformersEngine

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
    "parse_tool_calls",
    "start_server",
]
