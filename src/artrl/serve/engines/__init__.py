"""The inference engines: what samples tokens for a request, with the token record (ids and logprobs).

    base.py                 the engine contract: GenerationRequest (and its one check), GenerationResult,
                            InferenceEngine
    factory.py              resolve_engine_kind / open_engine: which engine serves ("auto", "builtin", "vllm")
    transformers_engine.py  TransformersEngine, the built-in (CPU or GPU) engine, over decode_loop.py (continuous
                            batching), decode_batch.py / static_batch.py (a batch's steps), sampling.py (per-row
                            temperature / top-p / seeds, grammar masks)
    adapter_versions.py     the LoRA versions an engine holds; merged_lora.py, attention_switch.py their kernels
    vllm_engine.py          VLLMEngine over vLLM's AsyncLLM (imported by the factory only when asked for);
                            vllm_args.py its arguments (no vLLM import), vllm_grammar.py its grammar processor
    scripted.py             ScriptedEngine: returns the completion it is told to (tests, record benchmarks)

A new engine is a module here implementing base.InferenceEngine, chosen in factory.py. Imports serve/'s shared
modules, models/, chat/ and runtime/; never serve/http/.
"""
