#!/usr/bin/env python3
"""How the kernel's copy depends on where the bytes land: each data file of a checkpoint
copied with ``copy_file_range`` into a fresh file of its own, at the source's offsets or
shifted by a few bytes, into an ``fallocate``d file or one left to delayed allocation.
In process, paired rounds, medians; prints a Markdown table (BENCHMARKS.md, "The copy at
the bound").

    .venv/bin/python scripts/bench_offsets.py /work/big/fsdp2_w4_f32/checkpoint \\
        --work /work/reshard-bench-offsets --rounds 9
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
from pathlib import Path

SHIFTS = [0, 64, 4096, 64 << 10, 2 << 20]


def copy(files: list[Path], work: Path, shift: int, falloc: bool, cut: int | None) -> float:
    """Copy every file into ``work`` at ``shift`` bytes past its source offset; with
    ``cut``, every call ends at a multiple of ``cut`` in the destination."""
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    for j, f in enumerate(files):
        i = os.open(f, os.O_RDONLY)
        n = os.fstat(i).st_size
        o = os.open(work / str(j), os.O_WRONLY | os.O_CREAT, 0o644)
        if falloc:
            os.posix_fallocate(o, 0, n + shift)
        off = 0
        while off < n:
            end = n if cut is None else min(n, (off + shift + cut) // cut * cut - shift)
            while off < end:
                off += os.copy_file_range(i, o, end - off, off, off + shift)
        os.close(i)
        os.close(o)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/reshard-bench-offsets"))
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    files = sorted(p for p in a.ckpt.iterdir() if p.is_file() and p.suffix == ".distcp")
    for f in files:
        f.read_bytes()
    variants = [(s, fa, None) for s in SHIFTS for fa in (True, False)] + [(4096, True, 64 << 10), (64, True, 64 << 10)]
    res: dict = {v: [] for v in variants}
    for _ in range(a.rounds):
        for v in variants:
            shutil.rmtree(a.work, ignore_errors=True)
            os.sync()
            res[v].append(copy(files, a.work, *v))
    shutil.rmtree(a.work, ignore_errors=True)
    print(f"{a.ckpt}: {len(files)} files, {sum(f.stat().st_size for f in files) / 2**30:.2f} GiB, "
          f"{a.rounds} paired rounds, medians\n")
    print("| destination offset | allocation | calls | median (s) |")
    print("|---|---|---|---|")
    for (shift, fa, cut), ts in res.items():
        print(f"| source's + {shift} | {'fallocate' if fa else 'delayed'} | "
              f"{'one per file' if cut is None else f'cut at {cut >> 10} KiB'} | {statistics.median(ts):.3f} |")


if __name__ == "__main__":
    main()
