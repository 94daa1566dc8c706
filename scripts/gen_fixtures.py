#!/usr/bin/env python3
"""Generate REAL PyTorch distributed checkpoints (+ oracles) for reshard's tests.

Every case runs a real multi-process job on CPU (gloo backend, torch.multiprocessing spawn,
MASTER_ADDR=127.0.0.1, a free port), trains a tiny model for one AdamW step and saves it
with torch's own writers. Output, per case, under <out>/<case>/:

  checkpoint/                 exactly what torch wrote
  oracle/full.safetensors     every tensor fully consolidated, keyed by the flat key
                              (.metadata key for DCP, HF tensor name for HF storage);
                              gathered in the live job (DTensor.full_tensor(), shard gather)
                              and cross-checked against torch's own readers
                              (dcp_to_torch_save / HuggingFaceStorageReader)
  oracle/nontensor.json       non-tensor items (BytesStorageMetadata) by flat key (DCP cases)
  oracle/lightning_consolidated.pt   (fabric cases) Lightning's consolidate_checkpoint output
  case.json                   torch version, world size, dtype, what it exercises, sizes

Usage:
  python scripts/gen_fixtures.py [--out tests/fixtures] [--only NAME ...] [--scale N] [--list]

--scale N multiplies the model widths (benchmark checkpoints; default 1 = tiny fixtures).
Case fabric_fsdp1_w4_f32_torch21 runs its job with the torch 2.1 venv
(${RESHARD_VENV21:-~/.cache/reshard/venv-torch21}, see scripts/setup_venv.sh --torch21 --lightning);
the fabric cases need `lightning` (scripts/setup_venv.sh --lightning).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torch_interop import jsonify, tensor_error  # the oracle's JSON of non-tensor values, tensor equality

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
SEED = 1234

# name -> spec. Order = priority order.
CASES: dict[str, dict] = {
    "hf_storage_w4_f32": dict(
        kind="hf_storage", world=4, dtype="float32",
        writer="dcp.save(model_state_dict, storage_writer=HuggingFaceStorageWriter(path, save_distributed=True))",
        exercises=["FSDP2 fully_shard model weights only", "HF storage: shard-<r>-model-00001-of-00001.safetensors",
                   "DCP_SHARDING_INFO saved_offsets", "uneven dim-0 shards", "empty shards (shape [0] / [0,12])",
                   "replicated buffer pos_scale written once", "no .metadata"]),
    "hf_storage_w3_bf16": dict(
        kind="hf_storage", world=3, dtype="bfloat16",
        writer="dcp.save(model_state_dict, storage_writer=HuggingFaceStorageWriter(path, save_distributed=True))",
        exercises=["FSDP2 fully_shard model weights only", "HF storage", "bfloat16 (BF16)", "uneven dim-0 shards",
                   "empty shards", "no .metadata"]),
    "fsdp2_w4_f32": dict(
        kind="fsdp2", world=4, dtype="float32",
        writer="dcp.save({model, optimizer (get_state_dict), scheduler, step, extra}, checkpoint_id=dir)",
        exercises=["FSDP2 DTensor Shard(0)", "uneven dim-0 shards", "empty chunks (offset == dim size)",
                   "0-d tensors (optimizer step, extra.tokens_seen)", "dtypes f32/f16/f64/u8/i32/i64/bool/float8_e4m3fn/uint16",
                   "non-contiguous item (transposed (3,2) stride (1,3))", "view of a larger storage",
                   "non-tensor items: str, int, float, list, tuple, None", "list of tensors (extra.hist.N)"]),
    "fsdp2_w3_bf16": dict(
        kind="fsdp2", world=3, dtype="bfloat16",
        writer="dcp.save({model, optimizer (get_state_dict), scheduler, step, extra}, checkpoint_id=dir)",
        exercises=["FSDP2 DTensor Shard(0)", "bfloat16 params and optimizer state (step stays f32)",
                   "uneven dim-0 shards", "empty chunks", "0-d tensors", "many extra dtypes", "non-contiguous item"]),
    "fsdp2_w8_f32": dict(
        kind="fsdp2", world=8, dtype="float32", bench=True,
        writer="dcp.save({model, optimizer (get_state_dict), scheduler, step, extra}, checkpoint_id=dir)",
        exercises=["FSDP2 DTensor Shard(0) over 8 ranks (benchmark source for 8 -> 3)", "uneven dim-0 shards"]),
    "fsdp2_w4_bf16": dict(
        kind="fsdp2", world=4, dtype="bfloat16", bench=True,
        writer="dcp.save({model, optimizer (get_state_dict), scheduler, step, extra}, checkpoint_id=dir)",
        exercises=["FSDP2 DTensor Shard(0) over 4 ranks in bfloat16 (benchmark source)", "uneven dim-0 shards"]),
    "fsdp2_w2_f32": dict(
        kind="fsdp2", world=2, dtype="float32",
        writer="dcp.save({model, optimizer (get_state_dict), scheduler, step, extra}, checkpoint_id=dir)",
        exercises=["FSDP2 DTensor Shard(0)", "2 ranks", "uneven dim-0 shards", "0-d tensors", "many extra dtypes"]),
    "fsdp2_w2_perrank": dict(
        kind="fsdp2", world=2, dtype="float32", per_rank=True,
        writer="dcp.save({model, optimizer, scheduler, step, extra, dataloader: {dp_rank_<r>: ...}, rng_state}, checkpoint_id=dir)",
        exercises=["per-rank state: each rank saves dataloader.dp_rank_<r> (both kept by DCP)",
                   "rng_state: a torch.Generator state tensor every rank saves under one key (one copy kept)",
                   "FSDP2 DTensor Shard(0)", "2 ranks"]),
    "fsdp2_w2_tied": dict(
        kind="fsdp2", world=2, dtype="float32", tied=True,
        writer="dcp.save({model, optimizer, scheduler, step, extra}, checkpoint_id=dir), lm_head.weight tied to embed.weight",
        exercises=["tied weights: model.embed.weight and model.lm_head.weight are one Parameter, saved as two DCP items",
                   "FSDP2 DTensor Shard(0)", "2 ranks"]),
    "dtensor2d_w4": dict(
        kind="dtensor2d", world=4, dtype="float32", mesh=[2, 2],
        writer="dcp.save({model, optimizer (get_state_dict), tensors}, checkpoint_id=dir) on a (dp=2, tp=2) mesh",
        exercises=["2-D mesh dp x tp", "TP ColwiseParallel/RowwiseParallel + FSDP2 -> _StridedShard",
                   "chunks not sorted by offset", "manual DTensors [S0,S1] [S1,S0] [S0,R] [R,S1] [R,R]",
                   "bf16/f16/f64/int64 DTensors", "uneven dim-1 shards (manual DTensors)"]),
    "fsdp1_w4_f32": dict(
        kind="fsdp1", world=4, dtype="float32",
        writer="dcp.save({model: SHARDED_STATE_DICT, optimizer: FSDP.optim_state_dict}, checkpoint_id=dir)",
        exercises=["FSDP1 ShardedTensor", "uneven dim-0 shards", "ranks without a shard (no chunk)",
                   "FSDP1 optimizer state dict keyed by FQN", "0-d step"]),
    "fabric_fsdp1_w4_f32": dict(
        kind="fabric", world=4, dtype="float32",
        writer="lightning Fabric FSDPStrategy(state_dict_type='sharded') fabric.save(path, {model, optimizer, step})",
        exercises=["Lightning Fabric sharded checkpoint", "meta.pt (non-module entries)", "FSDP1 ShardedTensor",
                   "per-leaf optimizer.param_groups.0.*"]),
    "fabric_fsdp1_w4_f32_torch21": dict(
        kind="fabric", world=4, dtype="float32", torch21=True,
        writer="torch 2.1 + lightning Fabric FSDPStrategy(state_dict_type='sharded'): save_state_dict(..., FileSystemWriter)",
        exercises=["the user's scenario: torch 2.1 Lightning Fabric sharded checkpoint", "meta.pt",
                   "torch 2.1 .metadata classes (sharded_tensor.metadata.TensorProperties, 5-tuple)",
                   "optimizer.param_groups as ONE non-tensor item", "FSDP1 ShardedTensor, ranks without a shard"]),
}


# ----------------------------------------------------------------------------------------
# helpers usable from both torch 2.15 and torch 2.1

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dir_sizes(d: Path) -> dict:
    return {str(p.relative_to(d)): p.stat().st_size for p in sorted(d.rglob("*")) if p.is_file()}


def _fix_modes(d: Path):
    """mkdtemp / safetensors create 0700 / 0600 entries: make them ordinary 0755 / 0644."""
    os.chmod(d, 0o755)
    for p in d.rglob("*"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)


def torch_dtype(name: str):
    import torch
    return getattr(torch, name)


# ----------------------------------------------------------------------------------------
# the model (same as the shared fixtures; dims chosen for uneven sharding)

def dims(scale: int, hidden: int = 13) -> dict:
    return dict(vocab=10 * scale, d=12 * scale, hidden=hidden * scale, classes=5 * scale, n_cls=3)


def build_model(scale: int, dtype, hidden: int = 13, tied: bool = False):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    dm = dims(scale, hidden)

    class Block(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.proj = nn.Linear(d, d)
            self.fc1 = nn.Linear(d, h)
            self.fc2 = nn.Linear(h, d)

        def forward(self, x):
            a = self.qkv(self.norm(x))
            q, k, v = a.chunk(3, dim=-1)
            x = x + self.proj(q * torch.sigmoid(k) + v)
            return x + self.fc2(F.gelu(self.fc1(x)))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            d = dm["d"]
            self.cls = nn.Parameter(torch.randn(dm["n_cls"], d) * 0.02)
            self.logit_scale = nn.Parameter(torch.ones(1))
            self.embed = nn.Embedding(dm["vocab"], d)
            self.blocks = nn.ModuleList([Block(d, dm["hidden"])])
            self.final_norm = nn.LayerNorm(d)
            self.head = nn.Linear(d, dm["classes"])
            self.register_buffer("pos_scale", torch.linspace(0.5, 1.5, d))

        def forward(self, tokens):
            x = self.embed(tokens) * self.pos_scale
            x = torch.cat([self.cls.unsqueeze(0).expand(x.shape[0], -1, -1), x], dim=1)
            for b in self.blocks:
                x = b(x)
            return self.head(self.final_norm(x[:, 0])) * self.logit_scale

    torch.manual_seed(SEED)
    m = Model()
    if tied:
        # an LM head tied to the input embedding: one Parameter under two names
        m.lm_head = nn.Linear(dm["d"], dm["vocab"], bias=False)
        m.lm_head.weight = m.embed.weight
    # make LayerNorm params / biases non-trivial so that shards are distinguishable
    with torch.no_grad():
        g = torch.Generator().manual_seed(SEED + 1)
        for _, p in sorted(m.named_parameters()):
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    return m.to(dtype)


def batch(scale: int, data_rank: int, hidden: int = 13):
    import torch
    dm = dims(scale, hidden)
    g = torch.Generator().manual_seed(SEED + 100 + data_rank)
    tokens = torch.randint(0, dm["vocab"], (4, 5), generator=g)
    labels = torch.randint(0, dm["classes"], (4,), generator=g)
    return tokens, labels


def train_one_step(model, opt, sched, scale, data_rank, hidden=13):
    import torch.nn.functional as F
    tokens, labels = batch(scale, data_rank, hidden)
    loss = F.cross_entropy(model(tokens).float(), labels)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if sched is not None:
        sched.step()
    return float(loss.detach())


def make_optim(model):
    import torch
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return opt, sched


def make_extra():
    """Replicated plain tensors / objects (identical on every rank)."""
    import torch
    g = torch.Generator().manual_seed(SEED + 7)
    base = torch.arange(10, dtype=torch.float32) * 0.25
    extra = {
        "rng": torch.randint(0, 256, (16,), generator=g, dtype=torch.int64).to(torch.uint8),
        "tokens_seen": torch.tensor(123456789012, dtype=torch.int64),  # 0-d int64
        "i32": torch.tensor([-3, -1, 0, 7, 2**31 - 1], dtype=torch.int32),
        "flags": torch.tensor([True, False, True]),
        "f16": torch.tensor([1.5, -2.25], dtype=torch.float16),
        "hist": [torch.randn(3, generator=g), torch.randn(2, 2, generator=g, dtype=torch.float64)],
        # (3,2) float32, stride (1,3): saved non-contiguous
        "transposed": (torch.arange(6, dtype=torch.float32) + 0.5).reshape(2, 3).t(),
        # a view whose storage is larger than the view: DCP clones it
        "view_slice": base[2:5],
        "note": "fixture",
    }
    if hasattr(torch, "float8_e4m3fn") and hasattr(torch, "uint16"):
        extra["f8"] = torch.tensor([0.5, -1.0, 2.0, 448.0]).to(torch.float8_e4m3fn)
        extra["u16"] = torch.tensor([0, 1, 40000, 65535], dtype=torch.int32).to(torch.uint16)
    return extra


# ----------------------------------------------------------------------------------------
# in-job oracle

def _classes():
    DTensor = ShardedTensor = None
    try:
        from torch.distributed.tensor import DTensor  # noqa: F811
    except ImportError:
        try:
            from torch.distributed._tensor import DTensor  # noqa: F811
        except ImportError:
            pass
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor  # noqa: F811
    except ImportError:
        pass
    return DTensor, ShardedTensor


def gather_sharded_tensor(st):
    import torch
    import torch.distributed as dist
    shards = [(list(s.metadata.shard_offsets), s.tensor.detach().cpu().clone()) for s in st.local_shards()]
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, shards)
    md = st.metadata()
    full = torch.zeros(tuple(md.size), dtype=md.tensor_properties.dtype)
    covered = torch.zeros(tuple(md.size), dtype=torch.int32)
    for rank_shards in everything:
        for off, t in rank_shards:
            idx = tuple(slice(o, o + n) for o, n in zip(off, t.shape))
            full[idx].copy_(t)
            covered[idx] += 1
    if not bool((covered == 1).all()):
        raise RuntimeError("ShardedTensor shards do not tile the tensor exactly once")
    return full


def describe(v, DTensor, ShardedTensor) -> str:
    if DTensor is not None and isinstance(v, DTensor):
        return f"DTensor{tuple(v.device_mesh.shape)}{list(map(str, v.placements))}"
    if ShardedTensor is not None and isinstance(v, ShardedTensor):
        return "ShardedTensor"
    return "tensor"


def live_oracle(state, stage: Path, hf_names: bool = False, extra_info: dict | None = None):
    """Gather every tensor of `state` (flattened like DCP does) on rank 0 and write the oracle.

    Collective: every rank must call it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    DTensor, ShardedTensor = _classes()

    flat, _mapping = flatten_state_dict(state)
    tensors, nontensors, kinds = {}, {}, {}
    keep = dist.get_rank() == 0  # only rank 0 keeps the full tensors (memory at --scale N)
    for k, v in flat.items():
        if DTensor is not None and isinstance(v, DTensor):
            kinds[k] = describe(v, DTensor, ShardedTensor)
            full = v.full_tensor().detach().cpu()  # collective
            if keep:
                tensors[k] = full.clone()
            del full
        elif ShardedTensor is not None and isinstance(v, ShardedTensor):
            kinds[k] = "ShardedTensor"
            full = gather_sharded_tensor(v)  # collective
            if keep:
                tensors[k] = full
            del full
        elif isinstance(v, torch.Tensor):
            kinds[k] = "tensor"
            if keep:
                tensors[k] = v.detach().cpu().clone()
        else:
            kinds[k] = "object"
            nontensors[k] = jsonify(v)
    # non-tensor entries of every rank (per-rank keys exist on one rank only)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, nontensors)
    for other in gathered:
        for k, v in other.items():
            nontensors.setdefault(k, v)
    if dist.get_rank() == 0:
        from safetensors.torch import save_file
        (stage / "oracle").mkdir(parents=True, exist_ok=True)
        save_file({k: tensors[k].contiguous() for k in sorted(tensors)}, str(stage / "oracle" / "full.safetensors"))
        if not hf_names:
            with open(stage / "oracle" / "nontensor.json", "w") as f:
                json.dump(nontensors, f, indent=1, sort_keys=True)
                f.write("\n")
        info = {"kinds": kinds, **(extra_info or {})}
        with open(stage / "_live.json", "w") as f:
            json.dump(info, f, indent=1)
    dist.barrier()


# ----------------------------------------------------------------------------------------
# jobs (run in every rank)

def _init(rank: int, world: int, port: int):
    import torch
    import torch.distributed as dist
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def job_fsdp2(rank, world, spec, stage, scale, hf: bool):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.checkpoint.state_dict import get_state_dict, get_model_state_dict

    dtype = torch_dtype(spec["dtype"])
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(scale, dtype, tied=spec.get("tied", False))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, sched = make_optim(model)
    loss = train_one_step(model, opt, sched, scale, rank)

    if hf:
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter
        state = get_model_state_dict(model)
        dcp.save(state, storage_writer=HuggingFaceStorageWriter("checkpoint", save_distributed=True))
        live_oracle(state, Path("."), hf_names=True, extra_info={"train_loss_rank0": loss})
    else:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optimizer": osd, "scheduler": sched.state_dict(), "step": 1, "extra": make_extra()}
        if spec.get("per_rank"):
            # what a trainer saves per rank: its data-loader position under a rank key, and an
            # RNG state under one key (identical on every rank here, so the oracle is exact)
            state["dataloader"] = {f"dp_rank_{rank}": {"epoch": 2, "samples_seen": 40 + rank, "order": [rank, 7]}}
            state["rng_state"] = torch.Generator().manual_seed(SEED).get_state()
        dcp.save(state, checkpoint_id="checkpoint")
        live_oracle(state, Path("."), extra_info={"train_loss_rank0": loss})
    dist.destroy_process_group()


def parallelize_2d(model, mesh):
    """The dtensor2d model's parallelism over a ("dp", "tp") mesh: TP (qkv/fc1 colwise,
    proj/fc2 rowwise) on tp, then FSDP2 on dp per block and at the root."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for b in model.blocks:
        parallelize_module(b, mesh["tp"], {
            "qkv": ColwiseParallel(output_layouts=Replicate()),
            "proj": RowwiseParallel(input_layouts=Replicate()),
            "fc1": ColwiseParallel(),
            "fc2": RowwiseParallel(),
        })
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def job_dtensor2d(rank, world, spec, stage, scale):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard, Replicate
    from torch.distributed.checkpoint.state_dict import get_state_dict

    hidden = 14  # 13 cannot be split colwise->rowwise over tp=2 (DTensor sharding propagation)
    mesh = init_device_mesh("cpu", tuple(spec["mesh"]), mesh_dim_names=("dp", "tp"))
    model = parallelize_2d(build_model(scale, torch.float32, hidden=hidden), mesh)
    opt, sched = make_optim(model)
    dp_rank = mesh.get_local_rank("dp")
    loss = train_one_step(model, opt, sched, scale, dp_rank, hidden)

    g = torch.Generator().manual_seed(SEED + 11)
    s = scale

    def dt(shape, placements, dtype=torch.float32):
        if dtype == torch.int64:
            full = torch.randint(-1000, 1000, shape, generator=g, dtype=torch.int64)
        else:
            full = torch.randn(shape, generator=g).to(dtype)
        return distribute_tensor(full, mesh, placements)

    tensors = {
        "s0_s1": dt((13 * s, 11 * s), [Shard(0), Shard(1)]),
        "s1_s0": dt((13 * s, 11 * s), [Shard(1), Shard(0)]),
        "s0_r": dt((7 * s, 5 * s), [Shard(0), Replicate()], torch.bfloat16),
        "r_s1": dt((3 * s, 9 * s), [Replicate(), Shard(1)], torch.float16),
        "r_r": dt((4 * s, 4 * s), [Replicate(), Replicate()], torch.float64),
        "int_s0_r": dt((10 * s, 3 * s), [Shard(0), Replicate()], torch.int64),
    }
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optimizer": osd, "tensors": tensors}
    dcp.save(state, checkpoint_id="checkpoint")
    live_oracle(state, Path("."), extra_info={"train_loss_rank0": loss, "hidden": hidden})
    dist.destroy_process_group()


def job_fsdp1(rank, world, spec, stage, scale):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType
    from torch.distributed.fsdp import ShardedStateDictConfig, ShardedOptimStateDictConfig
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = build_model(scale, torch_dtype(spec["dtype"]))
    block_cls = type(model.blocks[0])
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({block_cls}), device_id=torch.device("cpu"))
    opt, sched = make_optim(model)
    loss = train_one_step(model, opt, sched, scale, rank)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT,
                              ShardedStateDictConfig(offload_to_cpu=True),
                              ShardedOptimStateDictConfig(offload_to_cpu=True)):
        msd = model.state_dict()
        osd = FSDP.optim_state_dict(model, opt)
    state = {"model": msd, "optimizer": osd}
    dcp.save(state, checkpoint_id="checkpoint")
    live_oracle(state, Path("."), extra_info={"train_loss_rank0": loss})
    dist.destroy_process_group()


def _quiet():
    import logging
    import warnings
    if os.environ.get("RESHARD_GEN_VERBOSE"):
        return
    for cat in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=cat)
    try:  # torch 2.1 sets this logger to INFO with its own handler at import time
        import torch.distributed.checkpoint._dedup_tensors  # noqa: F401
    except ImportError:
        pass
    for name in ("torch.distributed.checkpoint", "torch.distributed.checkpoint._dedup_tensors",
                 "torch.distributed.tensor._redistribute", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _worker(rank, name, world, port, stage, scale):
    spec = CASES[name]
    _quiet()
    os.chdir(stage)
    if spec["kind"] == "fabric":
        return job_fabric(rank, world, port, spec, Path(stage), scale)
    _init(rank, world, port)
    kind = spec["kind"]
    if kind == "hf_storage":
        job_fsdp2(rank, world, spec, stage, scale, hf=True)
    elif kind == "fsdp2":
        job_fsdp2(rank, world, spec, stage, scale, hf=False)
    elif kind == "dtensor2d":
        job_dtensor2d(rank, world, spec, stage, scale)
    elif kind == "fsdp1":
        job_fsdp1(rank, world, spec, stage, scale)
    else:
        raise ValueError(kind)


def run_job(name: str, stage: Path, scale: int):
    import torch.multiprocessing as mp
    spec = CASES[name]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    port = free_port()
    mp.spawn(_worker, args=(name, spec["world"], port, str(stage), scale), nprocs=spec["world"], join=True)


# ----------------------------------------------------------------------------------------
# Lightning Fabric (torch 2.15 and torch 2.1)

def _patch_torch21_for_cpu():
    """torch 2.1 FSDP1 on CPU/gloo: no-op streams and emulated collectives (doc section 10).
    The checkpoint path itself is untouched."""
    import torch
    import torch.distributed as dist

    class _Stream:
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, *a, **k):
            pass

        def wait_event(self, *a, **k):
            pass

        def record_event(self, *a, **k):
            return None

        def synchronize(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    class _Event:
        def __init__(self, *a, **k):
            pass

        def record(self, *a, **k):
            pass

        def synchronize(self):
            pass

        def wait(self, *a, **k):
            pass

        def query(self):
            return True

    # FSDP1 (2.1) calls torch.cpu.Stream(priority=...), which 2.1 does not accept, and
    # torch.cpu.Event, which 2.1 lacks. CPU work is synchronous, so no-ops are equivalent.
    torch.cpu.Stream = _Stream
    torch.cpu.Event = _Event
    torch.cpu.current_stream = lambda *a, **k: _Stream()
    torch.cpu.stream = lambda *a, **k: _Stream()

    class _Done:
        def wait(self, *a, **k):
            return True

        def is_completed(self):
            return True

    def _group_size(group):
        return dist.get_world_size(group)

    def _as_f32(t):
        return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t

    def all_gather_into_tensor(output, input, group=None, async_op=False):
        ws = _group_size(group)
        parts = [torch.empty_like(_as_f32(input)) for _ in range(ws)]
        dist.all_gather(parts, _as_f32(input.contiguous()), group=group)
        output.view(-1).copy_(torch.cat([p.reshape(-1) for p in parts]).to(output.dtype))
        return _Done() if async_op else None

    def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        ws = _group_size(group)
        rank = dist.get_rank(group)
        buf = _as_f32(input).clone()
        dist.all_reduce(buf, op=op, group=group)
        chunk = buf.view(-1).chunk(ws)[rank]
        output.view(-1).copy_(chunk.to(output.dtype))
        return _Done() if async_op else None

    _orig_all_gather = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        # gloo in 2.1 rejects uneven all-gather: pad to the largest size
        sizes = [t.numel() for t in tensor_list]
        if len(set(sizes)) <= 1 and tensor.numel() == (sizes[0] if sizes else 0):
            return _orig_all_gather(tensor_list, tensor, group=group, async_op=async_op)
        n = max(sizes + [tensor.numel()])
        padded = torch.zeros(n, dtype=tensor.dtype)
        padded[: tensor.numel()].copy_(tensor.reshape(-1))
        outs = [torch.zeros(n, dtype=tensor.dtype) for _ in tensor_list]
        _orig_all_gather(outs, padded, group=group)
        for o, t in zip(outs, tensor_list):
            t.view(-1).copy_(o[: t.numel()])
        return _Done() if async_op else None

    dist.all_gather_into_tensor = all_gather_into_tensor
    dist._all_gather_base = all_gather_into_tensor
    dist.reduce_scatter_tensor = reduce_scatter_tensor
    dist._reduce_scatter_base = reduce_scatter_tensor
    dist.all_gather = all_gather


def job_fabric(rank, world, port, spec, stage: Path, scale):
    import torch
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["NODE_RANK"] = "0"
    torch.set_num_threads(1)
    old = torch.__version__.startswith("2.1.")
    if old:
        _patch_torch21_for_cpu()

    import torch.distributed as dist
    import lightning
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import FSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    class CPUFSDPStrategy(FSDPStrategy):
        """FSDPStrategy.setup_module, except device_id=cpu (Lightning passes root_device.index = None,
        which torch 2.15 FSDP1 rejects on CPU). Being a subclass also gets past the connector's
        'FSDP is only available on GPU' check (it tests `type(strategy) is FSDPStrategy`)."""

        def setup_module(self, module):
            from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device, _setup_activation_checkpointing
            if any(isinstance(mod, FSDP) for mod in module.modules()):
                raise RuntimeError("unexpected pre-wrapped module")
            module = FSDP(module=module, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
                          sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"),
                          **self._fsdp_kwargs)
            _move_torchmetrics_to_device(module, self.root_device)
            _setup_activation_checkpointing(module, self._activation_checkpointing_kwargs)
            return module

    model = build_model(scale, torch.float32)
    block_cls = type(model.blocks[0])
    strategy = CPUFSDPStrategy(state_dict_type="sharded", auto_wrap_policy=ModuleWrapPolicy({block_cls}),
                               process_group_backend="gloo")
    fabric = Fabric(accelerator="cpu", devices=world, num_nodes=1, strategy=strategy, precision="32-true")
    fabric.launch()
    model = fabric.setup_module(model)
    opt, _sched = make_optim(model)
    opt = fabric.setup_optimizers(opt)
    tokens, labels = batch(scale, rank)
    import torch.nn.functional as F
    loss = F.cross_entropy(model(tokens).float(), labels)
    fabric.backward(loss)
    opt.step()
    opt.zero_grad()
    fabric.save("checkpoint", {"model": model, "optimizer": opt, "step": 1})

    # oracle: what Lightning handed to DCP (same calls as FSDPStrategy.save_checkpoint)
    from lightning.fabric.wrappers import _unwrap_objects
    from lightning.fabric.strategies.fsdp import _get_sharded_state_dict_context
    st = _unwrap_objects({"model": model, "optimizer": opt})
    with _get_sharded_state_dict_context(st["model"]):
        msd = st["model"].state_dict()
        osd = FSDP.optim_state_dict(st["model"], st["optimizer"])
    live_oracle({"model": msd, "optimizer": osd}, stage,
                extra_info={"train_loss_rank0": float(loss.detach()), "lightning": lightning.__version__})
    dist.barrier()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------
# cross-checks (parent process, torch 2.15)

class Mismatch(Exception):
    pass


def _load_safetensors(path: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(path))


def _cmp_tensor(key, got, want, errors):
    e = tensor_error(key, got, want)
    if e:
        errors.append(e)


def crosscheck_dcp(ckpt: Path, oracle_dir: Path, tmp: Path) -> dict:
    """Consolidate with torch's own dcp_to_torch_save and compare with the live-job oracle."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = FileSystemReader(str(ckpt)).read_metadata()
    out = tmp / "consolidated.pt"
    dcp_to_torch_save(str(ckpt), str(out))
    sd = torch.load(str(out), weights_only=False)
    oracle = _load_safetensors(oracle_dir / "full.safetensors")
    nontensor = json.loads((oracle_dir / "nontensor.json").read_text())
    errors = []
    md_tensors = [k for k, v in md.state_dict_metadata.items() if not isinstance(v, BytesStorageMetadata)]
    md_bytes = [k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    if sorted(md_tensors) != sorted(oracle):
        errors.append(f"tensor keys differ: only in .metadata {sorted(set(md_tensors) - set(oracle))}, "
                      f"only in oracle {sorted(set(oracle) - set(md_tensors))}")
    if sorted(md_bytes) != sorted(nontensor):
        errors.append(f"non-tensor keys differ: only in .metadata {sorted(set(md_bytes) - set(nontensor))}, "
                      f"only in oracle {sorted(set(nontensor) - set(md_bytes))}")
    planner_data = md.planner_data or {}
    for k in md.state_dict_metadata:
        path = planner_data.get(k, (k,))
        v = sd
        try:
            for p in path:
                v = v[p]
        except (KeyError, IndexError, TypeError):
            errors.append(f"{k}: path {path} missing in dcp_to_torch_save output")
            continue
        if k in oracle:
            _cmp_tensor(k, v, oracle[k], errors)
        elif k in nontensor:
            if jsonify(v) != nontensor[k]:
                errors.append(f"{k}: non-tensor value {jsonify(v)!r} != {nontensor[k]!r}")
    if errors:
        raise Mismatch("dcp_to_torch_save cross-check failed:\n  " + "\n  ".join(errors))
    return {"method": "torch dcp_to_torch_save vs live-job gather", "tensors": len(md_tensors),
            "nontensors": len(md_bytes), "mismatches": 0}


def crosscheck_hf(ckpt: Path, oracle_dir: Path, tmp: Path) -> dict:
    sys.path.insert(0, str(SCRIPTS))
    import torch_interop
    expected = oracle_dir / "full.safetensors"
    n = torch_interop.check_hf_storage_dcp_load(ckpt, expected)
    skipped = torch_interop.check_hf_storage_consolidate(ckpt, expected, tmp / "consolidated")
    return {"method": "torch HuggingFaceStorageReader dcp.load(no_dist) + consolidate_safetensors_files vs live-job gather",
            "tensors": n, "consolidation_skipped_known_torch_bugs": skipped, "mismatches": 0}


def lightning_consolidate(ckpt: Path, out: Path):
    """Lightning's own consolidation (python -m lightning.fabric.utilities.consolidate_checkpoint)."""
    cmd = [sys.executable, "-m", "lightning.fabric.utilities.consolidate_checkpoint", str(ckpt),
           "--output_file", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise Mismatch(f"lightning consolidate_checkpoint failed: {r.stderr.strip()[-2000:]}")


def crosscheck_lightning(ckpt: Path, oracle_dir: Path, consolidated: Path) -> dict:
    import torch
    sd = torch.load(str(consolidated), weights_only=False)
    oracle = _load_safetensors(oracle_dir / "full.safetensors")
    errors, n = [], 0

    def walk(prefix, v):
        nonlocal n
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}" if prefix else str(k), x)
        elif isinstance(v, torch.Tensor):
            # Lightning keys optimizer state by FQN (same as DCP's nesting)
            if prefix in oracle:
                n += 1
                _cmp_tensor(prefix, v, oracle[prefix], errors)
            else:
                errors.append(f"{prefix}: tensor not in oracle")

    walk("", {k: v for k, v in sd.items() if k in ("model", "optimizer")})
    if n != len(oracle):
        errors.append(f"lightning consolidated has {n} tensors, oracle {len(oracle)}")
    if errors:
        raise Mismatch("lightning cross-check failed:\n  " + "\n  ".join(errors))
    return {"method": "lightning consolidate_checkpoint vs live-job gather", "tensors": n, "mismatches": 0,
            "meta_keys": sorted(k for k in sd if k not in ("model", "optimizer"))}


# ----------------------------------------------------------------------------------------

def venv21_python() -> str:
    v = os.environ.get("RESHARD_VENV21", str(Path.home() / ".cache/reshard/venv-torch21"))
    return str(Path(v) / "bin" / "python")


def generate(name: str, out: Path, scale: int) -> dict:
    import torch
    _quiet()
    spec = CASES[name]
    out.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=out))
    t0 = time.time()
    try:
        job_torch = torch.__version__
        if spec.get("torch21") and not torch.__version__.startswith("2.1."):
            py = venv21_python()
            if not Path(py).exists():
                raise SystemExit(f"{name}: needs the torch 2.1 venv ({py}); run scripts/setup_venv.sh --torch21 --lightning")
            cmd = [py, str(Path(__file__).resolve()), "--_job", name, "--_stage", str(stage), "--scale", str(scale)]
            subprocess.run(cmd, check=True)
            job_torch = subprocess.run([py, "-c", "import torch; print(torch.__version__)"],
                                       capture_output=True, text=True, check=True).stdout.strip()
        else:
            run_job(name, stage, scale)
        job_seconds = time.time() - t0
        live = json.loads((stage / "_live.json").read_text())
        (stage / "_live.json").unlink()
        ckpt = stage / "checkpoint"
        tmp = Path(tempfile.mkdtemp(prefix="xcheck.", dir=stage))
        checks = []
        try:
            if spec["kind"] == "hf_storage":
                checks.append(crosscheck_hf(ckpt, stage / "oracle", tmp))
            else:
                checks.append(crosscheck_dcp(ckpt, stage / "oracle", tmp))
            if spec["kind"] == "fabric":
                lc = stage / "oracle" / "lightning_consolidated.pt"
                lightning_consolidate(ckpt, lc)
                checks.append(crosscheck_lightning(ckpt, stage / "oracle", lc))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        case = {
            "case": name,
            "generator": "scripts/gen_fixtures.py",
            "torch": job_torch,
            "crosschecked_with_torch": torch.__version__,
            "python": sys.version.split()[0],
            "world_size": spec["world"],
            "mesh": spec.get("mesh", [spec["world"]]),
            "dtype": spec["dtype"],
            "scale": scale,
            "seed": SEED,
            "model_dims": dims(scale, live.get("hidden", 13)),
            "writer": spec["writer"],
            "exercises": spec["exercises"],
            "train_loss_rank0": live.get("train_loss_rank0"),
            "crosscheck": checks,
            "keys": live["kinds"],
            "checkpoint_files": dir_sizes(ckpt),
            "oracle_files": dir_sizes(stage / "oracle"),
        }
        if "lightning" in live:
            case["lightning"] = live["lightning"]
            import lightning
            case["lightning_consolidated_by"] = (
                f"python -m lightning.fabric.utilities.consolidate_checkpoint (lightning {lightning.__version__}, "
                f"torch {torch.__version__}); Lightning's consolidation needs torch >= 2.3")
        case["checkpoint_bytes"] = sum(case["checkpoint_files"].values())
        case["oracle_bytes"] = sum(case["oracle_files"].values())
        with open(stage / "case.json", "w") as f:
            json.dump(case, f, indent=1)
            f.write("\n")
        _fix_modes(stage)
        final = out / name
        if final.exists():
            shutil.rmtree(final)
        stage.rename(final)
        case["_seconds"] = time.time() - t0
        case["_job_seconds"] = job_seconds
        return case
    except BaseException:
        keep = os.environ.get("RESHARD_KEEP_FAILED")
        if keep:
            print(f"{name}: failed; staging dir kept at {stage}", file=sys.stderr)
        else:
            shutil.rmtree(stage, ignore_errors=True)
        raise


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures"))
    ap.add_argument("--only", nargs="+", metavar="NAME", help="cases to generate (default: all)")
    ap.add_argument("--skip", nargs="+", metavar="NAME", default=[], help="cases to leave out")
    ap.add_argument("--scale", type=int, default=1, help="multiply model widths (default 1 = tiny)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--_job", help=argparse.SUPPRESS)
    ap.add_argument("--_stage", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a._job:  # inner mode (torch 2.1 venv): only the distributed job
        run_job(a._job, Path(a._stage), a.scale)
        return 0
    if a.list:
        for n, s in CASES.items():
            print(f"{n:32s} world={s['world']} {s['dtype']:9s} {s['writer']}")
        return 0
    # bench=True cases are sources for scripts/compare.py, not committed fixtures: only with --only
    names = a.only or [n for n, c in CASES.items() if not c.get("bench")]
    unknown = [n for n in names + a.skip if n not in CASES]
    if unknown:
        ap.error(f"unknown case(s): {unknown}; known: {list(CASES)}")
    names = [n for n in names if n not in a.skip]
    out = Path(a.out).resolve()
    summary = []
    for n in names:
        print(f"== {n}: generating (world size {CASES[n]['world']}, scale {a.scale}) ...", flush=True)
        c = generate(n, out, a.scale)
        print(f"   ok in {c['_seconds']:.1f}s (job {c['_job_seconds']:.1f}s): checkpoint {c['checkpoint_bytes']:,} B "
              f"in {len(c['checkpoint_files'])} files, oracle {c['oracle_bytes']:,} B; "
              f"cross-check: {'; '.join(x['method'] for x in c['crosscheck'])}", flush=True)
        summary.append(c)
    print("\nsummary:")
    total = 0
    for c in summary:
        b = c["checkpoint_bytes"] + c["oracle_bytes"]
        total += b
        print(f"  {c['case']:32s} torch {c['torch']:16s} ws={c['world_size']} {c['dtype']:9s} {b:>12,} B  {c['_seconds']:.1f}s")
    print(f"  {'total':32s} {total:,} B written under {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
