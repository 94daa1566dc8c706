#!/usr/bin/env python3
"""Executor throughput against `cp -r` of the same bytes, with peak RSS and RssAnon.

Generates a synthetic HF-storage checkpoint (per-rank safetensors shards with
DCP_SHARDING_INFO, FSDP2 Shard(0) chunks) of --size-gb GiB over --ranks ranks, then times,
in paired rounds (page cache warm): `cp -r SRC DST` and `reshard convert` for several
targets. Every reshard output is checked (consolidated output == expected bytes) before its
time counts. Prints a Markdown table for BENCHMARKS.md.

    .venv/bin/python scripts/bench_engine.py --size-gb 1 --rounds 5 --work /tmp/rb
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parent.parent


def chunk(n: int, k: int, i: int) -> tuple[int, int]:
    c = -(-n // k)
    return min(i * c, n), min((i + 1) * c, n)


def make_checkpoint(path: Path, size_gb: float, ranks: int, cols: int = 1024) -> dict:
    """Tensors of (rows, cols) float32, about 32 MiB each, sharded dim 0 over `ranks`."""
    path.mkdir(parents=True)
    rows = 8191  # odd, so chunks are uneven
    per = rows * cols * 4
    n = max(1, int(size_gb * (1 << 30) // per))
    rng = np.random.default_rng(0)
    shards = [dict() for _ in range(ranks)]
    infos = [dict() for _ in range(ranks)]
    digests = {}
    for t in range(n):
        full = rng.standard_normal((rows, cols), dtype=np.float32)
        name = f"layers.{t}.weight"
        digests[name] = hashlib.sha256(full.tobytes()).hexdigest()
        for r in range(ranks):
            a, b = chunk(rows, ranks, r)
            if a < b:
                shards[r][name] = np.ascontiguousarray(full[a:b])
                infos[r][name] = {"saved_offsets": [a, 0]}
    for r in range(ranks):
        meta = {"DCP_SHARDING_INFO": json.dumps(infos[r]), "DCP_VERSION": "1.0", "format": "pt"}
        save_file(shards[r], str(path / f"shard-{r + 1:05}-model-00001-of-00001.safetensors"), metadata=meta)
    return {"tensors": n, "bytes": n * per, "digests": digests}


def measure(cmd: list[str]) -> tuple[float, int, int]:
    """Wall time, peak RSS (VmHWM) and peak RssAnon (sampled every 2 ms), in bytes."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak_anon = 0
    hwm = 0
    status = f"/proc/{p.pid}/status"
    while p.poll() is None:
        try:
            with open(status) as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        peak_anon = max(peak_anon, int(line.split()[1]) * 1024)
                    elif line.startswith("VmHWM:"):
                        hwm = max(hwm, int(line.split()[1]) * 1024)
        except (FileNotFoundError, ProcessLookupError):
            pass
        time.sleep(0.002)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}: {p.stderr.read().decode()}")
    return wall, hwm, peak_anon


def check_consolidated(path: Path, digests: dict) -> None:
    from safetensors import safe_open
    with safe_open(str(path), "np") as f:
        names = set(f.keys())
        if names != set(digests):
            sys.exit(f"{path}: wrong tensor set")
        for k in names:
            if hashlib.sha256(f.get_tensor(k).tobytes()).hexdigest() != digests[k]:
                sys.exit(f"{path}: tensor {k} differs")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/tmp/reshard-bench"))
    ap.add_argument("--reshard", type=Path, default=ROOT / "target/release/reshard")
    args = ap.parse_args()
    if not args.reshard.exists():
        sys.exit(f"{args.reshard} not found: run cargo build --release")
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    src = args.work / "src"
    info = make_checkpoint(src, args.size_gb, args.ranks)
    print(f"checkpoint: {info['tensors']} tensors, {info['bytes'] / 2**30:.2f} GiB, {args.ranks} ranks", file=sys.stderr)
    # correctness first: the consolidated output must equal the generated tensors
    out = args.work / "check.safetensors"
    subprocess.run([str(args.reshard), "convert", str(src), str(out), "--to", "1", "-q"], check=True)
    check_consolidated(out, info["digests"])
    out.unlink()
    cases = {
        "cp -r": lambda d: ["cp", "-r", str(src), str(d)],
        "cp -r && sync": lambda d: ["sh", "-c", f"cp -r '{src}' '{d}' && sync"],
        f"reshard {args.ranks}->1 (.safetensors) --no-fsync": lambda d: [str(args.reshard), "convert", str(src), str(d) + ".safetensors", "--to", "1", "-q", "--no-fsync"],
        f"reshard {args.ranks}->1 (.safetensors)": lambda d: [str(args.reshard), "convert", str(src), str(d) + ".safetensors", "--to", "1", "-q"],
        f"reshard {args.ranks}->8 (hf-storage)": lambda d: [str(args.reshard), "convert", str(src), str(d), "--to", "8", "-q"],
        f"reshard {args.ranks}->3 (hf-storage)": lambda d: [str(args.reshard), "convert", str(src), str(d), "--to", "3", "-q"],
    }
    # warm the page cache
    subprocess.run(["cat"] + [str(p) for p in src.iterdir()], stdout=subprocess.DEVNULL, check=True)
    results = {k: [] for k in cases}
    for r in range(args.rounds):
        for name, mk in cases.items():
            d = args.work / f"out-{r}-{abs(hash(name))}"
            results[name].append(measure(mk(d)))
            shutil.rmtree(d, ignore_errors=True)
            Path(str(d) + ".safetensors").unlink(missing_ok=True)
    cp = statistics.median(w for w, _, _ in results["cp -r"])
    print(f"| case | median wall (s) | ratio to cp -r | peak RSS (MiB) | peak RssAnon (MiB) |")
    print("|---|---|---|---|---|")
    for name, rs in results.items():
        w = statistics.median(x[0] for x in rs)
        print(f"| {name} | {w:.3f} | {w / cp:.2f} | {max(x[1] for x in rs) / 2**20:.0f} | {max(x[2] for x in rs) / 2**20:.1f} |")
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
