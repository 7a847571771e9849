"""OpenAI-compatible inference: engines that sample tokens, and the HTTP server around them.

    engine.py               the engine contract: GenerationRequest (and its one check), GenerationResult,
                            InferenceEngine
    factory.py              resolve_engine_kind / open_engine: which engine serves ("auto", "builtin", "vllm")
    transformers_engine.py  TransformersEngine, the built-in (CPU or GPU) engine
    vllm_engine.py          VLLMEngine over vLLM's AsyncLLM (imported by the factory only when asked for)
    vllm_args.py            vLLM's engine arguments from a model config and ART's engine_args (no vLLM import)
    sampling.py             per-row temperature / top-p / seeded sampling, grammar masks on logits
    structured.py           response_format / tool_choice -> grammars (llguidance); vLLM's keywords
    scripted.py             ScriptedEngine: returns the completion it is told to (tests, record benchmarks)
    chat.py                 request messages -> prompt ids (chat_format rules), the record cache
    tool_calls.py           <tool_call> blocks -> OpenAI tool_calls; the syntax grammars write
    models.py               ServedModels: "name" and "name@step" -> (engine, adapter)
    server.py               create_app: the FastAPI app
    background.py           start_server / ServerHandle: uvicorn in a thread
"""

from artrl.serve.background import ServerHandle, start_server
from artrl.serve.engine import GenerationRequest, GenerationResult, InferenceEngine, InvalidRequestError
from artrl.serve.factory import open_engine, resolve_engine_kind
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
    "open_engine",
    "parse_tool_calls",
    "resolve_engine_kind",
    "start_server",
]
