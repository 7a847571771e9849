"""What a base model is: one home that the trainer, the engines and the benchmarks ask.

    source.py        where a model comes from (built-in, random shape, local directory, hub id), checked in seconds
    shapes.py        the random-init shapes ("random:qwen3-0.6b" ... "random:qwen3-32b") and their configs
    quantization.py  4-bit / 8-bit base weights through bitsandbytes (ART's load_in_4bit / load_in_8bit)
    random_init.py   building a random shape one tensor at a time (a 4-bit build never holds full precision)
    loading.py       loading a base model and its LoRA adapter (the one place that loads a model)
    memory_plan.py   the memory a model will take, planned before it loads
    structure.py     the parts of a model artrl walks (decoder layers)

Nothing here is imported by `import artrl` but `quantization.quiet_kernels_notice` (no torch).
"""
