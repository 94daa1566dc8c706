#!/usr/bin/env python3
"""reshard against an S3-compatible server on 127.0.0.1: what a rank's load fetches, and
conversions from and to object storage against boto3 moving the same bytes (what
`aws s3 cp --recursive` does).

    .venv/bin/python scripts/bench_remote.py --mib 512 --rounds 5 [--server moto|s3s] \
        [--reshard $CARGO_TARGET_DIR/release/reshard]

Servers (`--server`):
- moto (default): moto's S3 server (Python, objects in memory), `scripts/setup_venv.sh --s3`.
- s3s: s3s-fs, a compiled S3 server (Rust) on a scratch folder, installed with
  `cargo install s3s-fs --version 0.14.1 --features binary --locked` (0.14.1: later releases
  need a newer Rust); found on PATH or at ~/.cargo/bin/s3s-fs (`--s3s-fs` names another).

The source is a DCP checkpoint of `--mib` MiB at 4 ranks (torch's `dcp.save` of one rank,
resharded to 4 by reshard and loaded back by torch), made under --work on first use. Printed as
Markdown:

1. A rank's load: for rank r of M, `reshard.open(url).local_shards(r, M)` (Shard(0) rows of every
   tensor, index included) — bytes fetched against bytes needed, and requests
   (`reshard.fetch_stats()`), in this process.
2. Timings, medians of shuffled rounds, each in its own process (peak RSS from `wait4`):
   `reshard convert s3://.../src OUT --to 2` against boto3 downloading every object of the
   source; `reshard convert SRC s3://.../out --to 2 --force` against boto3 uploading the files
   of the same conversion made locally; `cp -r` of the source for scale. The peak scratch disk
   of the upload is polled (`du` of RESHARD_SCRATCH every 50 ms). Peak RSS from /usr/bin/time.

Requests per run are counted from the server's log (moto's access log; s3s-fs's debug log):
every request, listing and HEADs included.

Both servers share the machine's cores with the client, so the figures measure reshard's
requests against a local server more than a network: the ratios to boto3 are the point.
"""
from __future__ import annotations

import argparse
import os
import re
import random
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import boto3
import torch
import torch.distributed.checkpoint as dcp

import reshard

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent / "reshard"
MOTO = Path(sys.executable).parent / "moto_server"
S3S_KEY = ("bench", "benchsecret")
BUCKET = "bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3s_binary(given: Path | None) -> Path:
    for c in [given, shutil.which("s3s-fs"), Path.home() / ".cargo/bin/s3s-fs"]:
        if c and Path(c).exists():
            return Path(c)
    sys.exit("s3s-fs not found: cargo install s3s-fs --version 0.14.1 --features binary --locked")


def start_server(kind: str, log: Path, work: Path, s3s: Path | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    if kind == "moto":
        cmd = [str(MOTO), "-H", "127.0.0.1", "-p", str(port)]
        env = None
    else:
        root = work / "s3s-root"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        cmd = [str(s3s_binary(s3s)), "--host", "127.0.0.1", "--port", str(port),
               "--access-key", S3S_KEY[0], "--secret-key", S3S_KEY[1], str(root)]
        # one debug line per request (counted), nothing per byte
        env = dict(os.environ, RUST_LOG="s3s::service=debug")
    p = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return p, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    sys.exit(f"{kind} server did not start: {log.read_text()[-2000:]}")


# a request in the server's log: moto's (werkzeug) access line (colored or not), s3s-fs's
# debug line
REQUEST = re.compile(rb'"(?:\x1b\[[0-9;]*m)*(?:GET|PUT|POST|HEAD|DELETE) /|req: Request \{ method: ')


def requests_logged(log: Path) -> int:
    return len(REQUEST.findall(log.read_bytes()))


def make_source(work: Path, mib: int) -> Path:
    ck = work / f"dcp_{mib}mib_w4"
    if (ck / ".metadata").exists():
        return ck
    g = torch.Generator().manual_seed(1)
    n = mib * (1 << 20) // 4
    rows = 4096
    sd = {}
    i = 0
    while n > 0:
        r = min(rows, max(1, n // 2048))
        sd[f"layers.{i}.w"] = torch.randn(r + i % 7, 2048, generator=g)
        n -= (r + i % 7) * 2048
        i += 1
    one = work / f"dcp_{mib}mib_w1"
    shutil.rmtree(one, ignore_errors=True)
    dcp.save(sd, checkpoint_id=str(one), no_dist=True)
    reshard.convert(one, ck, world_size=4, format="dcp")
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(back, checkpoint_id=str(ck), no_dist=True)
    assert all(torch.equal(back[k], v) for k, v in sd.items())
    shutil.rmtree(one)
    return ck


def run(cmd: list, env: dict, work: Path) -> tuple[float, int]:
    """Seconds and peak RSS (from /usr/bin/time, whose child is forked from a small process:
    a child forked from this interpreter would count torch's pages in its peak)."""
    rss_file = work / "rss.txt"
    t = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", str(rss_file), *map(str, cmd)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    elapsed = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(map(str, cmd))}\n{r.stderr.decode()}")
    return elapsed, int(rss_file.read_text().split()[-1]) * 1024


BOTO = """
import boto3, os, sys
from pathlib import Path
s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")
op, a, b = sys.argv[1:4]
if op == "down":
    prefix = a.split("/", 3)[3]
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket="%s", Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            dst = Path(b) / o["Key"][len(prefix) + 1:]
            dst.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file("%s", o["Key"], str(dst))
else:
    prefix = b.split("/", 3)[3]
    for f in sorted(Path(a).rglob("*")):
        if f.is_file():
            s3.upload_file(str(f), "%s", prefix + "/" + str(f.relative_to(a)))
""" % (BUCKET, BUCKET, BUCKET)


def du(p: Path) -> int:
    total = 0
    for f in p.rglob("*"):
        try:
            total += f.lstat().st_blocks * 512
        except OSError:
            pass
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/tmp/reshard-bench-remote"))
    ap.add_argument("--server", choices=["moto", "s3s"], default="moto")
    ap.add_argument("--s3s-fs", type=Path, help="the s3s-fs binary (default: on PATH, or ~/.cargo/bin)")
    ap.add_argument("--reshard", type=Path, default=BIN,
                    help="the reshard binary timed (default: the venv's); the rank-share table uses "
                         "the imported reshard package")
    ap.add_argument("--baseline", type=Path,
                    help="another reshard binary timed in the same rounds (rows marked 'baseline')")
    a = ap.parse_args()
    bin_ = a.reshard
    a.work.mkdir(parents=True, exist_ok=True)
    src = make_source(a.work, a.mib)
    size = sum(f.stat().st_size for f in src.iterdir())
    log = a.work / f"{a.server}.log"
    server, url = start_server(a.server, log, a.work, a.s3s_fs)
    try:
        env = dict(os.environ, AWS_ACCESS_KEY_ID=S3S_KEY[0], AWS_SECRET_ACCESS_KEY=S3S_KEY[1],
                   AWS_ENDPOINT_URL=url, AWS_REGION="us-east-1",
                   RESHARD_SCRATCH=str(a.work / "scratch"),
                   RESHARD_UPLOAD_JOURNAL=str(a.work / "journal"))
        os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                               "AWS_ENDPOINT_URL", "AWS_REGION", "RESHARD_SCRATCH")})
        (a.work / "scratch").mkdir(exist_ok=True)
        s3 = boto3.client("s3", endpoint_url=url, region_name="us-east-1")
        s3.create_bucket(Bucket=BUCKET)
        for f in sorted(src.iterdir()):
            s3.upload_file(str(f), BUCKET, f"src/{f.name}")
        src_url = f"s3://{BUCKET}/src"

        print(f"server: {a.server}; reshard: {bin_}\n")
        print(f"source: DCP at 4 ranks, {size / 2**20:.1f} MiB, {len(list(src.iterdir()))} files\n")
        print("| load | needed | fetched | fetched / needed | requests |")
        print("|---|---:|---:|---:|---:|")
        for world, rank in [(1, 0), (2, 1), (3, 1), (8, 5), (32, 17)]:
            before = reshard.fetch_stats()
            with reshard.open(src_url) as ck:
                shards = ck.local_shards(rank, world)
            after = reshard.fetch_stats()
            needed = sum(s.tensor.numel() * s.tensor.element_size() for s in shards)
            fetched = after["bytes"] - before["bytes"]
            print(f"| rank {rank} of {world} | {needed / 2**20:.2f} MiB | {fetched / 2**20:.2f} MiB "
                  f"| {fetched / needed:.4f}x | {after['requests'] - before['requests']} |")

        out = a.work / "out"
        local_conv = a.work / "local-conv"
        shutil.rmtree(local_conv, ignore_errors=True)
        subprocess.run([str(bin_), "convert", str(src), str(local_conv), "--to", "2", "-q"], check=True)
        cases = {
            "cp -r SRC (local, for scale)": lambda: ["cp", "-r", src, out],
            "boto3 download of the source": lambda: [sys.executable, "-c", BOTO, "down", src_url, out],
            "reshard convert s3://SRC OUT --to 2": lambda: [bin_, "convert", src_url, out, "--to", "2", "-q"],
            "boto3 upload of the local --to 2 output": lambda: [sys.executable, "-c", BOTO, "up", local_conv, f"s3://{BUCKET}/up"],
            "reshard convert SRC s3://OUT --to 2": lambda: [bin_, "convert", src, f"s3://{BUCKET}/conv", "--to", "2", "-q", "--force"],
        }
        if a.baseline:
            cases["baseline: reshard convert s3://SRC OUT --to 2"] = \
                lambda: [a.baseline, "convert", src_url, out, "--to", "2", "-q"]
            cases["baseline: reshard convert SRC s3://OUT --to 2"] = \
                lambda: [a.baseline, "convert", src, f"s3://{BUCKET}/conv", "--to", "2", "-q", "--force"]
        times = {k: [] for k in cases}
        reqs = {k: [] for k in cases}
        rss = {k: 0 for k in cases}
        peak_scratch = 0
        for _ in range(a.rounds):
            order = list(cases)
            random.shuffle(order)
            for k in order:
                shutil.rmtree(out, ignore_errors=True)
                stop = threading.Event()
                peak = [0]

                def poll():
                    while not stop.is_set():
                        peak[0] = max(peak[0], du(a.work / "scratch"))
                        time.sleep(0.05)

                th = threading.Thread(target=poll)
                th.start()
                n0 = requests_logged(log)
                t, r = run(cases[k](), env, a.work)
                reqs[k].append(requests_logged(log) - n0)
                stop.set()
                th.join()
                if k.startswith("reshard convert SRC s3"):
                    peak_scratch = max(peak_scratch, peak[0])
                times[k].append(t)
                rss[k] = max(rss[k], r)
        # the outputs equal the local conversion's
        got = {o["Key"][len("conv/"):]: s3.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()
               for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="conv/")["Contents"]}
        assert got == {f.name: f.read_bytes() for f in local_conv.iterdir()}, "upload differs"
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run([str(bin_), "convert", src_url, str(out), "--to", "2", "-q"], check=True, env=env)
        assert {f.name: f.read_bytes() for f in out.iterdir()} == \
            {f.name: f.read_bytes() for f in local_conv.iterdir()}, "download differs"

        print(f"\n{a.rounds} shuffled rounds, medians; page cache warm for local files; "
              f"load average {os.getloadavg()[0]:.2f}\n")
        print("| run | seconds | MiB/s | ratio to its boto3 row | requests | peak RSS |")
        print("|---|---:|---:|---:|---:|---:|")
        med = {k: statistics.median(v) for k, v in times.items()}
        base = {"reshard convert s3://SRC OUT --to 2": "boto3 download of the source",
                "reshard convert SRC s3://OUT --to 2": "boto3 upload of the local --to 2 output"}
        base.update({"baseline: " + k: v for k, v in base.items()})
        for k in cases:
            ratio = f"{med[k] / med[base[k]]:.2f}x" if k in base else ""
            n = statistics.median(reqs[k]) if not k.startswith("cp ") else ""
            n = f"{n:.0f}" if n != "" else ""
            print(f"| {k} | {med[k]:.2f} | {size / 2**20 / med[k]:.0f} | {ratio} | {n} | {rss[k] / 2**20:.0f} MiB |")
        print("\nall rounds (seconds):")
        for k in cases:
            print(f"- {k}: " + ", ".join(f"{t:.2f}" for t in times[k]))
        print(f"\npeak scratch disk of the upload: {peak_scratch / 2**20:.0f} MiB "
              f"(output {size / 2**20:.0f} MiB)")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
