#!/usr/bin/env python3
"""Executor experiments (issue #5): one reshard conversion under several settings, paired
rounds against `cp -r` of the same source, medians. Prints a Markdown table.

    .venv/bin/python scripts/bench_exec.py --ckpt /work/big/gen-1/fsdp2_w4_f32/checkpoint \\
        --to 1 --ext .safetensors --rounds 9 --experiment threads

Experiments (each a set of variants of `reshard convert CKPT OUT --to M -q --no-fsync`):
  threads   --threads 1 / 2 / 4, with and without the source CRC check (--no-verify)
  window    RESHARD_WINDOW (work-unit bytes) 1 MiB / 8 MiB (default) / 64 MiB
  verify    the source CRC check reading by pread (default) or by mmap
            (RESHARD_VERIFY_READ=mmap), and off
  baseline  this build against another reshard binary (--baseline BIN, e.g. one built from an
            earlier commit), both with the default checks and with --no-verify
  bound     the kernel's share: the plan's long runs (what reshard hands to copy_file_range)
            replayed by this script into one fallocated file, in process (no start-up, no
            metadata, no header), against reshard with and without the source CRC check

    # the tmpfs case (where many trainers stage checkpoints): source and output in /dev/shm
    .venv/bin/python scripts/bench_exec.py --ckpt /dev/shm/big/fsdp2_w4_f32/checkpoint \
        --work /dev/shm/reshard-bench-exec --experiment baseline --baseline /tmp/reshard-old --rounds 11
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import measure  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

EXPERIMENTS = {
    "threads": [("--threads 1", ["--threads", "1"], {}), ("--threads 2", ["--threads", "2"], {}),
                ("--threads 4", ["--threads", "4"], {}),
                ("--threads 1 --no-verify", ["--threads", "1", "--no-verify"], {}),
                ("--threads 2 --no-verify", ["--threads", "2", "--no-verify"], {})],
    "window": [("window 1 MiB", [], {"RESHARD_WINDOW": str(1 << 20)}), ("window 8 MiB", [], {}),
               ("window 64 MiB", [], {"RESHARD_WINDOW": str(64 << 20)})],
    "baseline": [("this build", [], {}), ("this build --no-verify", ["--no-verify"], {}),
                 ("baseline", [], {"BIN": "baseline"}), ("baseline --no-verify", ["--no-verify"], {"BIN": "baseline"})],
    "bound": [("replay of the plan's kernel copies", "replay", {}), ("reshard (default)", [], {}),
              ("reshard --no-verify", ["--no-verify"], {})],
    "verify": [("check by pread (default)", [], {}), ("check by mmap", [], {"RESHARD_VERIFY_READ": "mmap"}),
               ("--no-verify", ["--no-verify"], {})],
}


def kernel_runs(reshard: Path, src: Path, to: str) -> tuple[list[str], int, list[tuple]]:
    """The source files, the size of destination file 0 and its plain runs of at least 64 KiB
    (the copies reshard's executor gives the kernel), from `reshard plan --json`, in
    destination order, cut at 8 MiB windows as the executor cuts them."""
    import json
    import subprocess
    plan = json.loads(subprocess.run([str(reshard), "plan", str(src), "--to", to, "--json"],
                                     capture_output=True, check=True).stdout)
    window = 8 << 20
    runs = []
    for o in sorted(plan["plan"]["ops"], key=lambda o: o["dst_offset"]):
        if o["dst"] != 0 or o["count"] != 1 or o.get("cast") or o["len"] < 64 << 10:
            continue
        s, d, n = o["src_offset"], o["dst_offset"], o["len"]
        while n > 0:
            m = min(n, window - d % window)
            runs.append((o["src"], s, d, m))
            s, d, n = s + m, d + m, n - m
    return plan["source"]["files"], plan["target"]["files"][0]["size"], runs


def replay(runs: tuple, out: Path) -> tuple[float, int, int]:
    """Copy `runs` (from kernel_runs) into a fresh fallocated file `out`: wall time, and no
    memory figures (it runs in this process)."""
    import time
    files, size, ops = runs
    t0 = time.perf_counter()
    fds = [os.open(p, os.O_RDONLY) for p in files]
    o = os.open(out, os.O_WRONLY | os.O_CREAT, 0o644)
    os.posix_fallocate(o, 0, size)
    for src, s, d, n in ops:
        while n > 0:
            k = os.copy_file_range(fds[src], o, n, s, d)
            s, d, n = s + k, d + k, n - k
    os.close(o)
    for f in fds:
        os.close(f)
    return time.perf_counter() - t0, 0, 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--to", default="1")
    ap.add_argument("--ext", default=".safetensors", help="output suffix ('' for a directory)")
    ap.add_argument("--extra", default="", help="more convert arguments, space-separated")
    ap.add_argument("--experiment", choices=EXPERIMENTS, required=True)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--reshard", type=Path, default=ROOT / "target/release/reshard")
    ap.add_argument("--work", type=Path, default=Path("/tmp/reshard-bench-exec"))
    ap.add_argument("--baseline", type=Path, help="the other binary of --experiment baseline")
    a = ap.parse_args()
    if a.experiment == "baseline" and a.baseline is None:
        ap.error("--experiment baseline needs --baseline BIN")
    shutil.rmtree(a.work, ignore_errors=True)
    a.work.mkdir(parents=True)
    src = a.ckpt.resolve()
    variants = [("`cp -r`", None, {})] + EXPERIMENTS[a.experiment]
    res = {v[0]: [] for v in variants}
    for p in src.iterdir():
        p.read_bytes()
    runs = kernel_runs(a.reshard, src, a.to) if a.experiment == "bound" else None
    for r in range(a.rounds):
        for label, args, env in variants:
            out = a.work / f"out{a.ext}"
            shutil.rmtree(out, ignore_errors=True)
            out.unlink(missing_ok=True)
            os.sync()
            if args == "replay":
                res[label].append(replay(runs, out))
                continue
            if args is None:
                cmd = ["cp", "-r", str(src), str(out)]
            else:
                env = dict(env)
                binary = a.baseline if env.pop("BIN", None) == "baseline" else a.reshard
                cmd = [str(binary), "convert", str(src), str(out), "--to", a.to, "-q", "--no-fsync",
                       *a.extra.split(), *args]
            old = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                res[label].append(measure(cmd))
            finally:
                for k, v in old.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        print(f"round {r + 1}/{a.rounds}", file=sys.stderr, flush=True)
    cp = statistics.median(x[0] for x in res["`cp -r`"])
    size = sum(p.stat().st_size for p in src.iterdir() if p.is_file())
    print(f"`{a.experiment}`: {src} ({size / 2**30:.2f} GiB) → --to {a.to} {a.ext or 'directory'} {a.extra}, "
          f"{a.rounds} paired rounds, medians\n")
    print("| variant | median wall (s) | × `cp -r` | min–max (s) | peak RSS (MiB) | peak RssAnon (MiB) |")
    print("|---|---|---|---|---|---|")
    for label, rs in res.items():
        w = [x[0] for x in rs]
        m = statistics.median(w)
        print(f"| {label} | {m:.3f} | {m / cp:.2f} | {min(w):.3f}–{max(w):.3f} | {max(x[1] for x in rs) / 2**20:.0f} "
              f"| {max(x[2] for x in rs) / 2**20:.1f} |")
    shutil.rmtree(a.work, ignore_errors=True)


if __name__ == "__main__":
    main()
