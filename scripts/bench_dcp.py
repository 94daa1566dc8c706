#!/usr/bin/env python3
"""Consolidating a DCP checkpoint: reshard against `cp -r`, torch's `dcp_to_torch_save` and
Lightning's `consolidate_checkpoint` (what `fabric consolidate` runs).

    # a 1.00 GiB Lightning Fabric checkpoint (FSDP1 sharded, AdamW, meta.pt), which all three
    # consolidators accept; --generate creates it with gen_fixtures.py if it is missing
    scripts/setup_venv.sh --lightning
    .venv/bin/python scripts/bench_dcp.py --ckpt /work/big/fabric_fsdp1_w4_f32/checkpoint \\
        --generate 290 --rounds 3 --reshard target/release/reshard

    # a plain torch DCP checkpoint (FSDP2): Lightning refuses it (no meta.pt), its rows are left out
    .venv/bin/python scripts/gen_fixtures.py --out /work/big --only fsdp2_w4_f32 --scale 290
    .venv/bin/python scripts/bench_dcp.py --ckpt /work/big/fsdp2_w4_f32/checkpoint --rounds 5

    # quick check of the script on a tiny fixture
    .venv/bin/python scripts/bench_dcp.py --ckpt tests/fixtures/fabric_fsdp1_w4_f32/checkpoint --rounds 1

`--generate SCALE` runs `gen_fixtures.py --out OUT --only CASE --scale SCALE` when --ckpt
(which must then be OUT/CASE/checkpoint) does not exist; scale 290 gives 1.00 GiB for the
fsdp2_w4_f32 and fabric_fsdp1_w4_f32 cases.

Each round (page cache warm) times `cp -r`, `cp -r && sync`, reshard to one .safetensors file
and to one .pt file (each with and without fsync), torch's `dcp_to_torch_save` and Lightning's
`python -m lightning.fabric.utilities.consolidate_checkpoint CKPT --output_file OUT`, each in a
fresh Python (the time and memory of the imports alone are reported separately, so they can be
subtracted). Lightning's module needs `meta.pt` (a checkpoint saved by Fabric): with
`--lightning auto` (default) its rows are left out when the checkpoint has none or lightning
is not installed; `--lightning yes` makes that an error. (`fabric consolidate` itself needs
`click`, and in lightning 2.6.6 its `--output_file` is declared `click.Path(exists=True)` while
the module refuses an existing output file, so the module is what is timed.)

Before timing, outputs are checked: reshard's .safetensors against `dcp_to_torch_save`'s file
tensor by tensor, and reshard's .pt against `dcp_to_torch_save`'s and Lightning's files, by
`torch.load`ing both and comparing every tensor byte for byte (dtype, shape, bytes) and every
non-tensor value; structural differences (nesting, container and key types, key order,
tensor strides and storage sharing, entries only one side has) are listed as Markdown before
the table. A tensor that differs, or is missing on one side, or a non-tensor value present in
both with different values, stops the run. Prints Markdown.
"""
from __future__ import annotations

import argparse
import importlib.util
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import measure  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
LIGHTNING_MODULE = "lightning.fabric.utilities.consolidate_checkpoint"
DCP_TO_TORCH_SAVE = ("import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as f; "
                     "f(sys.argv[1], sys.argv[2])")


def check(reshard_out: Path, torch_out: Path) -> None:
    code = f"""
import torch
from safetensors.torch import load_file
a = load_file({str(reshard_out)!r})
t = torch.load({str(torch_out)!r}, weights_only=False, mmap=True)
flat = {{}}
def walk(p, v):
    if isinstance(v, dict):
        for k, x in v.items(): walk(p + [str(k)], x)
    elif isinstance(v, list):
        for i, x in enumerate(v): walk(p + [str(i)], x)
    elif isinstance(v, torch.Tensor): flat['.'.join(p)] = v
walk([], t)
assert set(a) == set(flat), set(a) ^ set(flat)
for k in a:
    x, y = a[k], flat[k]
    assert x.dtype == y.dtype and x.shape == y.shape, k
    assert torch.equal(x.contiguous().view(-1).view(torch.uint8), y.contiguous().view(-1).view(torch.uint8)), k
print(len(a), 'tensors equal (.safetensors vs dcp_to_torch_save)', file=sys.stderr)
"""
    subprocess.run([PY, "-c", "import sys\n" + code], check=True)


# ----------------------------------------------------------------------------------------
# .pt against .pt (runs in a child: `bench_dcp.py --_compare A B NAME_A NAME_B`)

def _compare_pt(a_path: str, b_path: str, a_name: str, b_name: str) -> int:
    """Prints a Markdown section; returns 1 when tensors or shared non-tensor values differ."""
    import torch

    def load(p):
        obj = torch.load(p, weights_only=False, mmap=True)
        try:
            torch.load(p, weights_only=True, mmap=True)
            wo = "loads"
        except Exception as e:  # noqa: BLE001
            wo = f"fails ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
        return obj, wo

    def walk(v, path, leaves, containers):
        if isinstance(v, dict):
            containers[path] = (type(v).__name__, [(type(k).__name__, k) for k in v])
            if not v:
                leaves[path] = v
            for k, x in v.items():
                walk(x, path + (k,), leaves, containers)
        elif isinstance(v, (list, tuple)):
            containers[path] = (type(v).__name__, len(v))
            if not v:
                leaves[path] = v
            for i, x in enumerate(v):
                walk(x, path + (i,), leaves, containers)
        else:
            leaves[path] = v

    def dotted(path):
        return ".".join(str(k) for k in path)

    def raw(t):
        return t.detach().contiguous().reshape(-1).view(torch.uint8)

    def tinfo(t):
        return (f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} stride {list(t.stride())} "
                f"offset {t.storage_offset()} storage {t.untyped_storage().nbytes()} B"
                + (" requires_grad" if t.requires_grad else ""))

    (a, a_wo), (b, b_wo) = load(a_path), load(b_path)
    la, ca, lb, cb = {}, {}, {}, {}
    walk(a, (), la, ca)
    walk(b, (), lb, cb)
    da = {dotted(p): p for p in la}
    db = {dotted(p): p for p in lb}
    errors, notes = [], []
    notes.append(f"file size: {a_name} {Path(a_path).stat().st_size:,} B, {b_name} {Path(b_path).stat().st_size:,} B")
    notes.append(f"`torch.load(weights_only=True)`: {a_name} {a_wo}; {b_name} {b_wo}")
    ta = sum(isinstance(v, torch.Tensor) for v in la.values())
    tb = sum(isinstance(v, torch.Tensor) for v in lb.values())
    notes.append(f"leaves: {a_name} {ta} tensors + {len(la) - ta} other, {b_name} {tb} tensors + {len(lb) - tb} other")
    top = lambda o: list(o) if isinstance(o, dict) else len(o) if isinstance(o, (list, tuple)) else "?"
    notes.append(f"top level: {a_name} {type(a).__name__} {top(a)}, {b_name} {type(b).__name__} {top(b)}")
    for k in sorted(set(da) - set(db)):
        v = la[da[k]]
        (errors if isinstance(v, torch.Tensor) else notes).append(
            f"only in {a_name}: `{k}` = {tinfo(v) if isinstance(v, torch.Tensor) else repr(v)[:120]}")
    for k in sorted(set(db) - set(da)):
        v = lb[db[k]]
        (errors if isinstance(v, torch.Tensor) else notes).append(
            f"only in {b_name}: `{k}` = {tinfo(v) if isinstance(v, torch.Tensor) else repr(v)[:120]}")
    nest, ntensor, nother = [], 0, 0
    for k in sorted(set(da) & set(db)):
        pa, pb = da[k], db[k]
        if pa != pb:
            nest.append(f"`{k}`: {a_name} {list(pa)!r} vs {b_name} {list(pb)!r}")
        x, y = la[pa], lb[pb]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                errors.append(f"`{k}`: {type(x).__name__} in {a_name}, {type(y).__name__} in {b_name}")
                continue
            ntensor += 1
            if x.dtype != y.dtype or x.shape != y.shape:
                errors.append(f"`{k}`: {tinfo(x)} vs {tinfo(y)}")
            elif not torch.equal(raw(x), raw(y)):
                errors.append(f"`{k}`: bytes differ")
            elif (x.stride(), x.storage_offset(), x.untyped_storage().nbytes(), x.requires_grad) != \
                    (y.stride(), y.storage_offset(), y.untyped_storage().nbytes(), y.requires_grad):
                notes.append(f"`{k}` (equal bytes): {a_name} {tinfo(x)}, {b_name} {tinfo(y)}")
        else:
            nother += 1
            if type(x) is not type(y) or x != y:
                errors.append(f"non-tensor `{k}`: {a_name} {x!r:.120} ({type(x).__name__}), "
                              f"{b_name} {y!r:.120} ({type(y).__name__})")
    if nest:
        notes.append(f"key nesting differs for {len(nest)} shared leaves, e.g.: " + "; ".join(nest[:4]))
    # containers at the same path: type, key types, key order
    kinds = {}
    for p in sorted(set(ca) & set(cb), key=lambda p: (len(p), dotted(p))):
        (ta_, ka), (tb_, kb) = ca[p], cb[p]
        where = f"`{dotted(p) or '<top>'}`"
        if ta_ != tb_:
            kinds.setdefault((ta_, tb_), []).append(where)
        if isinstance(ka, list) and isinstance(kb, list):
            kta = sorted({t for t, _ in ka})
            ktb = sorted({t for t, _ in kb})
            if kta != ktb:
                notes.append(f"{where}: key types {kta} in {a_name}, {ktb} in {b_name}")
            elif [k for _, k in ka] != [k for _, k in kb] and set(k for _, k in ka) == set(k for _, k in kb):
                notes.append(f"{where}: same keys, different order")
        elif ka != kb:
            notes.append(f"{where}: {ta_} of {ka} in {a_name}, {tb_} of {kb} in {b_name}")
    for (ta_, tb_), ws in kinds.items():
        notes.append(f"container type {ta_} in {a_name}, {tb_} in {b_name} at {len(ws)} path(s): {', '.join(ws[:6])}")
    # storage sharing between tensors
    def shared(leaves):
        seen = {}
        for p, v in leaves.items():
            if isinstance(v, torch.Tensor):
                seen.setdefault(v.untyped_storage().data_ptr(), []).append(dotted(p))
        return [g for g in seen.values() if len(g) > 1]
    for name, leaves in ((a_name, la), (b_name, lb)):
        groups = shared(leaves)
        if groups:
            notes.append(f"{name}: {len(groups)} storage(s) shared by several tensors, e.g. {groups[:3]}")
    print(f"\n### {a_name} vs {b_name}\n")
    print(f"- {ntensor} tensors compared byte for byte, {nother} non-tensor values compared: "
          + ("**all equal**" if not errors else f"**{len(errors)} difference(s)**"))
    for e in errors[:50]:
        print(f"- DIFFERENCE: {e}")
    for n in notes:
        print(f"- {n}")
    return 1 if errors else 0


def compare_pt(a: Path, b: Path, a_name: str, b_name: str) -> None:
    r = subprocess.run([PY, __file__, "--_compare", str(a), str(b), a_name, b_name])
    if r.returncode != 0:
        sys.exit(f"{a_name} and {b_name} differ (see above); not timing")


# ----------------------------------------------------------------------------------------

def lightning_available() -> bool:
    return importlib.util.find_spec("lightning") is not None


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--_compare":
        sys.exit(_compare_pt(*sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", type=Path, required=True, help="DCP checkpoint directory")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/work/reshard-bench-dcp"))
    ap.add_argument("--reshard", type=Path, default=ROOT / "target/release/reshard")
    ap.add_argument("--lightning", choices=("auto", "yes", "no"), default="auto",
                    help="time Lightning's consolidate_checkpoint (auto: if installed and CKPT has meta.pt)")
    ap.add_argument("--generate", type=int, metavar="SCALE",
                    help="if CKPT (OUT/CASE/checkpoint) is missing, run gen_fixtures.py --out OUT --only CASE --scale SCALE")
    args = ap.parse_args()
    src = args.ckpt.resolve()
    if not args.reshard.exists():
        sys.exit(f"{args.reshard} not found: run cargo build --release (or pass --reshard)")
    if not src.is_dir():
        if args.generate is None:
            sys.exit(f"{src} not found (--generate SCALE creates it with scripts/gen_fixtures.py)")
        if src.name != "checkpoint":
            sys.exit(f"--generate needs --ckpt OUT/CASE/checkpoint, got {src}")
        cmd = [PY, str(ROOT / "scripts/gen_fixtures.py"), "--out", str(src.parent.parent), "--only", src.parent.name,
               "--scale", str(args.generate)]
        print("generating:", " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True)
    reshard = str(args.reshard.resolve())

    why_not = None
    if not lightning_available():
        why_not = "lightning is not installed (scripts/setup_venv.sh --lightning)"
    elif not (src / "meta.pt").is_file():
        why_not = (f"{src} has no meta.pt: Lightning's consolidate_checkpoint refuses checkpoints not saved by Fabric "
                   "(e.g. gen_fixtures.py --only fabric_fsdp1_w4_f32 --scale 290)")
    if why_not and args.lightning == "yes":
        sys.exit(why_not)
    with_lightning = args.lightning != "no" and why_not is None
    if why_not and args.lightning == "auto":
        print(f"leaving out Lightning: {why_not}", file=sys.stderr)

    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    size = sum(p.stat().st_size for p in src.iterdir() if p.is_file())
    print(f"checkpoint {src}: {size / 2**30:.2f} GiB ({size:,} B) in {sum(1 for _ in src.iterdir())} files",
          file=sys.stderr)

    # correctness first
    st, pt, tpt, lpt = (args.work / n for n in ("check.safetensors", "check.pt", "check-torch.pt", "check-lightning.pt"))
    subprocess.run([reshard, "convert", str(src), str(st), "--to", "1", "-q"], check=True)
    subprocess.run([reshard, "convert", str(src), str(pt), "--to", "1", "-q"], check=True)
    subprocess.run([PY, "-c", DCP_TO_TORCH_SAVE, str(src), str(tpt)], check=True)
    check(st, tpt)
    print(f"## Outputs compared: {src}")
    compare_pt(pt, tpt, "reshard .pt", "dcp_to_torch_save")
    if with_lightning:
        subprocess.run([PY, "-m", LIGHTNING_MODULE, str(src), "--output_file", str(lpt)], check=True)
        compare_pt(pt, lpt, "reshard .pt", "Lightning")
    print(flush=True)
    for p in (st, pt, tpt, lpt):
        p.unlink(missing_ok=True)

    rs = lambda d, ext, *extra: [reshard, "convert", str(src), str(d) + ext, "--to", "1", "-q", *extra]
    cases = {
        "`cp -r`": lambda d: ["cp", "-r", str(src), str(d)],
        "`cp -r && sync`": lambda d: ["sh", "-c", f"cp -r '{src}' '{d}' && sync"],
        "reshard → `.safetensors` `--no-fsync`": lambda d: rs(d, ".safetensors", "--no-fsync"),
        "reshard → `.safetensors`": lambda d: rs(d, ".safetensors"),
        "reshard → `.pt` `--no-fsync`": lambda d: rs(d, ".pt", "--no-fsync"),
        "reshard → `.pt`": lambda d: rs(d, ".pt"),
        "Python: `import torch.distributed.checkpoint` only": lambda d: [PY, "-c", "import torch.distributed.checkpoint"],
        "torch `dcp_to_torch_save` (import included)": lambda d: [PY, "-c", DCP_TO_TORCH_SAVE, str(src), str(d) + ".pt"],
    }
    if with_lightning:
        cases["Python: `import " + LIGHTNING_MODULE + "` only"] = lambda d: [PY, "-c", f"import {LIGHTNING_MODULE}"]
        cases["Lightning `consolidate_checkpoint` (import included)"] = \
            lambda d: [PY, "-m", LIGHTNING_MODULE, str(src), "--output_file", str(d) + ".pt"]
    subprocess.run(["sh", "-c", f"cat '{src}'/* > /dev/null"], check=True)
    results = {k: [] for k in cases}
    for r in range(args.rounds):
        for i, (name, mk) in enumerate(cases.items()):
            d = args.work / f"out-{r}-{i}"
            results[name].append(measure(mk(d)))
            shutil.rmtree(d, ignore_errors=True)
            for ext in (".safetensors", ".pt"):
                Path(str(d) + ext).unlink(missing_ok=True)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    cp = statistics.median(w for w, _, _ in results["`cp -r`"])
    print(f"## {size / 2**30:.2f} GiB, {args.rounds} paired round(s), medians\n")
    print("| case | median wall (s) | ratio to `cp -r` | peak RSS (MiB) | peak RssAnon (MiB) |")
    print("|---|---|---|---|---|")
    for name, rs_ in results.items():
        w = statistics.median(x[0] for x in rs_)
        print(f"| {name} | {w:.3f} | {w / cp:.2f} | {max(x[1] for x in rs_) / 2**20:.0f} "
              f"| {max(x[2] for x in rs_) / 2**20:.1f} |")
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
