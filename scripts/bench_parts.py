#!/usr/bin/env python3
"""One conversion split over 1, 2 and 4 workers (`reshard convert --part K/N`) on this machine,
against `cp -r` of the source and the same conversion in one process.

    .venv/bin/python scripts/bench_parts.py --gib 4 --rounds 5

The source is the FSDP2 DCP checkpoint of `compare.py` at `--gib` GiB (generated under --work
with torch on first use, as compare.py does). Each round (page cache warm: the source is read
once before) times, in a shuffled order: `cp -r SRC`; the conversion in one process; and W
workers started at once for W = 1 (`--part 0/1` is the one-process run, so W = 1 is that row),
2 and 4, wall time until the last exits (it commits: reads every part's bytes back against
their CRC-32s, writes the output checksums, renames). Targets: one `.safetensors` file (one
file cut into byte ranges) and DCP at 8 ranks (whole files dealt to workers). Rows with
`--no-verify` skip both the sources' CRC check and the commit's read-back. Peak RSS is the
largest of the workers' (`wait4`). Every parts output is compared byte for byte with the
one-process output before timing. Prints Markdown: medians, and ratios to `cp -r`.
"""
from __future__ import annotations

import argparse
import filecmp
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402  (its generator and cache helpers)

ROOT = Path(__file__).resolve().parent.parent


def spawn(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen([str(c) for c in cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def timed(cmds: list[list[str]]) -> tuple[float, int]:
    """Start every command at once; seconds until the last exits, largest peak RSS (bytes)."""
    t = time.perf_counter()
    procs = [spawn(c) for c in cmds]
    rss = 0
    for p in procs:
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        err = p.stderr.read().decode()
        if p.returncode != 0:
            sys.exit(f"failed ({p.returncode}): {' '.join(map(str, p.args))}\n{err}")
        rss = max(rss, usage.ru_maxrss * 1024)
    return time.perf_counter() - t, rss


def same_output(a: Path, b: Path) -> bool:
    if a.is_file():
        return filecmp.cmp(a, b, shallow=False)
    cmp = filecmp.dircmp(a, b)
    return not (cmp.left_only or cmp.right_only or cmp.diff_files or cmp.funny_files) and all(
        filecmp.cmp(a / f, b / f, shallow=False) for f in cmp.common_files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/work/big"))
    ap.add_argument("--reshard", type=Path, default=ROOT / "target/release/reshard")
    ap.add_argument("--workers", default="1,2,4")
    args = ap.parse_args()
    src = compare.generate(args.work, "fsdp2", args.gib, str(args.reshard))
    out = args.work / "bench-parts"
    compare.remove(out)
    out.mkdir(parents=True)
    nbytes = compare.dir_bytes(src)
    ws = [int(w) for w in args.workers.split(",")]
    targets = {"one .safetensors": ("m.safetensors", ["--to", "1"]),
               "DCP at 8 ranks": ("dcp8", ["--to", "8", "--format", "dcp", *compare.PER_RANK])}

    def cmds(target: str, w: int, verify: bool, dst: Path) -> list[list[str]]:
        _, extra = targets[target]
        base = [args.reshard, "convert", src, dst, "-q", *extra] + ([] if verify else ["--no-verify"])
        if w == 1:
            return [base]
        return [base + ["--part", f"{k}/{w}"] for k in range(w)]

    rows = [("cp -r", None, None, None)]
    for t in targets:
        for verify in (True, False):
            for w in ws:
                rows.append((f"{t}, {w} worker{'s' if w > 1 else ''}{'' if verify else ', --no-verify'}", t, w, verify))
    # check: every parts output equals the one-process one
    for t, (name, _) in targets.items():
        want = out / f"want-{name}"
        timed(cmds(t, 1, True, want))
        for w in ws[1:]:
            got = out / f"got-{w}-{name}"
            timed(cmds(t, w, True, got))
            if not same_output(want, got):
                sys.exit(f"{t}: {w} workers wrote another output than one process")
            compare.remove(got)
        compare.remove(want)
    print(f"checked: the outputs of {', '.join(map(str, ws[1:]))} workers equal the one-process output", file=sys.stderr)
    times: dict[str, list[float]] = {r[0]: [] for r in rows}
    peak: dict[str, int] = {r[0]: 0 for r in rows}
    compare.warm(src)
    for rnd in range(args.rounds):
        order = rows[:]
        random.Random(rnd).shuffle(order)
        for label, t, w, verify in order:
            dst = out / "dst"
            if t is None:
                secs, rss = timed([["cp", "-r", src, dst]])
            else:
                dst = out / targets[t][0]
                secs, rss = timed(cmds(t, w, verify, dst))
            times[label].append(secs)
            peak[label] = max(peak[label], rss)
            compare.remove(dst)
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    cp = statistics.median(times["cp -r"])
    print(f"Source: {src} ({nbytes / 2**30:.2f} GiB, FSDP2 DCP at 4 ranks), page cache warm, "
          f"{args.rounds} rounds, medians; this machine has {os.cpu_count()} cores.\n")
    print("| run | seconds | ratio to `cp -r` | GiB/s | peak RSS of a worker |")
    print("|---|---:|---:|---:|---:|")
    for label, *_ in rows:
        m = statistics.median(times[label])
        print(f"| {label} | {m:.3f} | {m / cp:.2f}x | {nbytes / 2**30 / m:.2f} | {peak[label] / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
