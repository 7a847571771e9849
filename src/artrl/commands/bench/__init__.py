"""`artrl bench ...`: what a user measures on their own setup, one JSON line each.

    memory.py         does my model fit? the memory plan beside the measured peak of one LoRA RL call
    serve.py          inference throughput, concurrent requests against one at a time (either engine)
    train.py          one train call on a workload file, our batching against the reference one-row-per-step
                      trainer (train_profile.py: its --profile; workers.py: --workers N; flops.py: MFU)
    pack.py           packing against the reference layout on a workload file (workload.py reads the file)

The development benchmarks (learning per rollout, the pipeline, replicas) live in the repository's
benchmarks/harness/, run as `python benchmarks/bench.py ...`.
"""
