#!/usr/bin/env python3
"""reshard against `cp -r` and torch's, Lightning's and accelerate's tools, on real checkpoints
of 1 GiB and 4 GiB (issue #5). Writes BENCHMARKS.md's comparison section and a plot.

    scripts/setup_venv.sh --bench
    cargo build --release
    .venv/bin/python scripts/compare.py --work /work/big --rounds 5 --write

Checkpoints are generated with the project's torch generator (scripts/gen_fixtures.py: real
torch, several gloo CPU processes) under WORK/gen-<GiB>/<case>/checkpoint and kept for later
runs (the oracle directories are deleted: torch's own tools are the judges here):

  fsdp2      FSDP2 `fully_shard`, Shard(0) over 4 ranks, f32, AdamW state  (1 and 4 GiB)
  fsdp2_w8   the same over 8 ranks                                           (1 GiB)
  bf16       FSDP2 over 4 ranks in bfloat16                                  (1 GiB)
  mesh2d     a 2-D (dp=2, tp=2) mesh: TP colwise/rowwise + FSDP2, _StridedShard, Shard(1)
                                                                           (1 GiB)
and, for the size curve, fsdp2 at 0.25, 0.5 and 2 GiB as well.

A `meta.pt` holding `{"epoch": 0}` is added to each DCP checkpoint (what Fabric saves beside
the shards), so that Lightning's consolidation accepts them. Derived inputs for the peers that
read other forms are made once with reshard and checked by torch: the same shards as
HF-storage safetensors (`hf4`, torch's `consolidate_safetensors_files` input) and the model
alone as DCP (`model4`, what `accelerate merge-weights` merges).

Every output is checked before any time counts: reshard's (each format, each world size) and
each peer's tensors are compared byte for byte with `dcp_to_torch_save`'s consolidation of the
same source (reshard's N-rank outputs are first consolidated by torch: DCP by
`dcp_to_torch_save`, HF storage by `consolidate_safetensors_files`). A difference stops the run.

Timing: every tool and case runs once per round, rounds repeated --rounds times (paired
runs: all rows of a round see the same machine state), medians reported. Warm: the sources
were just read (page cache warm). Cold: before each run the sources' pages are dropped with
posix_fadvise(DONTNEED) after a sync. Each run is preceded by `sync` (not timed) so that
earlier write-back does not land in it. Python tools run in a fresh interpreter; their import
time is measured separately. Peak RSS is VmHWM, peak RssAnon is sampled every 2 ms.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import measure  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
GEN_CASE = {"fsdp2": "fsdp2_w4_f32", "fsdp2_w8": "fsdp2_w8_f32", "bf16": "fsdp2_w4_bf16", "mesh2d": "dtensor2d_w4"}
# gen_fixtures --scale giving 1 GiB for each case; size grows as scale^2
SCALE_1G = {"fsdp2": 290, "fsdp2_w8": 290, "bf16": 410, "mesh2d": 270}
BEGIN, END = "<!-- compare.py:begin -->", "<!-- compare.py:end -->"
LIGHTNING = "lightning.fabric.utilities.consolidate_checkpoint"

DCP_TO_TORCH_SAVE = ("import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as f; "
                     "f(sys.argv[1], sys.argv[2])")
CONSOLIDATE_HF = """import sys, os, glob
os.makedirs(sys.argv[2], exist_ok=True)
from safetensors import safe_open
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files as f
names = set()
for p in glob.glob(sys.argv[1] + '/*.safetensors'):
    with safe_open(p, 'pt') as s:
        names.update(s.keys())
f(sys.argv[1], sys.argv[2], {n: 1 for n in names}, num_threads=int(sys.argv[3]))
"""

# ----------------------------------------------------------------------------------------
# checking


def _flatten(obj, prefix=""):
    import torch
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, (list, tuple)) and not (obj and not isinstance(obj[0], (dict, list, tuple, torch.Tensor))):
        for i, v in enumerate(obj):
            out.update(_flatten(v, f"{prefix}{i}."))
    elif isinstance(obj, torch.Tensor):
        out[prefix[:-1]] = obj
    return out


def load_tensors(path: Path) -> dict:
    """name -> tensor of a .pt / .safetensors file or an HF directory (one file + index)."""
    import torch
    from safetensors.torch import load_file
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        out = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    if path.suffix == ".safetensors":
        return load_file(str(path))
    return _flatten(torch.load(str(path), weights_only=False, mmap=True, map_location="cpu"))


def same_tensors(got: dict, want: dict, what: str, names=None) -> int:
    import torch
    want = {k: v for k, v in want.items() if names is None or k in names}
    if set(got) != set(want):
        sys.exit(f"{what}: tensor names differ: only in output {sorted(set(got) - set(want))[:5]}, "
                 f"only in torch's {sorted(set(want) - set(got))[:5]}")
    for k, x in got.items():
        y = want[k]
        if x.dtype != y.dtype or x.shape != y.shape:
            sys.exit(f"{what}: `{k}` is {x.dtype}{list(x.shape)}, torch's is {y.dtype}{list(y.shape)}")
        if not torch.equal(x.contiguous().reshape(-1).view(torch.uint8), y.contiguous().reshape(-1).view(torch.uint8)):
            sys.exit(f"{what}: `{k}` differs")
    return len(got)


# ----------------------------------------------------------------------------------------
# running


def run(cmd, **kw):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(map(str, cmd))}\n{r.stderr[-3000:]}")
    return r


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def evict(d: Path) -> None:
    """Drop the page cache of every file under `d` (clean pages: sync first)."""
    os.sync()
    for p in d.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def warm(d: Path) -> None:
    for p in d.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(8 << 20):
                    pass


def remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists() or p.is_symlink():
        p.unlink()


def generate(work: Path, key: str, gib: float, reshard: str) -> Path:
    scale = max(8, round(SCALE_1G[key] * math.sqrt(gib)))
    out = work / f"gen-{gib:g}"
    ck = out / GEN_CASE[key] / "checkpoint"
    if not ck.is_dir():
        print(f"generating {GEN_CASE[key]} at scale {scale} (~{gib:g} GiB) under {out} ...", file=sys.stderr, flush=True)
        t = time.time()
        run([PY, ROOT / "scripts/gen_fixtures.py", "--out", out, "--only", GEN_CASE[key], "--scale", scale])
        shutil.rmtree(out / GEN_CASE[key] / "oracle", ignore_errors=True)
        print(f"  done in {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    if not (ck / "meta.pt").exists():
        run([PY, "-c", f"import torch; torch.save({{'epoch': 0}}, {str(ck / 'meta.pt')!r})"])
    return ck


class Case:
    """One source checkpoint: its rows, checked once, then timed per round."""

    def __init__(self, name: str, src: Path, gib: float, work: Path):
        self.name, self.src, self.gib, self.work = name, src, gib, work
        self.bytes = dir_bytes(src)
        self.rows: list[tuple[str, str, Path, callable, str]] = []  # (label, kind, input, cmd(dst), ext)
        self.results: dict[str, dict] = {}

    def add(self, label, kind, inp, cmd, ext=""):
        self.rows.append((label, kind, inp, cmd, ext))


# the generated checkpoints hold per-rank RNG state (extra.rng); M > 1 keeps rank 0's
PER_RANK = ["--per-rank-state", "rank0"]


def reshard_cmd(reshard, src, to, *extra):
    return lambda d: [reshard, "convert", src, d, "--to", str(to), "-q", *PER_RANK, *extra]


def build_case(key: str, gib: float, args, full: bool) -> Case:
    rs = str(args.reshard)
    src = generate(args.work, key, gib, rs)
    case = Case(f"{key} {gib:g} GiB", src, gib, args.work / "run")
    w = case.work
    remove(w)
    w.mkdir(parents=True)
    print(f"== {case.name}: {src} ({case.bytes / 2**30:.2f} GiB)", file=sys.stderr, flush=True)
    # torch's consolidation is the reference for every check
    ref = args.work / f"ref-{key}-{gib:g}.pt"
    if not ref.exists():
        run([PY, "-c", DCP_TO_TORCH_SAVE, src, ref])
    want = load_tensors(ref)
    # torch's consolidate_safetensors_files (torch 2.15) handles floating dtypes only (it calls
    # torch.finfo on each dtype) and writes 0-d tensors as 0, even in shards torch's own
    # HuggingFaceStorageWriter wrote: HF-storage outputs it judges or consolidates leave out
    # those few tensors (optimizer steps, int/bool extras)
    hf_skip = {k for k, v in want.items() if not v.is_floating_point() or v.dim() == 0}
    hf_excl = [a for k in sorted(hf_skip) for a in ("--exclude", k)]

    def check_reshard(label, dst_args, judge):
        d = w / "check"
        remove(d)
        out = d.with_suffix(judge[1]) if judge[1] else d
        run([rs, "convert", src, out, "-q", *PER_RANK, *dst_args])
        if judge[0] == "file":
            got = load_tensors(out)
        elif judge[0] == "dcp":
            t = w / "judge.pt"
            run([PY, "-c", DCP_TO_TORCH_SAVE, out, t])
            got = load_tensors(t)
            remove(t)
        else:  # hf-storage, consolidated by torch
            t = w / "judge"
            run([PY, "-c", CONSOLIDATE_HF, out, t, "1"])
            got = load_tensors(t)
            remove(t)
        names = None if judge[0] != "hf" else set(got)
        n = same_tensors(got, want, f"{case.name}: {label}", names)
        if judge[0] == "hf" and n < len(want) - len(hf_skip):
            sys.exit(f"{case.name}: {label}: only {n} tensors")
        remove(out)
        print(f"  checked {label}: {n} tensors equal torch's", file=sys.stderr, flush=True)

    case.add("`cp -r`", "copy", src, lambda d: ["cp", "-r", src, d])
    checks = []
    n = {"fsdp2": 4, "fsdp2_w8": 8, "bf16": 4, "mesh2d": 4}[key]
    checks.append((f"reshard {n}→1 `.safetensors`", ["--to", "1"], ("file", ".safetensors")))
    case.add(f"reshard {n}→1 `.safetensors`", "reshard", src, reshard_cmd(rs, src, 1, "--no-fsync"), ".safetensors")
    if full or key != "fsdp2":
        checks.append((f"reshard {n}→1 `.pt`", ["--to", "1"], ("file", ".pt")))
        case.add(f"reshard {n}→1 `.pt`", "reshard", src, reshard_cmd(rs, src, 1, "--no-fsync"), ".pt")
    if full and key in ("fsdp2", "mesh2d"):
        checks.append((f"reshard {n}→1 DCP", ["--to", "1", "--format", "dcp"], ("dcp", "")))
        case.add(f"reshard {n}→1 DCP", "reshard", src, reshard_cmd(rs, src, 1, "--no-fsync", "--format", "dcp"))
        checks.append((f"reshard {n}→8 DCP", ["--to", "8", "--format", "dcp"], ("dcp", "")))
        case.add(f"reshard {n}→8 DCP", "reshard", src, reshard_cmd(rs, src, 8, "--no-fsync", "--format", "dcp"))
        checks.append((f"reshard {n}→8 HF storage", ["--to", "8", "--format", "hf-storage", *hf_excl], ("hf", "")))
        case.add(f"reshard {n}→8 HF storage", "reshard", src,
                 reshard_cmd(rs, src, 8, "--no-fsync", "--format", "hf-storage", *hf_excl))
    if key == "fsdp2_w8":
        checks.append(("reshard 8→3 DCP", ["--to", "3", "--format", "dcp"], ("dcp", "")))
        case.add("reshard 8→3 DCP", "reshard", src, reshard_cmd(rs, src, 3, "--no-fsync", "--format", "dcp"))
        checks.append(("reshard 8→3 HF storage", ["--to", "3", "--format", "hf-storage", *hf_excl], ("hf", "")))
        case.add("reshard 8→3 HF storage", "reshard", src,
                 reshard_cmd(rs, src, 3, "--no-fsync", "--format", "hf-storage", *hf_excl))
    if full and key == "fsdp2":
        case.add("reshard 4→1 `.safetensors` (fsync)", "reshard", src, reshard_cmd(rs, src, 1), ".safetensors")
        case.add("reshard 4→1 `.safetensors` `--no-verify`", "reshard", src,
                 reshard_cmd(rs, src, 1, "--no-fsync", "--no-verify"), ".safetensors")
    if key == "bf16":
        # a cast: bf16 -> f32 doubles the bytes written
        d = w / "cast.safetensors"
        run([rs, "convert", src, d, "--to", "1", "-q", "--dtype", "f32"])
        got = load_tensors(d)
        import torch
        # --dtype casts every f16/bf16/f64 tensor; ints, bool and fp8 stay
        casts = (torch.bfloat16, torch.float16, torch.float64)
        want32 = {k: (v.float() if v.dtype in casts else v) for k, v in want.items()}
        same_tensors(got, want32, f"{case.name}: --dtype f32")
        remove(d)
        case.add("reshard 4→1 `.safetensors` `--dtype f32`", "reshard", src,
                 reshard_cmd(rs, src, 1, "--no-fsync", "--dtype", "f32"), ".safetensors")
    for label, a, judge in checks:
        check_reshard(label, a, judge)

    # peers
    case.add("torch `dcp_to_torch_save`", "peer", src, lambda d: [PY, "-c", DCP_TO_TORCH_SAVE, src, d], ".pt")
    if args.lightning:
        t = w / "lightning.pt"
        run([PY, "-m", LIGHTNING, src, "--output_file", t])
        same_tensors(load_tensors(t), want, f"{case.name}: Lightning")
        remove(t)
        case.add("Lightning `consolidate_checkpoint`", "peer", src,
                 lambda d: [PY, "-m", LIGHTNING, src, "--output_file", d], ".pt")
    if full and key == "fsdp2":
        # the same shards as HF storage, for torch's consolidate_safetensors_files
        hf = args.work / f"hf4-{key}-{gib:g}"
        if not hf.is_dir():
            run([rs, "convert", src, hf, "--to", "4", "--format", "hf-storage", "-q", *PER_RANK, *hf_excl])
        t = w / "hf-judge"
        run([PY, "-c", CONSOLIDATE_HF, hf, t, "2"])
        got = load_tensors(t)
        same_tensors(got, want, f"{case.name}: consolidate_safetensors_files", set(got))
        remove(t)
        case.add("`cp -r` (HF-storage form)", "copy", hf, lambda d: ["cp", "-r", hf, d])
        case.add("reshard 4→1 `.safetensors` (HF-storage form)", "reshard", hf,
                 lambda d: [rs, "convert", hf, d, "--to", "1", "-q", "--no-fsync"], ".safetensors")
        case.add("torch `consolidate_safetensors_files` (2 threads)", "peer", hf,
                 lambda d: [PY, "-c", CONSOLIDATE_HF, hf, d, "2"])
        if args.accelerate:
            model = args.work / f"model4-{key}-{gib:g}"
            if not model.is_dir():
                run([rs, "convert", src, model, "--to", "4", "--format", "dcp", "-q", "--include", "model.*",
                     "--strip-prefix", "model."])
            t = w / "acc"
            run(["accelerate", "merge-weights", model, t], env={**os.environ, "PATH": f"{Path(PY).parent}:{os.environ['PATH']}"})
            got = load_tensors(t)
            same_tensors(got, {k[6:]: v for k, v in want.items() if k.startswith("model.")},
                         f"{case.name}: accelerate merge-weights")
            remove(t)
            case.add("`cp -r` (model only)", "copy", model, lambda d: ["cp", "-r", model, d])
            case.add("reshard 4→1 `.safetensors` (model only)", "reshard", model,
                     lambda d: [rs, "convert", model, d, "--to", "1", "-q", "--no-fsync"], ".safetensors")
            acc = str(Path(PY).parent / "accelerate")
            case.add("`accelerate merge-weights` (model only)", "peer", model, lambda d: [acc, "merge-weights", model, d])
    del want
    return case


def time_case(case: Case, rounds: int, cold: bool) -> None:
    labels = [r[0] for r in case.rows]
    res = {lab: [] for lab in labels}
    inputs = {r[2] for r in case.rows}
    for i in range(rounds):
        for label, kind, inp, mk, ext in case.rows:
            if cold and kind == "peer" and not label.startswith("torch `dcp"):
                continue
            d = case.work / f"out{ext}"
            remove(d)
            os.sync()
            if cold:
                evict(inp)
            else:
                warm(inp)
            res[label].append(measure([str(c) for c in mk(d)]))
            remove(d)
        print(f"  {case.name} {'cold' if cold else 'warm'} round {i + 1}/{rounds}", file=sys.stderr, flush=True)
    for label, kind, inp, _, _ in case.rows:
        rs = res[label]
        if not rs:
            continue
        cp_label = {r[2]: r[0] for r in case.rows if r[1] == "copy"}[inp]
        case.results.setdefault("cold" if cold else "warm", {})[label] = {
            "kind": kind, "walls": [x[0] for x in rs], "wall": statistics.median(x[0] for x in rs),
            "rss": max(x[1] for x in rs), "anon": max(x[2] for x in rs), "cp": cp_label,
            "input_bytes": dir_bytes(inp)}
    del inputs


def imports(rounds: int) -> dict:
    out = {}
    for label, code in [("torch.distributed.checkpoint", "import torch.distributed.checkpoint"),
                        ("lightning", f"import {LIGHTNING}")]:
        rs = [measure([PY, "-c", code]) for _ in range(rounds)]
        out[label] = (statistics.median(x[0] for x in rs), max(x[1] for x in rs))
    return out


def table(case: Case, mode: str) -> list[str]:
    rows = case.results.get(mode, {})
    lines = ["| tool | median wall (s) | × `cp -r` of its input | peak RSS (MiB) | peak RssAnon (MiB) |",
             "|---|---|---|---|---|"]
    for label, r in rows.items():
        cp = rows[r["cp"]]["wall"]
        lines.append(f"| {label} | {r['wall']:.3f} | {r['wall'] / cp:.2f} | {r['rss'] / 2**20:.0f} | {r['anon'] / 2**20:.1f} |")
    return lines


def plot(curve: list[Case], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    labels = ["`cp -r`", "reshard 4→1 `.safetensors`", "reshard 4→1 `.pt`", "torch `dcp_to_torch_save`",
              "Lightning `consolidate_checkpoint`"]
    for lab in labels:
        pts = [(c.bytes / 2**30, c.results["warm"][lab]["wall"]) for c in curve if lab in c.results.get("warm", {})]
        if len(pts) < 2:
            continue
        xs, ys = zip(*sorted(pts))
        ax.plot(xs, ys, marker="o", label=lab.replace("`", ""))
    ax.set_xlabel("checkpoint size (GiB), FSDP2 Shard(0) over 4 ranks, f32 + AdamW")
    ax.set_ylabel("median wall time (s), page cache warm")
    ax.set_title("Consolidating a DCP checkpoint to one file (2 cores)")
    ax.grid(True, alpha=0.3)
    ax.set_yscale("log")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/work/big"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reshard", type=Path, default=ROOT / "target/release/reshard")
    ap.add_argument("--cases", default="fsdp2,fsdp2_w8,bf16,mesh2d", help="cases at 1 GiB (comma-separated)")
    ap.add_argument("--big", type=float, default=4, help="size of the large fsdp2 case (GiB; 0 = none)")
    ap.add_argument("--curve", default="0.25,0.5,2", help="extra fsdp2 sizes for the size curve (GiB)")
    ap.add_argument("--cold-rounds", type=int, default=5, help="rounds of the cold-cache runs (1 GiB fsdp2)")
    ap.add_argument("--no-peers-above", type=float, default=99, help="skip Lightning above this size (GiB)")
    ap.add_argument("--write", action="store_true", help="rewrite BENCHMARKS.md's section and docs/bench-size.png")
    args = ap.parse_args()
    args.reshard = args.reshard.resolve()
    if not args.reshard.exists():
        sys.exit(f"{args.reshard} not found: cargo build --release")
    import importlib.util
    args.lightning = importlib.util.find_spec("lightning") is not None
    args.accelerate = (Path(PY).parent / "accelerate").exists()
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    cases = []
    for key in [k for k in args.cases.split(",") if k]:
        c = build_case(key, 1, args, full=True)
        time_case(c, args.rounds, cold=False)
        if key == "fsdp2" and args.cold_rounds:
            time_case(c, args.cold_rounds, cold=True)
        cases.append(c)
        remove(c.work)
    curve = [c for c in cases if c.name.startswith("fsdp2 ")]
    sizes = [float(x) for x in args.curve.split(",") if x] + ([args.big] if args.big else [])
    for gib in sizes:
        lightning = args.lightning
        args.lightning = lightning and gib <= args.no_peers_above
        c = build_case("fsdp2", gib, args, full=(gib == args.big))
        args.lightning = lightning
        time_case(c, args.rounds, cold=False)
        curve.append(c)
        remove(c.work)
        if gib == args.big:
            cases.append(c)
    curve.sort(key=lambda c: c.bytes)
    imp = imports(args.rounds)

    out = []
    out.append(f"Generated by `.venv/bin/python scripts/compare.py --work {args.work} --rounds {args.rounds}"
               f"{' --write' if args.write else ''}` on {time.strftime('%Y-%m-%d')} "
               f"({time.time() - t0:.0f} s in all). Machine: {os.cpu_count()} cores, "
               f"{platform.machine()}, Linux {platform.release()}, {PY_VERSIONS()}.")
    out.append("")
    out.append("Medians of paired rounds; the ratio divides by the `cp -r` of the same input directory in the "
               "same rounds. reshard rows run with `--no-fsync` (as `cp -r`, which does not sync) unless they say "
               "fsync; every output was compared byte for byte with torch's own consolidation before timing.")
    for c in cases:
        for mode in ("warm", "cold"):
            if mode in c.results:
                out += ["", f"### {c.name} ({c.bytes / 2**30:.2f} GiB, {c.src.parent.name}), page cache {mode}", ""]
                out += table(c, mode)
    out += ["", "### Time against checkpoint size (FSDP2 Shard(0), 4 ranks, warm)", "",
            "| GiB | " + " | ".join(["`cp -r`", "reshard → .safetensors", "torch dcp_to_torch_save",
                                    "Lightning"]) + " | reshard s/GiB |", "|---|---|---|---|---|---|"]
    for c in curve:
        r = c.results["warm"]
        g = lambda k: f"{r[k]['wall']:.2f}" if k in r else "–"
        out.append(f"| {c.bytes / 2**30:.2f} | {g('`cp -r`')} | {g('reshard 4→1 `.safetensors`')} | "
                   f"{g('torch `dcp_to_torch_save`')} | {g('Lightning `consolidate_checkpoint`')} | "
                   f"{r['reshard 4→1 `.safetensors`']['wall'] / (c.bytes / 2**30):.3f} |")
    out += ["", "Python imports alone (included in the peers' rows): " +
            "; ".join(f"`import {k}` {w:.2f} s, {rss / 2**20:.0f} MiB" for k, (w, rss) in imp.items()) + "."]
    text = "\n".join(out)
    print(text)
    (args.work / "compare-results.json").write_text(json.dumps(
        [{"case": c.name, "bytes": c.bytes, "results": c.results} for c in cases + curve], indent=1))
    if args.write:
        (ROOT / "docs").mkdir(exist_ok=True)
        plot(curve, ROOT / "docs/bench-size.png")
        bm = ROOT / "BENCHMARKS.md"
        s = bm.read_text()
        block = f"{BEGIN}\n{text}\n\n![time against size](docs/bench-size.png)\n{END}"
        if BEGIN in s:
            s = s[:s.index(BEGIN)] + block + s[s.index(END) + len(END):]
        else:
            s = s.rstrip() + "\n\n## Comparison with torch's, Lightning's and accelerate's tools (`scripts/compare.py`)\n\n" \
                + block + "\n"
        bm.write_text(s)
        print(f"wrote {bm} and docs/bench-size.png", file=sys.stderr)


def PY_VERSIONS() -> str:
    r = subprocess.run([PY, "-c", "import torch, sys; print(f'Python {sys.version.split()[0]}, torch {torch.__version__}')"],
                       capture_output=True, text=True)
    v = r.stdout.strip()
    for mod in ("lightning", "accelerate"):
        r = subprocess.run([PY, "-c", f"import {mod}; print({mod}.__version__)"], capture_output=True, text=True)
        if r.returncode == 0:
            v += f", {mod} {r.stdout.strip()}"
    return v


if __name__ == "__main__":
    main()
