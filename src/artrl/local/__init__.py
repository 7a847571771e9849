"""Training and serving on this machine: LocalBackend and the training sessions behind it.

    backend.py         LocalBackend: ART's backend API, the inference server, one session per model
    session.py         TrainingSession: the weights, trainer, engine, step and checkpoints of one model
    worker_session.py  WorkerSession: the same session with its train calls run on training workers
    plot_tensors.py    TrainConfig.plot_tensors: the packed tensors of a call as images

The run directory (storage, checkpoints, history, trackers) is artrl/run/'s; `artrl serve` (the server alone) is
commands/serve.py.
"""

from .backend import LocalBackend

__all__ = ["LocalBackend"]
