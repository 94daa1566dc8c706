#!/usr/bin/env python3
"""Time and peak RSS of opening and planning DCP checkpoints with many chunks.

For each checkpoint directory (made by ``scripts/gen_scale_dcp.py``), runs
``reshard plan DIR --to M`` for every ``--to`` value ``--rounds`` times and prints the median
wall time and the median peak RSS (of the process, from ``wait4``), with the number of chunks;
``--load R/M ...`` also times a trainer rank's load from Python: ``reshard.open`` and
``local_shards(R, M)`` (numpy arrays, so torch is not imported). ``--baseline OTHER`` times
only ``reshard plan``, alternating runs of OTHER (the build before) and of ``--reshard``, and
also reports their CPU time (user + system), steadier than wall time on a shared machine. ``--convert`` also times ``reshard convert DIR OUT.safetensors --to 1 --no-fsync`` (OUT in
``--out``, a tmpfs by default, removed after each round). ``--torch`` also times ``pickle.load``
of the ``.metadata`` with torch imported (what every torch loader does first), once per round,
and torch's ``dcp_to_torch_save`` once per checkpoint, stopped after ``--torch-timeout`` seconds.

    .venv/bin/python scripts/bench_scale.py /work/scale/s10k /work/scale/s1m --to 1 768 --convert --torch
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def run(cmd: list[str], timeout: float | None = None) -> tuple[float, int, float] | None:
    """Wall seconds, peak RSS (bytes, from ``wait4``) and CPU seconds (user + system, all
    threads) of a command; None when it ran past ``timeout`` seconds (it is killed then)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    timer = threading.Timer(timeout, p.kill) if timeout else None
    if timer:
        timer.start()
    _, status, ru = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if timer:
        timer.cancel()
        if dt >= timeout:
            return None
    err = p.stderr.read().decode() if p.stderr else ""
    if status != 0:
        sys.exit(f"{' '.join(cmd)} failed: {err.strip()}")
    return dt, ru.ru_maxrss * 1024, ru.ru_utime + ru.ru_stime


def chunks(d: str, reshard: str) -> int:
    """Chunks of a checkpoint, counted in a child process: the JSON of a million chunks
    would grow this process, and a child forked from a large parent starts with the
    parent's peak RSS in its own ``ru_maxrss``, which would then count in every
    measurement after it."""
    code = (
        "import json, subprocess, sys;"
        "out = subprocess.run(sys.argv[1:], check=True, capture_output=True).stdout;"
        "print(sum(len(t['pieces']) for t in json.loads(out)['tensors']))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, reshard, "inspect", d, "--json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return int(out)


def report(n: int, size: int, name: str, res: list[tuple[float, int]]) -> None:
    """One table row: medians of ``res``."""
    t = statistics.median(r[0] for r in res)
    rss = statistics.median(r[1] for r in res)
    print(
        f"| {n:,} | {size / 2**20:.0f} MiB | {name} | {t:.2f} s | {rss / 2**20:.0f} MiB "
        f"| {t / n * 1e6:.1f} µs, {rss / n:.0f} B |",
        flush=True,
    )


def paired(dirs: list[str], to: list[int], rounds: int, reshard: str, baseline: str) -> None:
    """``reshard plan DIR --to M`` by ``baseline`` and by ``reshard``, alternating, ``rounds``
    pairs per case: medians of wall time, CPU time and peak RSS of each."""
    print("| chunks | step | build | median wall | median CPU (user + sys) | median peak RSS |")
    print("|---:|---|---|---:|---:|---:|")
    for d in dirs:
        n = chunks(d, reshard)
        for m in to:
            res: dict[str, list] = {"before": [], "after": []}
            for _ in range(rounds):
                for name, exe in (("before", baseline), ("after", reshard)):
                    res[name].append(run([exe, "plan", d, "--to", str(m)]))
            for name, rs in res.items():
                t = statistics.median(r[0] for r in rs)
                cpu = statistics.median(r[2] for r in rs)
                rss = statistics.median(r[1] for r in rs)
                print(
                    f"| {n:,} | `reshard plan --to {m}` | {name} | {t:.2f} s | {cpu:.2f} s "
                    f"| {rss / 2**20:.0f} MiB |",
                    flush=True,
                )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--to", type=int, nargs="+", default=[1])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reshard", default=os.path.join(HERE, "..", "target", "release", "reshard"))
    ap.add_argument("--convert", action="store_true", help="also time reshard convert --to 1")
    ap.add_argument("--load", nargs="+", default=[], metavar="R/M",
                    help="also time reshard.open + local_shards(R, M) in Python")
    ap.add_argument("--import-baseline", action="store_true",
                    help="also time `import torch, torch.distributed.checkpoint` alone (once per round)")
    ap.add_argument("--out", default="/dev/shm", help="where --convert writes (default /dev/shm)")
    ap.add_argument("--torch", action="store_true", help="also time torch's pickle.load and dcp_to_torch_save")
    ap.add_argument("--torch-timeout", type=float, default=300, help="seconds dcp_to_torch_save may take")
    ap.add_argument("--baseline", metavar="RESHARD",
                    help="only time `reshard plan`, paired against this build in alternating rounds")
    a = ap.parse_args()
    if a.baseline:
        paired(a.dirs, a.to, a.rounds, a.reshard, a.baseline)
        return 0
    print("| chunks | .metadata | step | median time | median peak RSS | per chunk |")
    print("|---:|---:|---|---:|---:|---:|")
    if a.import_baseline:
        cmd = [sys.executable, "-c", "import torch, torch.distributed.checkpoint"]
        res = [run(cmd) for _ in range(a.rounds)]
        t = statistics.median(r[0] for r in res)
        rss = statistics.median(r[1] for r in res)
        print(f"| – | – | `import torch` alone | {t:.2f} s | {rss / 2**20:.0f} MiB | |", flush=True)
    for d in a.dirs:
        n = chunks(d, a.reshard)
        size = os.path.getsize(os.path.join(d, ".metadata"))
        cases = [(f"`reshard plan --to {m}`", [a.reshard, "plan", d, "--to", str(m)]) for m in a.to]
        out_dir = tempfile.mkdtemp(prefix="bench-scale-", dir=a.out)
        out = os.path.join(out_dir, "out.safetensors")
        if a.convert:
            cmd = [a.reshard, "convert", d, out, "--to", "1", "--no-fsync", "--force", "-q"]
            cases.append(("`reshard convert --to 1` (.safetensors)", cmd))
        for rm in a.load:
            r, m = rm.split("/")
            code = (
                "import sys, reshard;"
                "ck = reshard.open(sys.argv[1], framework='numpy');"
                "ck.local_shards(int(sys.argv[2]), int(sys.argv[3]))"
            )
            cases.append((f"Python `reshard.open` + `local_shards({r}, {m})`", [sys.executable, "-c", code, d, r, m]))
        if a.torch:
            code = (
                "import pickle, torch, torch.distributed.checkpoint;"
                f"pickle.load(open({os.path.join(d, '.metadata')!r}, 'rb'))"
            )
            cases.append(("torch `pickle.load`", [sys.executable, "-c", code]))
        for name, cmd in cases:
            res = []
            for _ in range(a.rounds):
                res.append(run(cmd))
                if os.path.exists(out):
                    os.remove(out)
            report(n, size, name, res)
        if a.torch:
            code = (
                "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save;"
                "dcp_to_torch_save(sys.argv[1], sys.argv[2])"
            )
            pt = os.path.join(out_dir, "out.pt")
            r = run([sys.executable, "-c", code, d, pt], timeout=a.torch_timeout)
            if r is None:
                print(
                    f"| {n:,} | {size / 2**20:.0f} MiB | torch `dcp_to_torch_save` "
                    f"| did not finish in {a.torch_timeout:.0f} s | | |",
                    flush=True,
                )
            else:
                report(n, size, "torch `dcp_to_torch_save` (once)", [r])
            if os.path.exists(pt):
                os.remove(pt)
        os.rmdir(out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
