#!/usr/bin/env python3
"""Consolidating a DCP checkpoint: reshard against `cp -r` and torch's `dcp_to_torch_save`.

    .venv/bin/python scripts/gen_fixtures.py --out /work/big --only fsdp2_w4_f32 --scale 290
    .venv/bin/python scripts/bench_dcp.py --ckpt /work/big/fsdp2_w4_f32/checkpoint --rounds 5

Each round (page cache warm) times `cp -r`, `cp -r && sync`, reshard to one .safetensors file
(with and without fsync), and torch's `dcp_to_torch_save` in a fresh Python (the time and
memory of `import torch` are reported separately, so they can be subtracted). Before timing,
reshard's output is checked tensor by tensor against torch's consolidated file.
Prints a Markdown table.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import measure  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


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
print(len(a), 'tensors equal')
"""
    subprocess.run([PY, "-c", code], check=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/work/reshard-bench-dcp"))
    ap.add_argument("--reshard", type=Path, default=ROOT / "target/release/reshard")
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    src = args.ckpt
    size = sum(p.stat().st_size for p in src.iterdir())
    print(f"checkpoint {src}: {size / 2**30:.2f} GiB", file=sys.stderr)
    st, pt = args.work / "check.safetensors", args.work / "check.pt"
    subprocess.run([str(args.reshard), "convert", str(src), str(st), "--to", "1", "-q"], check=True)
    subprocess.run([PY, "-c", "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as f; f(sys.argv[1], sys.argv[2])", str(src), str(pt)], check=True)
    check(st, pt)
    st.unlink()
    pt.unlink()
    cases = {
        "cp -r": lambda d: ["cp", "-r", str(src), str(d)],
        "cp -r && sync": lambda d: ["sh", "-c", f"cp -r '{src}' '{d}' && sync"],
        "reshard -> .safetensors --no-fsync": lambda d: [str(args.reshard), "convert", str(src), str(d) + ".safetensors", "--to", "1", "-q", "--no-fsync"],
        "reshard -> .safetensors": lambda d: [str(args.reshard), "convert", str(src), str(d) + ".safetensors", "--to", "1", "-q"],
        "reshard -> .pt": lambda d: [str(args.reshard), "convert", str(src), str(d) + ".pt", "--to", "1", "-q"],
        "python: import torch only": lambda d: [PY, "-c", "import torch.distributed.checkpoint"],
        "torch dcp_to_torch_save": lambda d: [PY, "-c", "import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as f; f(sys.argv[1], sys.argv[2])", str(src), str(d) + ".pt"],
    }
    subprocess.run(["sh", "-c", f"cat '{src}'/* > /dev/null"], check=True)
    results = {k: [] for k in cases}
    for r in range(args.rounds):
        for i, (name, mk) in enumerate(cases.items()):
            d = args.work / f"out-{r}-{i}"
            results[name].append(measure(mk(d)))
            shutil.rmtree(d, ignore_errors=True)
            for ext in (".safetensors", ".pt"):
                Path(str(d) + ext).unlink(missing_ok=True)
    cp = statistics.median(w for w, _, _ in results["cp -r"])
    print("| case | median wall (s) | ratio to cp -r | peak RSS (MiB) | peak RssAnon (MiB) |")
    print("|---|---|---|---|---|")
    for name, rs in results.items():
        w = statistics.median(x[0] for x in rs)
        print(f"| {name} | {w:.3f} | {w / cp:.2f} | {max(x[1] for x in rs) / 2**20:.0f} | {max(x[2] for x in rs) / 2**20:.1f} |")
    shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
