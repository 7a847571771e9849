"""torchrun, as the driver starts it, plus a report of which rank failed and how.

    python -m artrl.distributed.launch <torchrun arguments> -m artrl.distributed.worker ...

runs `torch.distributed.run` (the torchrun command) with the given arguments.
When a worker fails, torchrun's elastic agent stops the others and raises
`ChildFailedError` with every failed rank's exit code, signal and error
message; this module writes them as JSON to `$ARTRL_FAILURE_FILE` (the
driver's `WorkerGroup` reads it to name the rank) and exits 1. Nothing else
differs from torchrun; machines other than the driver's run torchrun itself.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

FAILURE_FILE_ENV = "ARTRL_FAILURE_FILE"


def _failure(rank: int, f: Any) -> dict[str, Any]:
    message, traceback = f.message, ""
    if isinstance(message, dict):  # an error file written by @record: {"message": ..., "extraInfo": {...}}
        traceback = str(message.get("extraInfo", {}).get("py_callstack", ""))
        message = str(message.get("message", ""))
    sig = ""
    if f.exitcode < 0:
        try:
            sig = signal.Signals(-f.exitcode).name
        except ValueError:
            sig = f"signal {-f.exitcode}"
    return {"rank": rank, "local_rank": f.local_rank, "pid": f.pid, "exitcode": f.exitcode, "signal": sig,
            "message": str(message), "traceback": traceback[-4000:], "timestamp": f.timestamp}


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from ..runtime.fs import fsync_dir

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as e:
        path = os.environ.get(FAILURE_FILE_ENV)
        if path:
            report = {"failures": [_failure(rank, f) for rank, f in sorted(e.failures.items())]}
            tmp = f"{path}.tmp"
            with open(tmp, "w") as fh:
                json.dump(report, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            fsync_dir(os.path.dirname(path) or ".")
        print(f"artrl.distributed.launch: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
