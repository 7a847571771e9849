"""What a base model is: one home that the trainer, the engines and the benchmarks ask.

    tiny.py          the built-in models ("artrl/tiny", "artrl/bench-100m"), built offline once; tiny_vl.py
                     the built-in vision-language model ("artrl/tiny-vl")
    tokenizer.py     loading a model's tokenizer (ART's get_tokenizer; the server's and the trainer's)
    adapter_switch.py  which LoRA adapter a model runs with (the trainer's and the engines' switch)

    source.py        where a model comes from (built-in, random shape, local directory, hub id), checked in seconds
    shapes.py        the random-init shapes ("random:qwen3-0.6b" ... "random:qwen3-32b") and their configs
    quantization.py  4-bit / 8-bit base weights through bitsandbytes (ART's load_in_4bit / load_in_8bit)
    random_init.py   building a random shape one tensor at a time (a 4-bit build never holds full precision)
    resolved.py      what a base model is, decided once per process: its source, files, config, device,
                     precision (ResolvedBaseModel), read by the loader, the session and the engines
    loading.py       loading a base model and its LoRA adapter (the one place that loads a model)
    memory_plan.py   the memory a model will take, planned before it loads
    structure.py     the parts of a model artrl walks (decoder layers)

`import artrl` imports `quantization.quiet_kernels_notice` and tokenizer.py (no torch at import) and nothing
else here. Imports config, chat, errors and runtime; never trajectories, preprocess, train or serve.
"""
