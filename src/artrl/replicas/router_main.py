"""`python -m artrl.replicas.router_main ARGS`: vllm-router, ended when the program that started it ends.

vllm-router (the `vllm-router` package: a Rust router with a Python launcher) runs until it is
signalled, and its Rust server holds the interpreter while it runs, so nothing in its own
process can watch for its parent's end. This small process does: it starts the router's
launcher unchanged (`python -m vllm_router.launch_router ARGS`, every argument passed through,
its output this process's), and ends it (SIGTERM, then SIGKILL) as soon as its own stdin, a
pipe held by the program that started it (replicas/router.py), closes: so the router never
outlives that program, however it ended. Its exit status is the router's.
"""

from __future__ import annotations

import subprocess
import sys

from .spawn import on_parent_end

STOP_TIMEOUT_S = 10.0


def main(argv: list[str]) -> int:
    router = subprocess.Popen([sys.executable, "-c", "from vllm_router.launch_router import main; main()", *argv],
                              stdin=subprocess.DEVNULL)

    def stop() -> None:
        router.terminate()
        try:
            router.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            router.kill()

    on_parent_end(stop, "artrl-router-stdin")
    return router.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
