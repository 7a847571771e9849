"""Training on a group of torch.distributed worker processes (docs/distributed.md).

The session that hands calls to the group is local/worker_session.py's `WorkerSession`.

    balance.py     a step's rows split across ranks by computed tokens (pure data)
    sharding.py    FSDP2 wrap of the model and the lock-step train step of one rank
    checkpoint.py  full adapter and optimizer state gathered for, and restored from, a checkpoint
    protocol.py    the store keys and files the driver and the workers exchange
    worker.py      one rank (run by torchrun)
    launch.py      torchrun for the driver's own workers, with a report of the failed rank
    group.py       the driver's side: start the workers, hand them calls, notice when they die
"""
