#!/usr/bin/env python3
"""Loading an FSDP2 checkpoint into an FSDP2 model: ``reshard.torch.load_model`` +
``load_optimizer`` against torch's ``dcp.load`` (``FileSystemReader``), at 1, 2 and 8 ranks.

    # release build of the package (the editable install is a debug build), then
    /tmp/bench-venv/bin/python scripts/bench_python_load.py --rounds 5

The checkpoint (made once, cached under --work): a stack of ``--layers`` ``nn.Linear(H, H)``
(float32, ``fully_shard`` per layer and at the root) over 4 gloo CPU processes, one AdamW step,
then ``dcp.save({"model": get_model_state_dict, "optimizer": get_optimizer_state_dict},
storage_writer=FileSystemWriter)``. H is not a multiple of 4 or 8, so shards are uneven.

Each load runs in fresh processes (M gloo ranks, torchrun-like env). Per rank: the model is
built on the meta device, ``fully_shard`` ed like the saved one, ``to_empty(device="cpu")``
(pages not touched, so not resident), a fresh AdamW made (no state). Then ``gc.collect()``,
``echo 5 > /proc/self/clear_refs`` (resets VmHWM to the current RSS), the baseline VmRSS is
read, ``dist.barrier()`` (modules both loaders use are imported before), and the timed part runs from ``perf_counter()`` right after the
barrier to its return on that rank:

- reshard: ``reshard.torch.load_model(model, ckpt)`` then
  ``reshard.torch.load_optimizer(model, opt, ckpt)`` (each opens the checkpoint by path);
- dcp: ``get_model_state_dict`` + ``get_optimizer_state_dict``, ``dcp.load({"model": msd,
  "optimizer": osd}, storage_reader=FileSystemReader(ckpt))``, ``set_model_state_dict`` +
  ``set_optimizer_state_dict``;
- dcp-prealloc: the same, with the optimizer state allocated first as reshard's
  ``load_optimizer`` allocates it (so ``get_optimizer_state_dict`` takes no step): what
  ``dcp.load``'s reading costs apart from torch's way of making the state.

All allocate the optimizer moments inside the timed part: reshard and dcp-prealloc
uninitialised, dcp by ``get_optimizer_state_dict``'s step with zero gradients. Memory per
rank: peak = VmHWM after the timed part; delta = peak - baseline VmRSS (what
the load added: the rank's share of the checkpoint, which it must hold, plus overhead). The
rank's share is the bytes of the local shards in the loaded model and optimizer state dicts.
A run reports its slowest rank's time and the largest per-rank peak and delta.

Rounds are paired: every round runs both loaders at every M, alternating which goes first.
The page cache is warm (the checkpoint files are read once before the first round).

Also at M = 1, into a plain (non-FSDP) module: ``reshard.torch.load_model`` from the DCP
checkpoint against ``torch.load`` of a consolidated ``.pt`` of the weights (made by
``reshard.convert(ckpt, pt, world_size=1, include=["model.*"], strip_prefix="model.")``) +
``model.load_state_dict``, with and without ``mmap=True``; ``load_model`` from the same
weights as one ``.safetensors`` file against ``safetensors.torch.load_file`` +
``load_state_dict``; and the bound: one thread copying each parameter's bytes from the mapped
``.safetensors`` (page cache) into the parameter (``--ms ""`` runs only this part;
``--prefault`` makes every loader's destination pages resident before timing, so the copy
alone is compared).

Correctness is checked once before timing (at --verify-ms ranks): every local parameter shard
and optimizer state tensor loaded by reshard equals dcp.load's (torch.equal), and the
param_groups hyperparameters agree. Prints Markdown.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
LOADERS = ["reshard", "dcp", "dcp-prealloc"]
LR, WD = 3e-4, 0.05


# ---------------------------------------------------------------- worker side

def status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def build(layers: int, hidden: int, device: str):
    import torch

    with torch.device(device):
        return torch.nn.Sequential(*[torch.nn.Linear(hidden, hidden) for _ in range(layers)])


def fsdp_model(layers: int, hidden: int, meta: bool):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    if meta:
        model = build(layers, hidden, "meta")
    else:
        torch.manual_seed(0)
        model = build(layers, hidden, "cpu")
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if meta:
        model.to_empty(device="cpu")
    return model


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def share_bytes(*sds) -> int:
    import torch

    n = 0
    stack = list(sds)
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, torch.Tensor):
            t = local(v)
            n += t.numel() * t.element_size()
    return n


def load_reshard(model, opt, ckpt):
    import reshard.torch as rt

    rt.load_model(model, ckpt)
    rt.load_optimizer(model, opt, ckpt)


def load_dcp(model, opt, ckpt, prealloc: bool = False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    msd = get_model_state_dict(model)
    if prealloc:
        # the optimizer state allocated as reshard.torch.load_optimizer allocates it, not
        # made by get_optimizer_state_dict's zero-gradient step
        import reshard.torch as rt

        rt._make_optimizer_state(opt)
    osd = get_optimizer_state_dict(model, opt)
    dcp.load({"model": msd, "optimizer": osd}, storage_reader=dcp.FileSystemReader(ckpt))
    set_model_state_dict(model, msd)
    set_optimizer_state_dict(model, opt, osd)


def init_pg():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist


def worker_save(a):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    dist = init_pg()
    model = fsdp_model(a.layers, a.hidden, meta=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(8, a.hidden)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(a.ckpt))
    with open(f"{a.out}.{dist.get_rank()}.json", "w") as f:
        json.dump({}, f)
    dist.barrier()
    dist.destroy_process_group()


def worker_load(a):
    import torch

    dist = init_pg() if a.mode != "plain" else None
    rank = dist.get_rank() if dist else 0
    if a.mode == "plain":
        model = build(a.layers, a.hidden, "meta")
        model.to_empty(device="cpu")
        if a.prefault:
            # the parameters' pages made resident before timing: what is measured is the
            # copy itself, as into a model that already exists
            for t in model.state_dict().values():
                t.zero_()
        opt = None
    else:
        model = fsdp_model(a.layers, a.hidden, meta=True)
        opt = torch.optim.AdamW(model.parameters())
    # Imports are not part of the load: both loaders' modules are imported before timing.
    import reshard.torch as rt
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = status("VmRSS")
    if dist:
        dist.barrier()
    t0 = time.perf_counter()
    if a.mode == "plain":
        if a.loader == "reshard":
            rt.load_model(model, a.ckpt)
        elif a.loader == "reshard-pt":
            rt.load_model(model, a.pt, prefix="")
        elif a.loader == "reshard-st":
            rt.load_model(model, a.pt[: -len(".pt")] + ".safetensors", prefix="")
        elif a.loader == "safetensors":
            from safetensors.torch import load_file

            sd = load_file(a.pt[: -len(".pt")] + ".safetensors")
            model.load_state_dict(sd)
            del sd
        elif a.loader == "memcpy":
            memcpy_from_page_cache(model, a.pt[: -len(".pt")] + ".safetensors")
        else:
            sd = torch.load(a.pt, weights_only=True, mmap=(a.loader == "torch.load-mmap"))
            model.load_state_dict(sd)
            del sd
    elif a.loader == "reshard":
        load_reshard(model, opt, a.ckpt)
    else:
        load_dcp(model, opt, a.ckpt, prealloc=(a.loader == "dcp-prealloc"))
    t1 = time.perf_counter()
    peak = status("VmHWM")
    osd = [s for s in (opt.state.values() if opt else [])]
    share = share_bytes(model.state_dict(), osd)
    res = dict(rank=rank, time=t1 - t0, base=base, peak=peak, delta=peak - base, share=share)
    with open(f"{a.out}.{rank}.json", "w") as f:
        json.dump(res, f)
    if dist:
        dist.barrier()
        dist.destroy_process_group()


def memcpy_from_page_cache(model, st: str) -> None:
    """The bound: one thread copies each parameter's bytes from the page cache (the
    safetensors file, mapped) into the parameter's memory; no parsing beyond the header."""
    import mmap
    import struct
    import warnings

    import torch

    warnings.simplefilter("ignore", UserWarning)  # frombuffer of a read-only mapping: only read

    torch.set_num_threads(1)  # a single-threaded memcpy: torch's copy_ would split big copies
    with open(st, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    n = struct.unpack("<Q", mm[:8])[0]
    header = json.loads(mm[8 : 8 + n])
    base = 8 + n
    params = dict(model.state_dict())
    view = memoryview(mm)
    for name, t in params.items():
        lo, hi = header[name]["data_offsets"]
        src = torch.frombuffer(view[base + lo : base + hi], dtype=torch.uint8)
        t.view(-1).view(torch.uint8).copy_(src)
    del src, view
    mm.close()


def worker_verify(a):
    import torch

    dist = init_pg()
    ma = fsdp_model(a.layers, a.hidden, meta=True)
    oa = torch.optim.AdamW(ma.parameters())
    mb = fsdp_model(a.layers, a.hidden, meta=True)
    ob = torch.optim.AdamW(mb.parameters())
    load_reshard(ma, oa, a.ckpt)
    load_dcp(mb, ob, a.ckpt)
    n = 0
    bad = []
    for (name, pa), (_, pb) in zip(ma.named_parameters(), mb.named_parameters()):
        n += 1
        if not torch.equal(local(pa.data), local(pb.data)):
            bad.append(f"param {name}")
        sa, sb = oa.state[pa], ob.state[pb]
        if set(sa) != set(sb):
            bad.append(f"state keys {name}: {sorted(sa)} vs {sorted(sb)}")
        for k in sa:
            n += 1
            if not torch.equal(local(sa[k]), local(sb[k])):
                bad.append(f"state {name}.{k}")
    for ga, gb in zip(oa.param_groups, ob.param_groups):
        for k in ga:
            if k != "params" and ga[k] != gb[k]:
                bad.append(f"param_group {k}: {ga[k]} vs {gb[k]}")
        if ga["lr"] != LR or ga["weight_decay"] != WD:
            bad.append(f"param_group not restored: lr {ga['lr']}, weight_decay {ga['weight_decay']}")
    # the loaded state is the trained one, not zeros
    p0 = next(ma.parameters())
    if not (local(oa.state[p0]["exp_avg_sq"]).abs().sum() > 0):
        bad.append("exp_avg_sq is all zeros")
    with open(f"{a.out}.{dist.get_rank()}.json", "w") as f:
        json.dump(dict(compared=n, bad=bad), f)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver side

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, args: list[str], out: Path) -> list[dict]:
    port = free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if world > 1:
            env["OMP_NUM_THREADS"] = "1"  # as torchrun sets it
        procs.append(subprocess.Popen([sys.executable, str(HERE), "--worker", *args, "--out", str(out)], env=env))
    rcs = [p.wait() for p in procs]
    if any(rcs):
        sys.exit(f"worker failed ({rcs}): {args}")
    res = []
    for r in range(world):
        p = Path(f"{out}.{r}.json")
        res.append(json.loads(p.read_text()))
        p.unlink()
    return res


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def warm(d: Path) -> None:
    for p in sorted(d.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass


def mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=Path("/work/main/bench-out/python-load"))
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=2050)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ms", default="1,2,8", help="world sizes to load at")
    ap.add_argument("--verify-ms", default="8", help="world sizes to check correctness at")
    ap.add_argument("--pt-rounds", type=int, default=None, help="rounds of the .pt comparison (default --rounds)")
    ap.add_argument("--prefault", action="store_true",
                    help="plain-module loads into parameters whose pages are already resident (every loader)")
    # worker-only
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--task", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="fsdp", help=argparse.SUPPRESS)
    ap.add_argument("--loader", help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", help=argparse.SUPPRESS)
    ap.add_argument("--pt", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        {"save": worker_save, "load": worker_load, "verify": worker_verify}[a.task](a)
        return

    import reshard
    import reshard._reshard
    import torch

    work = a.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / f"ckpt-l{a.layers}-h{a.hidden}"
    pt = work / f"model-l{a.layers}-h{a.hidden}.pt"
    tmp = work / "res"
    common = ["--layers", str(a.layers), "--hidden", str(a.hidden), "--ckpt", str(ckpt)]
    print(f"<!-- torch {torch.__version__}, reshard {reshard.__version__} from {reshard._reshard.__file__} -->")
    t = time.perf_counter()
    if not (ckpt / ".metadata").exists():
        launch(4, ["--task", "save", *common], tmp)
        print(f"<!-- saved {ckpt} at 4 ranks in {time.perf_counter() - t:.1f} s -->")
    if not pt.exists():
        reshard.convert(ckpt, pt, world_size=1, include=["model.*"], strip_prefix="model.")
    st = pt.with_suffix(".safetensors")
    if not st.exists():
        reshard.convert(ckpt, st, world_size=1, include=["model.*"], strip_prefix="model.")
    size = dir_bytes(ckpt)
    print(f"\nCheckpoint: {ckpt} — {size:,} B ({size / 2**30:.3f} GiB), {len(list(ckpt.iterdir()))} files; "
          f"{a.layers} × Linear({a.hidden}, {a.hidden}) fp32, FSDP2 over 4 ranks, AdamW after one step. "
          f"Consolidated weights: {pt.name}, {pt.stat().st_size:,} B.\n")
    warm(ckpt)
    warm(pt)
    warm(st)

    for m in [int(x) for x in a.verify_ms.split(",") if x]:
        t = time.perf_counter()
        res = launch(m, ["--task", "verify", *common], tmp)
        bad = [b for r in res for b in r["bad"]]
        n = sum(r["compared"] for r in res)
        if bad:
            sys.exit(f"verify at M={m}: {len(bad)} mismatches: {bad[:10]}")
        print(f"Verified at M = {m}: {n} local tensors (parameter shards and optimizer state, "
              f"all ranks) torch.equal between reshard and dcp.load; param_groups equal "
              f"({time.perf_counter() - t:.1f} s).\n")

    ms = [int(x) for x in a.ms.split(",") if x]
    runs: dict = {}
    t_all = time.perf_counter()
    for rnd in range(a.rounds):
        for m in ms:
            order = LOADERS if (rnd + m) % 2 == 0 else LOADERS[::-1]
            for loader in order:
                res = launch(m, ["--task", "load", "--loader", loader, *common], tmp)
                runs.setdefault((m, loader), []).append(res)
        print(f"<!-- round {rnd + 1}/{a.rounds} done at {time.perf_counter() - t_all:.0f} s -->", flush=True)

    print("| M | loader | slowest rank (s), median | rounds (s) | max peak VmHWM (MiB) | max delta over baseline (MiB) | rank share (MiB) | share + 64 MiB target |")
    print("|---|---|---|---|---|---|---|---|")
    summary = {}
    for m in ms:
        for loader in LOADERS:
            rs = runs[(m, loader)]
            times = [max(r["time"] for r in res) for res in rs]
            peaks = [max(r["peak"] for r in res) for res in rs]
            deltas = [max(r["delta"] for r in res) for res in rs]
            over = [max(r["delta"] - r["share"] - 64 * 2**20 for r in res) for res in rs]
            share = max(r["share"] for r in rs[0])
            med = statistics.median(times)
            summary[(m, loader)] = med
            met = "met" if statistics.median(over) <= 0 else "not met"
            print(f"| {m} | {loader} | {med:.3f} | {' '.join(f'{x:.2f}' for x in times)} | "
                  f"{mib(statistics.median(peaks))} | {mib(statistics.median(deltas))} | {mib(share)} | {met} |")
    print()
    for m in ms:
        r = summary[(m, "reshard")] / summary[(m, "dcp")]
        r2 = summary[(m, "reshard")] / summary[(m, "dcp-prealloc")]
        print(f"- M = {m}: reshard / dcp.load = {r:.2f} ({'met' if r <= 0.5 else 'not met'}: target <= 0.5); "
              f"reshard / dcp-prealloc = {r2:.2f}")
    print()

    pr = a.rounds if a.pt_rounds is None else a.pt_rounds
    if pr:
        pl = ["reshard", "reshard-pt", "reshard-st", "torch.load", "torch.load-mmap", "safetensors", "memcpy"]
        pruns: dict = {}
        for rnd in range(pr):
            for loader in (pl if rnd % 2 == 0 else pl[::-1]):
                res = launch(1, ["--task", "load", "--mode", "plain", "--loader", loader, "--pt", str(pt),
                                 *(["--prefault"] if a.prefault else []), *common], tmp)
                pruns.setdefault(loader, []).append(res[0])
        label = {
            "reshard": "`reshard.torch.load_model(model, dcp_ckpt)`",
            "reshard-pt": "`reshard.torch.load_model(model, pt, prefix=\"\")`",
            "torch.load": "`model.load_state_dict(torch.load(pt, weights_only=True))`",
            "torch.load-mmap": "`model.load_state_dict(torch.load(pt, weights_only=True, mmap=True))`",
            "reshard-st": "`reshard.torch.load_model(model, st, prefix=\"\")`",
            "safetensors": "`model.load_state_dict(safetensors.torch.load_file(st))`",
            "memcpy": "one thread copying each parameter's bytes from the mapped `.safetensors` (the bound)",
        }
        print("| M = 1, plain module, weights only | median (s) | rounds (s) | peak VmHWM (MiB) | delta over baseline (MiB) | share (MiB) |")
        print("|---|---|---|---|---|---|")
        for loader in pl:
            rs = pruns[loader]
            times = [r["time"] for r in rs]
            print(f"| {label[loader]} | {statistics.median(times):.3f} | {' '.join(f'{x:.2f}' for x in times)} | "
                  f"{mib(statistics.median(r['peak'] for r in rs))} | {mib(statistics.median(r['delta'] for r in rs))} | "
                  f"{mib(rs[0]['share'])} |")
        med = {k: statistics.median(r["time"] for r in pruns[k]) for k in pl}
        print()
        for ours, theirs in (("reshard-pt", "torch.load-mmap"), ("reshard-st", "safetensors"),
                             ("reshard-st", "torch.load-mmap"), ("reshard", "torch.load-mmap")):
            print(f"- {ours} / {theirs} = {med[ours] / med[theirs]:.2f} (target <= 1.0)")
        share = pruns["memcpy"][0]["share"]
        for k in ("reshard", "reshard-pt", "reshard-st"):
            print(f"- {k}: {share / med[k] / 2**30:.2f} GiB/s = {med['memcpy'] / med[k]:.2f} x the "
                  f"single-threaded memcpy's {share / med['memcpy'] / 2**30:.2f} GiB/s (target >= 0.8)")
    print(f"\n<!-- total {time.perf_counter() - t_all:.0f} s of timed rounds -->")


if __name__ == "__main__":
    main()
