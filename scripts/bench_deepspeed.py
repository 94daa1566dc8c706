#!/usr/bin/env python3
"""Consolidating a DeepSpeed ZeRO-3 checkpoint: reshard against DeepSpeed's own
`zero_to_fp32` (`convert_zero_checkpoint_to_state_dict`) on the same files, and `cp`.

    # a ZeRO-3 checkpoint of a 1 GiB fp32 model (16 x Linear(4096, 4096)), written by
    # DeepSpeed itself under torchrun (2 CPU ranks, gloo, one AdamW step): 3 GiB of files
    scripts/setup_venv.sh --deepspeed
    .venv/bin/python scripts/bench_deepspeed.py --make /work/big/zero3 --size-gb 1
    .venv/bin/python scripts/bench_deepspeed.py --ckpt /work/big/zero3 --rounds 5

Each round (page cache warm, paired: every case once per round, in this order) times:
- `cp -r` of the checkpoint folder, and `cp` of the consolidated file (the bytes written);
- `reshard convert CKPT out.safetensors --to 1 --exclude 'optimizer.*'` (the fp32 weights, what
  zero_to_fp32 gives), with and without `--no-fsync`, and with the optimizer state too;
- DeepSpeed's `convert_zero_checkpoint_to_state_dict(ckpt, out, safe_serialization=True,
  max_shard_size=None)` in a fresh Python, and that Python's imports alone.
Wall time, peak RSS (`VmHWM`) and peak RssAnon (sampled every 2 ms). Before timing,
reshard's file is checked against zero_to_fp32's, tensor by tensor, byte for byte. Prints
Markdown.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import measure  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
ZERO_TO_FP32 = ("import sys; from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict as f; "
                "f(sys.argv[1], sys.argv[2], safe_serialization=True, max_shard_size=None)")
IMPORT_ONLY = "from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict"
WIDTH = 4096


def make_worker(out: str, layers: int) -> None:
    """One rank of the DeepSpeed job that writes the checkpoint (under torchrun)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist
    from torch import nn

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cfg = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    x = torch.randn(1, WIDTH)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out, tag="global_step1")
    dist.barrier()
    dist.destroy_process_group()


def make(out: Path, size_gb: float) -> None:
    layers = max(1, round(size_gb * 2**30 / (4 * (WIDTH * WIDTH + WIDTH))))
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               PATH=f"{Path(PY).parent}:{os.environ.get('PATH', '')}")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache/reshard/torch_extensions"))
    cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", "29533", __file__, "--worker", str(out), "--layers", str(layers)]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        (out / script).unlink(missing_ok=True)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"bench_deepspeed: {out}: {layers} layers, {size / 2**30:.2f} GiB of files", file=sys.stderr)


def check(reshard_out: Path, ds_out: Path) -> int:
    """reshard's file equals zero_to_fp32's: the same names, dtypes, shapes and bytes."""
    import torch
    from safetensors import safe_open

    def raw(t):
        return t.contiguous().reshape(-1).view(torch.uint8)

    with safe_open(str(reshard_out), "pt") as a, safe_open(str(ds_out), "pt") as b:
        if set(a.keys()) != set(b.keys()):
            sys.exit(f"tensor sets differ: {sorted(set(a.keys()) ^ set(b.keys()))[:5]}")
        for k in b.keys():
            x, y = a.get_tensor(k), b.get_tensor(k)
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(raw(x), raw(y)):
                sys.exit(f"tensor {k} differs")
        return len(list(b.keys()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--make", type=Path, help="write a ZeRO-3 checkpoint here with DeepSpeed")
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--ckpt", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/tmp/reshard-bench-ds"))
    ap.add_argument("--reshard", type=Path, default=ROOT / "target/release/reshard")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return make_worker(args.worker, args.layers)
    if args.make:
        return make(args.make, args.size_gb)
    if not args.ckpt:
        ap.error("give --make DIR or --ckpt DIR")
    if not args.reshard.exists():
        sys.exit(f"{args.reshard} not found: cargo build --release")
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    w = args.work
    ck = str(args.ckpt)
    rs = str(args.reshard)
    weights = ["--exclude", "optimizer.*"]
    cases = {
        "`cp -r` of the checkpoint": (["cp", "-r", ck, str(w / "copy")], [w / "copy"]),
        "`cp` of the consolidated file": (["cp", str(w / "ref.safetensors"), str(w / "copy.safetensors")], [w / "copy.safetensors"]),
        "reshard → `.safetensors`, weights `--no-fsync`": (
            [rs, "convert", ck, str(w / "a.safetensors"), "--to", "1", "-q", "--no-fsync", *weights], [w / "a.safetensors"]),
        "reshard → `.safetensors`, weights": (
            [rs, "convert", ck, str(w / "b.safetensors"), "--to", "1", "-q", *weights], [w / "b.safetensors"]),
        "reshard → `.safetensors`, weights and optimizer state `--no-fsync`": (
            [rs, "convert", ck, str(w / "c.safetensors"), "--to", "1", "-q", "--no-fsync"], [w / "c.safetensors"]),
        "DeepSpeed `zero_to_fp32` → `.safetensors`": ([PY, "-c", ZERO_TO_FP32, ck, str(w / "ds")], [w / "ds"]),
        "Python: `import deepspeed.utils.zero_to_fp32` only": ([PY, "-c", IMPORT_ONLY], []),
    }
    # correctness first
    subprocess.run([rs, "convert", ck, str(w / "ref.safetensors"), "--to", "1", "-q", *weights], check=True)
    subprocess.run([PY, "-c", ZERO_TO_FP32, ck, str(w / "ds")], check=True, capture_output=True)
    n = check(w / "ref.safetensors", w / "ds" / "model.safetensors")
    shutil.rmtree(w / "ds")
    print(f"bench_deepspeed: reshard's file equals zero_to_fp32's: {n} tensors", file=sys.stderr)
    results: dict[str, list[tuple[float, int, int]]] = {k: [] for k in cases}
    for r in range(args.rounds):
        for name, (cmd, outs) in cases.items():
            for o in outs:
                shutil.rmtree(o, ignore_errors=True) if o.is_dir() else o.unlink(missing_ok=True)
            results[name].append(measure(cmd))
        print(f"bench_deepspeed: round {r + 1}/{args.rounds} done", file=sys.stderr)
    size = sum(p.stat().st_size for p in args.ckpt.rglob("*") if p.is_file())
    out_size = (w / "ref.safetensors").stat().st_size
    base = statistics.median(t for t, _, _ in results["`cp` of the consolidated file"])
    print(f"ZeRO-3 checkpoint of {size / 2**30:.2f} GiB ({args.ckpt}), consolidated to {out_size / 2**30:.2f} GiB; "
          f"{args.rounds} paired rounds, medians, page cache warm.\n")
    print("| case | median wall (s) | ratio to `cp` of the file | peak RSS (MiB) | peak RssAnon (MiB) |")
    print("|---|---|---|---|---|")
    for name, runs in results.items():
        t = statistics.median(x for x, _, _ in runs)
        rss = statistics.median(x for _, x, _ in runs) / 2**20
        anon = statistics.median(x for _, _, x in runs) / 2**20
        print(f"| {name} | {t:.3f} | {t / base:.2f} | {rss:.0f} | {anon:.1f} |")


if __name__ == "__main__":
    main()
