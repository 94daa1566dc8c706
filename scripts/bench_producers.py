#!/usr/bin/env python3
"""The newer producers against their own consolidation tools: reshard and the producer's tool on
the same checkpoint, written by the producer itself on CPU.

    .venv/bin/python scripts/bench_producers.py --make /work/bench-producers          # ~10 min, ~9 GB
    .venv/bin/python scripts/bench_producers.py --bench /work/bench-producers --rounds 3

Cases (``--cases``; default all):

- ``ucp``: a DeepSpeed ZeRO-3 checkpoint (scripts/bench_deepspeed.py's: 16 x Linear(4096, 4096),
  fp32, one AdamW step, 2 CPU ranks on gloo) to a universal checkpoint: ``reshard convert
  ZERO/global_step1 OUT --to 2 --format deepspeed-universal`` against DeepSpeed's ``python -m
  deepspeed.checkpoint.ds_to_universal --input_folder ZERO/global_step1 --output_folder OUT
  --inject_missing_state`` (its default worker counts: 4 extract, 2 merge processes).
- ``ucp-st``: ds_to_universal's universal checkpoint of that model to one ``.safetensors`` of the
  fp32 weights: ``reshard convert UCP OUT.safetensors --to 1 --exclude 'optimizer.*'`` against
  the simplest Python equivalent (``torch.load`` of every ``zero/<param>/fp32.pt``, then
  safetensors' ``save_file``).
- ``verl``: verl's ``FSDPCheckpointManager`` (FSDP2, 2 CPU ranks) of a Llama (transformers;
  hidden 2048, intermediate 5632, 3 layers, vocab 32000: 1.06 GiB of fp32 weights), model only,
  to a Hugging Face folder: ``reshard convert CK OUT --format hf --dtype bf16 --exclude 'optim.*'
  --exclude 'extra_state.*'`` against verl's merger ``python -m verl.model_merger merge
  --backend fsdp --local_dir CK --target_dir OUT``. verl's merger writes bf16 whatever the
  checkpoint's dtype (``_load_and_merge_state_dicts`` casts every shard), hence reshard's
  ``--dtype bf16``.
- ``tc``: torch_checkpointing's ``CheckpointManager.save`` (FSDP2, 2 CPU ranks; item ``model``
  with the ``DefaultResharder``) of 4 x Linear(8192, 8192) (1.00 GiB fp32) to one
  ``.safetensors``: ``reshard convert CK OUT.safetensors --to 1`` against the library's own load
  at world 1 (``CheckpointManager.load`` into a plain model's state dict, allocated with
  ``to_empty``, then ``save_file``).
- ``fp8``: block-FP8 weights as DeepSeek-V3 ships them (3 layers of DeepSeek-V3's dense MLP,
  gate/up/down 18432 x 7168, and ``kv_a_proj_with_mqa`` 576 x 7168, float8_e4m3fn with 128 x 128
  ``weight_scale_inv`` quantized as scripts/gen_fp8.py does, plus bf16 embeddings and norms: one
  file per layer, 1.17 GiB) to bf16: ``reshard convert CK OUT --to 1 --dtype bf16`` against
  DeepSeek-V3's ``fp8_cast_bf16.py`` approach in torch on CPU (per file: ``load_file``, each FP8
  weight times its scale_inv repeated over its blocks, ``save_file``; the index without the
  scales).

Each round (page cache warm: every command ran once before, for the check) runs, per case,
reshard, the peer, and the peer's imports alone (a fresh Python importing what the tool
imports: part of every user's run, shown apart), as subprocesses; wall time and peak RSS (``os.wait4``'s ``ru_maxrss``:
the largest of the process and the children it waited for, not their sum) are recorded and the
medians printed as Markdown. Before timing, both outputs are checked to hold the same tensors
(names, dtypes, shapes, bytes). Outputs go to ``--out`` (default /dev/shm/bench-producers), each
removed before its command runs.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable
sys.path.insert(0, str(HERE))

LLAMA = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=3,
             num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256,
             tie_word_embeddings=False, rms_norm_eps=1e-5)
MLP_WIDTH, MLP_LAYERS = 8192, 4
FP8_LAYERS, FP8_HIDDEN, FP8_INTER = 3, 7168, 18432
CASES = ["ucp", "ucp-st", "verl", "tc", "fp8"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, argv: list[str]) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               PATH=f"{Path(PY).parent}:{os.environ.get('PATH', '')}")
    cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), __file__, *argv]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)


# ---------------------------------------------------------------- writers (the producers themselves)

def tc_model(device=None):
    import torch

    return torch.nn.Sequential(*[torch.nn.Linear(MLP_WIDTH, MLP_WIDTH, device=device) for _ in range(MLP_LAYERS)])


def tc_manager():
    from torch_checkpointing import CheckpointManager, ItemSpec, SyncCheckpointSaverConfig
    from torch_checkpointing.default_resharder import DefaultResharder
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    import gen_torch_checkpointing

    gen_torch_checkpointing.patch_cpu()  # the library's metadata gather assumes cuda
    return CheckpointManager(CheckpointManager.Config(
        items={"model": ItemSpec(resharder=DefaultResharder())}, save=SyncCheckpointSaverConfig(),
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))


def tc_worker(out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = tc_model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    tc_manager().save(out, {"model": model.state_dict()})
    dist.barrier()
    dist.destroy_process_group()


def verl_worker(out: str) -> None:
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    import gen_verl

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA, architectures=["LlamaForCausalLM"])).float()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cfg = OmegaConf.create({"save_contents": ["model"], "load_contents": ["model"]})
    mgr = FSDPCheckpointManager(model=model, optimizer=opt, lr_scheduler=None,
                                processing_class=gen_verl.tokenizer(), checkpoint_config=cfg)
    mgr.save_checkpoint(out, global_step=1)
    dist.barrier()
    dist.destroy_process_group()


def make_fp8(ck: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from gen_fp8 import QUANT_CONFIG, quantize

    ck.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    weight_map = {}
    shapes = {"mlp.gate_proj": (FP8_INTER, FP8_HIDDEN), "mlp.up_proj": (FP8_INTER, FP8_HIDDEN),
              "mlp.down_proj": (FP8_HIDDEN, FP8_INTER), "self_attn.kv_a_proj_with_mqa": (576, FP8_HIDDEN)}
    for i in range(FP8_LAYERS):
        fname = f"model-{i + 1:05d}-of-{FP8_LAYERS:05d}.safetensors"
        tensors = {}
        if i == 0:
            tensors["model.embed_tokens.weight"] = (torch.randn(4096, FP8_HIDDEN, generator=g) * 0.02).bfloat16()
        tensors[f"model.layers.{i}.input_layernorm.weight"] = (1 + torch.rand(FP8_HIDDEN, generator=g)).bfloat16()
        for name, shape in shapes.items():
            w = (torch.randn(*shape, generator=g) * (0.01 + 0.05 * torch.rand((), generator=g))).bfloat16()
            q, inv = quantize(w)
            tensors[f"model.layers.{i}.{name}.weight"] = q
            tensors[f"model.layers.{i}.{name}.weight_scale_inv"] = inv
        save_file(tensors, str(ck / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
    total = sum((ck / f).stat().st_size for f in set(weight_map.values()))
    (ck / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    (ck / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": FP8_HIDDEN,
        "intermediate_size": FP8_INTER, "num_hidden_layers": FP8_LAYERS, "torch_dtype": "bfloat16",
        "quantization_config": QUANT_CONFIG}, indent=1) + "\n")


def du(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def make(root: Path, cases: list[str], size_gb: float) -> None:
    t0 = time.time()
    if "ucp" in cases or "ucp-st" in cases:
        import bench_deepspeed

        zero = root / "ucp" / "zero"
        if not zero.exists():
            bench_deepspeed.make(zero, size_gb)
        uni = root / "ucp" / "universal"
        if not uni.exists():
            subprocess.run(peer_cmd("ucp", zero / "global_step1", uni), check=True, stdout=subprocess.DEVNULL,
                           env=dict(os.environ, DS_ACCELERATOR="cpu"))
        print(f"ucp: ZeRO-3 {du(zero) / 2**30:.2f} GiB, universal {du(uni) / 2**30:.2f} GiB", file=sys.stderr)
    if "verl" in cases:
        ck = root / "verl" / "checkpoint"
        if not ck.exists():
            torchrun(2, ["--worker", "verl", str(ck)])
        print(f"verl: {du(ck) / 2**30:.2f} GiB", file=sys.stderr)
    if "tc" in cases:
        ck = root / "tc" / "checkpoint"
        if not ck.exists():
            torchrun(2, ["--worker", "tc", str(ck)])
        print(f"tc: {du(ck) / 2**30:.2f} GiB", file=sys.stderr)
    if "fp8" in cases:
        ck = root / "fp8" / "checkpoint"
        if not ck.exists():
            make_fp8(ck)
        print(f"fp8: {du(ck) / 2**30:.2f} GiB", file=sys.stderr)
    print(f"made in {time.time() - t0:.0f} s", file=sys.stderr)


# ---------------------------------------------------------------- the peers' tools

def peer_ucp_st(src: str, out: str) -> None:
    """The simplest Python consolidation of a universal checkpoint: every parameter's fp32.pt,
    in the shape the model states file records (ds_to_universal keeps a ZeRO-3 parameter flat)."""
    import torch
    from safetensors.torch import save_file

    states = torch.load(next(Path(src).glob("*model_states.pt")), weights_only=False)
    shapes = {k: s for group in states["param_shapes"] for k, s in group.items()}
    sd = {}
    for d in sorted(Path(src, "zero").iterdir()):
        f = d / "fp32.pt"
        if f.is_file():
            v = torch.load(f, weights_only=False)  # {"param": tensor, ...} or the tensor alone
            v = v["param"] if isinstance(v, dict) else v
            sd[d.name] = v.reshape(shapes.get(d.name, v.shape)).contiguous()
    save_file(sd, out)


def peer_tc(src: str, out: str) -> None:
    """torch_checkpointing's own load at world 1 into a plain model's state dict, then save_file."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    model = tc_model(device="meta").to_empty(device="cpu")  # no initialisation: the load fills it
    got = tc_manager().load(src, into={"model": model.state_dict()})
    save_file({k: v.contiguous() for k, v in got["model"].items()}, out)
    dist.destroy_process_group()


def peer_fp8(src: str, out: str) -> None:
    """DeepSeek-V3's fp8_cast_bf16.py on CPU: per file, dequantize each FP8 weight with its
    scale_inv (weight_dequant's formula in torch, as scripts/gen_fp8.py), save; the index
    without the scales."""
    import torch
    from safetensors.torch import load_file, save_file

    from gen_fp8 import dequantize

    src_p, out_p = Path(src), Path(out)
    out_p.mkdir(parents=True)
    index = json.loads((src_p / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    loaded: dict[str, dict] = {}
    for f in sorted(src_p.glob("*.safetensors")):
        loaded[f.name] = load_file(str(f))
        sd = loaded[f.name]
        new = {}
        for name, w in sd.items():
            if name.endswith("_scale_inv"):
                continue
            if w.element_size() == 1:
                sname = name + "_scale_inv"
                if sname not in loaded.get(weight_map[sname], {}):
                    loaded[weight_map[sname]] = load_file(str(src_p / weight_map[sname]))
                new[name] = dequantize(w, loaded[weight_map[sname]][sname], torch.bfloat16)
            else:
                new[name] = w
        save_file(new, str(out_p / f.name), metadata={"format": "pt"})
        while len(loaded) > 2:  # fp8_cast_bf16.py keeps the two files used last
            loaded.pop(next(iter(loaded)))
    index["weight_map"] = {k: v for k, v in weight_map.items() if not k.endswith("_scale_inv")}
    (out_p / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    shutil.copy(src_p / "config.json", out_p / "config.json")


PEERS = {"ucp-st": peer_ucp_st, "tc": peer_tc, "fp8": peer_fp8}


def reshard_cmd(case: str, rs: str, src: Path, out: Path) -> list[str]:
    base = [rs, "convert", str(src), str(out), "-q"]
    return base + {
        "ucp": ["--to", "2", "--format", "deepspeed-universal"],
        "ucp-st": ["--to", "1", "--exclude", "optimizer.*"],
        "verl": ["--format", "hf", "--dtype", "bf16", "--exclude", "optim.*", "--exclude", "extra_state.*"],
        "tc": ["--to", "1"],
        "fp8": ["--to", "1", "--dtype", "bf16"],
    }[case]


def peer_cmd(case: str, src: Path, out: Path) -> list[str]:
    if case == "ucp":
        return [PY, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(src),
                "--output_folder", str(out), "--inject_missing_state"]
    if case == "verl":
        return [PY, "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", str(src),
                "--target_dir", str(out)]
    return [PY, __file__, "--peer", case, str(src), str(out)]


IMPORTS = {
    "ucp": "import deepspeed.checkpoint.ds_to_universal",
    "ucp-st": "import torch, safetensors.torch",
    "verl": "import verl.model_merger.base_model_merger, verl.model_merger.fsdp_model_merger",
    "tc": "import torch.distributed, torch_checkpointing, safetensors.torch",
    "fp8": "import torch, safetensors.torch",
}


def sources(root: Path) -> dict[str, Path]:
    return {"ucp": root / "ucp" / "zero" / "global_step1", "ucp-st": root / "ucp" / "universal",
            "verl": root / "verl" / "checkpoint", "tc": root / "tc" / "checkpoint",
            "fp8": root / "fp8" / "checkpoint"}


# ---------------------------------------------------------------- measuring and checking

def run(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes, ``wait4``) of a command."""
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    dt = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{' '.join(cmd)} failed: {err.decode()[-3000:]}")
    return dt, ru.ru_maxrss * 1024


def remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()


def tensors(p: Path) -> dict:
    """name -> a function reading that tensor, for every tensor under p: safetensors files, or a
    universal checkpoint's zero/<param>/<state>.pt files (the ``param`` of each, named
    <param>.<state>). One tensor at a time: the outputs are GiBs."""
    import torch
    from safetensors import safe_open

    def pt(f):
        v = torch.load(f, weights_only=False)
        return v["param"] if isinstance(v, dict) else v

    def st(f, k):
        with safe_open(str(f), "pt") as s:
            return s.get_tensor(k)

    if p.is_dir() and (p / "zero").is_dir():
        return {f"{f.parent.name}.{f.stem}": (lambda f=f: pt(f)) for f in sorted((p / "zero").glob("*/*.pt"))}
    out = {}
    for f in sorted(p.glob("*.safetensors")) if p.is_dir() else [p]:
        with safe_open(str(f), "pt") as s:
            out.update({k: (lambda f=f, k=k: st(f, k)) for k in s.keys()})
    return out


def universal(p: Path) -> Path:
    """The tag folder of a universal checkpoint written as <out>/<tag>_universal (reshard's
    layout, with ``latest_universal``), else p."""
    tags = [d for d in p.glob("*_universal") if d.is_dir()] if p.is_dir() else []
    return tags[0] if len(tags) == 1 else p


def check(a: Path, b: Path) -> str:
    """Both outputs hold the same tensors: names, dtypes, shapes and bytes. Universal
    checkpoints: the same bytes in the same number of elements (ds_to_universal keeps a ZeRO-3
    parameter's state flat, 1-D; reshard writes it in the parameter's shape), and states only
    reshard writes (a per-parameter ``step.pt``) are listed."""
    import torch

    a, b = universal(a), universal(b)
    ucp = (a / "zero").is_dir()
    x, y = tensors(a), tensors(b)
    extra = sorted(set(x) - set(y)) if ucp else []
    if set(x) - set(extra) != set(y):
        only_a, only_b = sorted(set(x) - set(y)), sorted(set(y) - set(x))
        sys.exit(f"tensor sets differ: only reshard's {only_a[:5]}, only the peer's {only_b[:5]}")
    size, reshaped = 0, 0
    for k in sorted(y):
        u, v = x[k](), y[k]()
        if ucp and u.shape != v.shape and u.numel() == v.numel() and v.dim() == 1:
            reshaped += 1
            u = u.reshape(-1)
        if u.dtype != v.dtype or u.shape != v.shape:
            sys.exit(f"tensor {k} differs: {u.dtype} {tuple(u.shape)} against {v.dtype} {tuple(v.shape)}")
        u, v = u.contiguous().reshape(-1).view(torch.uint8), v.contiguous().reshape(-1).view(torch.uint8)
        if not torch.equal(u, v):
            sys.exit(f"tensor {k} differs in its bytes")
        size += u.numel()
    more = f" ({reshaped} flat in the peer's; reshard's has {len(extra)} more: {extra[0]}, ...)" if extra else ""
    return f"{len(y)} tensors, {size / 2**30:.2f} GiB{more}"


def bench(root: Path, cases: list[str], rounds: int, out: Path, rs: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    src = sources(root)
    ext = {"ucp-st": ".safetensors", "tc": ".safetensors"}
    cmds = {}
    for c in cases:
        r_out, p_out = out / f"{c}-reshard{ext.get(c, '')}", out / f"{c}-peer{ext.get(c, '')}"
        cmds[c] = (reshard_cmd(c, rs, src[c], r_out), r_out, peer_cmd(c, src[c], p_out), p_out)
    imports = {c: [PY, "-c", IMPORTS[c]] for c in cases}
    checked = {}
    for c, (rc, ro, pc, po) in cmds.items():  # correctness first (and the page cache warm)
        remove(ro)
        remove(po)
        run(rc)
        run(pc)
        # (in a child: tensors read here would grow this process, and a child forked from a
        # large parent starts with the parent's RSS in its own ru_maxrss)
        checked[c] = subprocess.run([PY, __file__, "--check", str(ro), str(po)], check=True,
                                    stdout=subprocess.PIPE, text=True).stdout.strip()
        print(f"bench_producers: {c}: same tensors: {checked[c]}", file=sys.stderr, flush=True)
        remove(ro)
        remove(po)
    res = {c: ([], [], []) for c in cases}
    for r in range(rounds):
        for c, (rc, ro, pc, po) in cmds.items():
            for i, (cmd, o) in enumerate(((rc, ro), (pc, po), (imports[c], None))):
                if o:
                    remove(o)
                res[c][i].append(run(cmd))
                if o:
                    remove(o)
        print(f"bench_producers: round {r + 1}/{rounds} done; {os.getloadavg()}", file=sys.stderr, flush=True)
    (out / "latest_universal").unlink(missing_ok=True)  # ds_to_universal writes it beside its output
    if not any(out.iterdir()):
        out.rmdir()
    print(f"{rounds} interleaved rounds, medians; load average after: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| case | checkpoint | output (checked equal) | reshard time / peak RSS | peer time / peak RSS "
          "| peer's imports alone | peer / reshard: time, RSS | (peer - imports) / reshard: time |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for c in cases:
        (rt, rm), (pt, pm), (it, im) = ([statistics.median(x[j] for x in res[c][i]) for j in (0, 1)]
                                        for i in (0, 1, 2))
        print(f"| {c} | {du(src[c]) / 2**30:.2f} GiB | {checked[c]} | {rt:.2f} s / {rm / 2**20:.0f} MiB "
              f"| {pt:.2f} s / {pm / 2**20:.0f} MiB | {it:.2f} s / {im / 2**20:.0f} MiB "
              f"| {pt / rt:.1f}×, {pm / rm:.1f}× | {(pt - it) / rt:.1f}× |", flush=True)
    print("\nper round (s, MiB):")
    for c in cases:
        for i, who in enumerate(("reshard", "peer", "peer's imports")):
            print(f"  {c} {who}: " + ", ".join(f"{t:.2f}/{m / 2**20:.0f}" for t, m in res[c][i]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--make", type=Path, help="write the producers' checkpoints under this folder")
    ap.add_argument("--size-gb", type=float, default=1.0, help="the ZeRO-3 model's size (ucp)")
    ap.add_argument("--bench", type=Path, help="time the tools on the checkpoints under this folder")
    ap.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("/dev/shm/bench-producers"))
    ap.add_argument("--reshard", default=str(ROOT / "target/release/reshard"))
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--peer", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--check", nargs=2, type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.check:
        return print(check(*a.check))
    if a.worker:
        return {"tc": tc_worker, "verl": verl_worker}[a.worker[0]](a.worker[1])
    if a.peer:
        return PEERS[a.peer[0]](a.peer[1], a.peer[2])
    if a.make:
        make(a.make, a.cases, a.size_gb)
    if a.bench:
        bench(a.bench, a.cases, a.rounds, a.out, a.reshard)


if __name__ == "__main__":
    main()
