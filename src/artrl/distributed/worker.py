"""A training worker: one rank of the data-parallel group, started by torchrun.

The driver (LocalBackend) starts this machine's workers itself; on other
machines, the same module joins through torchrun (docs/distributed.md):

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        --rdzv-id ID --rdzv-conf is_host=false -m artrl.distributed.worker --control HOST:PORT --run-dir DIR

(the driver logs this command with the generation's rendezvous id, e.g. `project-name-g1`).

A worker: reads the run's base model and settings from the run directory,
initialises the process group (NCCL on a GPU, gloo on the CPU, with the
configured collective timeout), loads the model with the latest complete
checkpoint's adapter, shards it (sharding.py), restores the optimizer state,
and says it is ready. Then, for each call the driver posts (protocol.py):
read the call the driver prepared (every rank gets the same rows and plan;
none tokenizes or packs again), run it, report the figures (rank 0), and on
the driver's word gather the state and write the checkpoint (rank 0). A call
whose payload cannot be read (before any collective) is reported and the group
waits for the next one; any other error ends this process, which ends the
group, and torchrun reports the rank, its exit code or signal, and the error.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ..errors import ArtrlError, CheckpointError, ConfigError
from ..run import storage
from ..config.model import InternalModelConfig
from . import checkpoint, protocol

log = logging.getLogger("artrl.distributed.worker")


def _device(cfg: InternalModelConfig, local_rank: int) -> torch.device:
    want_cuda = cfg.trainer_gpu_ids is not None or (cfg.device or "").startswith("cuda") or \
        (cfg.device is None and torch.cuda.is_available())
    if not want_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("the training workers were asked to use CUDA devices, but this machine has none; set "
                          "device='cpu' (gloo) or run the workers where GPUs are.")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(f"worker local_rank {local_rank} has no GPU: {torch.cuda.device_count()} visible. Start "
                          "at most one worker per GPU (torchrun --nproc-per-node).")
    return torch.device("cuda", local_rank)


class Worker:
    """One rank: its model, sharded trainer, and place in the control store."""

    def __init__(self, run_dir: Path, control: dist.Store, generation: int) -> None:
        self.run = run_dir
        self.rank = int(os.environ["RANK"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.store = protocol.generation_store(control, generation)
        meta = json.loads((run_dir / storage.MODEL_FILE).read_text())
        self.base_model: str = meta["base_model"]
        cfg = InternalModelConfig(**meta["config"])
        self.device = _device(cfg, self.local_rank)
        self.cfg = cfg.model_copy(update={"device": str(self.device)})
        self.trainer: Any = None
        self.step = 0

    def start(self) -> None:
        from ..run import checkpoint as local_checkpoint
        from ..models.loading import load_model
        from ..models.resolved import resolve_base_model
        from ..train.trainer import Trainer
        from .sharding import ShardedTrainer

        # before the process group exists: transformers writes nothing on ranks > 0 once it does, so a first
        # build of the tiny model must happen here; a cached hub model whose hub does not answer loads from its
        # cached directory (models/source.py); resolved once for this worker (models/resolved.py)
        resolved = resolve_base_model(self.base_model, self.cfg)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=self.cfg.collective_timeout_s),
                                device_id=self.device if self.device.type == "cuda" else None)
        latest = storage.latest_checkpoint(self.run)
        if latest is None:
            raise CheckpointError(f"{self.run} has no complete checkpoint; the driver writes checkpoint 0 before it "
                                  "starts the workers. Is --run-dir the run directory of a registered model?")
        model, tok = load_model(resolved)
        plain = Trainer(model, tok, self.cfg)
        restored = local_checkpoint.restore(plain, self.run, latest, self.base_model)
        plain.optimizer_steps = restored.optimizer_steps
        self.trainer = ShardedTrainer.from_trainer(plain, str(storage.checkpoint_dir(self.run, latest)))
        self.step = latest
        protocol.put(self.store, protocol.READY.format(rank=self.rank), {
            "rank": self.rank, "world_size": dist.get_world_size(), "pid": os.getpid(),
            "host": socket.gethostname(), "device": str(self.device), "step": latest})
        log.info("rank %d of %d ready on %s at checkpoint %d", self.rank, dist.get_world_size(), self.device, latest)

    def serve(self) -> None:
        n = 0
        while True:
            key = protocol.wait_any(self.store, [protocol.CALL.format(n=n), protocol.STOP])
            if key == protocol.STOP:
                return
            self.call(n, protocol.get(self.store, key))
            n += 1

    def call(self, n: int, msg: dict[str, Any]) -> None:
        from ..run import checkpoint as local_checkpoint
        from ..train.call import run_call

        error: BaseException | None = None
        try:
            with open(msg["payload"], "rb") as fh:
                payload = pickle.load(fh)  # written by the driver of this run for this call
            prepared = payload["call"]  # tokenized, packed and planned once, by the driver
        except (ArtrlError, OSError, ValueError, EOFError, pickle.UnpicklingError) as e:
            error = e
        # every rank learns whether any rank refused the call, so all of them skip it together
        flag = torch.tensor([0.0 if error is None else 1.0], device=self._collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if float(flag) > 0:
            if error is not None:
                protocol.put(self.store, protocol.ERROR.format(n=n, rank=self.rank),
                             {"type": type(error).__name__, "message": str(error)})
            return
        self.trainer.reset_balance()
        steps, summary = run_call(self.trainer, prepared, show_progress=self.rank == 0 and payload["progress"],
                                  desc=payload["desc"])
        summary.update(self._balance_figures())
        if self.rank == 0:
            protocol.put(self.store, protocol.TRAINED.format(n=n),
                         {"steps": steps, "summary": summary, "optimizer_steps": self.trainer.optimizer_steps})
        commit = protocol.get(self.store, protocol.wait_any(self.store, [protocol.COMMIT.format(n=n)]))
        if not commit["write"]:
            return
        adapter, optimizer, optimizer_name = checkpoint.gather(self.trainer)
        if self.rank == 0:
            path = local_checkpoint.save(self.trainer, self.run, commit["step"], self.base_model, commit["record"],
                                         adapter_state=adapter, optimizer_state=optimizer,
                                         optimizer_name=optimizer_name)
            protocol.put(self.store, protocol.DONE.format(n=n), {"path": str(path)})
        self.step = commit["step"]

    def _balance_figures(self) -> dict[str, float]:
        tokens = self.trainer.rank_tokens
        mean = sum(tokens) / len(tokens) if tokens else 0.0
        out = {"workers": float(len(tokens)),
               "computed_tokens_imbalance": max(tokens) / mean - 1.0 if mean > 0 else 0.0,
               "padding_passes": float(sum(self.trainer.rank_padding))}
        out.update({f"computed_tokens_rank{k}": float(t) for k, t in enumerate(tokens)})
        return out

    def _collective_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")


@record
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m artrl.distributed.worker", description=__doc__.split("\n")[0])
    p.add_argument("--control", required=True, help="HOST:PORT of the driver's store (the rendezvous endpoint)")
    p.add_argument("--run-dir", required=True, help="the model's run directory (the same path on every machine)")
    args = p.parse_args(argv)
    rank = os.environ.get("RANK", "?")
    # rank 0 tells what the group does; the others only warn; the driver logs each call's summary line
    logging.basicConfig(level=logging.INFO if rank == "0" else logging.WARNING,
                        format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s")
    logging.getLogger("artrl.train.call").setLevel(logging.WARNING)
    host, port = protocol.parse_endpoint(args.control)
    control = dist.TCPStore(host, port, is_master=False, timeout=protocol.STORE_TIMEOUT)
    generation = int(control.get(protocol.GENERATION).decode())
    worker = Worker(Path(args.run_dir), control, generation)
    worker.start()
    try:
        worker.serve()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
