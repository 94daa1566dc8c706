"""Run a script under torchrun on this machine, for the fixture generators (scripts/gen_*.py) and
the tests that reuse their workers.

``job(name, script, nproc, argv)`` starts ``python -m torch.distributed.run --nproc-per-node
nproc`` on 127.0.0.1 (a free port, ``OMP_NUM_THREADS=1``, the interpreter's folder first on
``PATH``), waits for it, and on failure prints the end of its output and exits naming the job;
it returns the seconds the job took. ``run`` does the same and returns the exit status and the
output instead. The job runs in a session of its own that is killed once it ends, with its
output in a file, not a pipe: helper processes a job leaves behind (megatron-core's writer
starts some) can neither keep the caller waiting nor outlive it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence, Tuple

__all__ = ["free_port", "run", "job"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(script: Path, nproc: int, argv: Sequence[str], *, python: Optional[Path] = None,
        env: Optional[Mapping[str, Optional[str]]] = None, cwd: Optional[Path] = None,
        timeout: float = 600) -> Tuple[int, str]:
    """Run ``script argv`` in ``nproc`` processes; returns (exit status, output). ``env``: variables
    to set (``None`` removes one) over the caller's."""
    py = Path(python or sys.executable)
    full = dict(os.environ, OMP_NUM_THREADS="1")
    full["PATH"] = f"{py.parent}:{full.get('PATH', '')}"
    for k, v in (env or {}).items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    cmd = [str(py), "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *argv]
    with tempfile.TemporaryFile() as log:
        p = subprocess.Popen(cmd, env=full, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                             cwd=cwd)
        try:
            rc = p.wait(timeout=timeout)
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.seek(0)
        return rc, log.read().decode(errors="replace")


def job(name: str, script: Path, nproc: int, argv: Sequence[str], **kw) -> float:
    """:func:`run`, exiting with the end of the output when the job fails; the seconds it took."""
    t0 = time.time()
    rc, out = run(script, nproc, argv, **kw)
    if rc != 0:
        sys.stderr.write(out[-12000:])
        raise SystemExit(f"{name}: job failed: {' '.join(argv)}")
    return round(time.time() - t0, 1)
