"""Run a function in N gloo CPU processes, for tests.

``run(world_size, fn, *args, timeout=...)`` starts ``world_size`` fresh processes (the
``spawn`` start method), each with its own process group (gloo, ``MASTER_ADDR=127.0.0.1``,
a free port, ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` set, one torch thread), calls
``fn(rank, world_size, *args)`` in each and returns the list of what each returned (in rank
order; return values must pickle). ``fn`` must be a module-level function of an importable
module (a test module is: the children get the parent's ``sys.path``).

When a process raises, exits without reporting or outlives ``timeout`` seconds, every
process still running is killed and :class:`DistError` is raised with the failing ranks'
tracebacks. ``init=False`` starts the processes without a process group.
"""

import multiprocessing as _mp
import os
import queue as _queue
import socket
import time
import traceback
from typing import Any, Callable, List

__all__ = ["run", "free_port", "DistError"]


class DistError(AssertionError):
    """A process of :func:`run` failed, or did not finish in time."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world_size: int, port: int, init: bool, results: Any, fn: Callable, args: tuple) -> None:
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            OMP_NUM_THREADS="1",
            GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        )
        import warnings

        warnings.filterwarnings("ignore")
        import torch

        torch.set_num_threads(1)
        if init:
            import torch.distributed as dist

            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            out = fn(rank, world_size, *args)
        finally:
            if init:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run(world_size: int, fn: Callable, *args: Any, timeout: float = 120.0, init: bool = True) -> List[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; return their
    results in rank order, or raise :class:`DistError` with the failing ranks' tracebacks."""
    ctx = _mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world_size, port, init, results, fn, args), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    got: dict = {}
    failures: dict = {}
    try:
        while len(got) + len(failures) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(got) - set(failures))
                failures.update({r: f"rank {r}: no result after {timeout:.0f} s" for r in missing})
                break
            try:
                rank, ok, out = results.get(timeout=min(left, 1.0))
            except _queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode is not None and r not in got and r not in failures]
                if dead:
                    # a process that exited without reporting (killed, os._exit): give the
                    # queue a moment in case its report is still in flight
                    try:
                        rank, ok, out = results.get(timeout=2.0)
                    except _queue.Empty:
                        for r in dead:
                            failures[r] = f"rank {r}: exited with code {procs[r].exitcode} without a result"
                        continue
                else:
                    continue
            if ok:
                got[rank] = out
            else:
                failures[rank] = out
                # one failed rank usually leaves the others blocked in a collective
                deadline = min(deadline, time.monotonic() + 10.0)
    finally:
        for p in procs:
            p.join(timeout=5.0 if not failures else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        results.close()
    if failures:
        text = "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures))
        raise DistError(f"{len(failures)} of {world_size} process(es) failed:\n{text}")
    return [got[r] for r in range(world_size)]
