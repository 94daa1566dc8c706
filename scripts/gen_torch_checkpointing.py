#!/usr/bin/env python3
"""Generate REAL torch_checkpointing checkpoints (Meta's ``torch-checkpointing``) for reshard.

Every case runs the library's own ``CheckpointManager.save`` (synchronous saver) on CPU under
torchrun with ``world`` gloo processes, after one AdamW step of a tiny MLP. At world > 1 the model
is wrapped with FSDP2 (``fully_shard`` on a ``("fsdp",)`` mesh: DTensor ``Shard(0)``), and the
optimizer state dict holds DTensors too. Items saved: ``model`` (model.state_dict()),
``optimizer`` (opt.state_dict()) and ``step`` (an int), each with the library's
``DefaultResharder``. Output, per case, under <out>/<case>/:

  checkpoint/              exactly what the library wrote: model_R.pt, optimizer_R.pt, step_R.pt
                           (one torch.save file per item per rank) and metadata.pkl
  oracle/model.safetensors the library's OWN load of the checkpoint at world 1 (a fresh
                           single-process ``CheckpointManager.load`` into an unsharded model's
                           state dict: it reshards on load itself)
  oracle/optim.safetensors the same load's optimizer state, keys ``state.<param index>.<name>``
  case.json                versions, world size, what it exercises

CPU settings (docs/troubleshooting of the library): no pinned memory
(``CheckpointStagerConfig(use_pinned_memory=False)``), ``use_direct_io=False`` (O_DIRECT writes
fail on tmpfs/overlay with EINVAL), and its metadata gather (``_all_gather_pickled_data``) puts
its buffers on ``cuda``: it is patched here to ``dist.all_gather_object``, which gloo carries.

Usage:
  python scripts/gen_torch_checkpointing.py [--out tests/fixtures/torch_checkpointing] [--only NAME ...]
Needs: scripts/setup_venv.sh --torch-checkpointing (torch-checkpointing --no-deps).
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import _gen  # noqa: E402
from _torchrun import job  # noqa: E402

CASES = {
    "w1": dict(world=1, exercises=["single process: plain tensors, one rank file per item"]),
    "fsdp2_w2": dict(world=2, exercises=["FSDP2 DTensor Shard(0) on a ('fsdp',) mesh over 2 gloo ranks",
                                         "uneven shards (7 rows over 2 ranks)",
                                         "AdamW state as per-parameter DTensors, step as a scalar"]),
}
SEED = 1234


def build():
    import torch

    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5))


def patch_cpu():
    """The library's metadata gather assumes cuda; on CPU gather the pickled data with gloo."""
    import torch.distributed as dist
    from torch_checkpointing import metadata_manager

    def gather(self, data, process_group=None):
        out = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(out, data, group=process_group)
        return dict(enumerate(out))

    metadata_manager.DefaultMetadataManager._all_gather_pickled_data = gather


def manager():
    from torch_checkpointing import CheckpointManager, ItemSpec, SyncCheckpointSaverConfig
    from torch_checkpointing.default_resharder import DefaultResharder
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    patch_cpu()
    spec = ItemSpec(resharder=DefaultResharder())
    save = SyncCheckpointSaverConfig()  # no staging: nothing pinned (the async saver's
    # CheckpointStagerConfig(use_pinned_memory=False) is the troubleshooting doc's CPU setting)
    return CheckpointManager(CheckpointManager.Config(
        items={"model": spec, "optimizer": spec, "step": ItemSpec()}, save=save,
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))


def train(model):
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    torch.manual_seed(SEED + 1)
    x = torch.randn(4, 6)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return opt


def blank(model):
    """An optimizer with state for ``model`` to load into (one step), then the parameters
    and every state tensor zeroed: what a load must fill."""
    import torch

    opt = train(model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                v.zero_()
    return opt


def worker(args):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    model = build()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",)))
    opt = train(model)
    manager().save(args.dir, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1})
    dist.barrier()
    dist.destroy_process_group()


def oracle_load(args):
    """The library's own load at world 1 into an unsharded model and optimizer."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    dist.init_process_group("gloo")
    model = build()
    opt = blank(model)
    msd, osd = model.state_dict(), opt.state_dict()
    got = manager().load(args.dir, into={"model": msd, "optimizer": osd, "step": None})
    oracle = Path(args.oracle)
    save_file({k: v.detach().clone().contiguous() for k, v in got["model"].items()},
              str(oracle / "model.safetensors"))
    flat = {}
    for idx, st in got["optimizer"]["state"].items():
        for name, v in st.items():
            if torch.is_tensor(v):
                flat[f"state.{idx}.{name}"] = v.detach().clone().contiguous()
    save_file(flat, str(oracle / "optim.safetensors"))
    (oracle / "step.txt").write_text(f"{got['step']!r}\n")
    dist.destroy_process_group()


def generate(name, out):
    import torch
    import torch_checkpointing

    spec = CASES[name]
    case_dir = out / name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    (case_dir / "oracle").mkdir(parents=True)
    ckpt = case_dir / "checkpoint"
    job("gen_torch_checkpointing", Path(__file__), spec["world"],
        ["--worker", "save", "--dir", str(ckpt)])
    job("gen_torch_checkpointing", Path(__file__), 1,
        ["--worker", "load", "--dir", str(ckpt), "--oracle", str(case_dir / "oracle")])
    from importlib.metadata import version
    info = dict(spec, torch_checkpointing=version("torch-checkpointing"), torch=torch.__version__, seed=SEED,
                model="Sequential(Linear(6,7), ReLU, Linear(7,5)), one AdamW step",
                writer="torch_checkpointing.CheckpointManager.save (SyncCheckpointSaverConfig)",
                oracle="torch_checkpointing.CheckpointManager.load at world 1 into an unsharded model",
                files=_gen.files(ckpt))
    _gen.write_case(case_dir, info, "gen_torch_checkpointing", name)
    del torch_checkpointing


def main():
    ap = _gen.parser(__doc__, REPO / "tests/fixtures/torch_checkpointing", ["save", "load"])
    ap.add_argument("--oracle")
    args = ap.parse_args()
    if args.mode:
        return (worker if args.mode == "save" else oracle_load)(args)
    _gen.generate_cases(ap, args, CASES, generate, "gen_torch_checkpointing")


if __name__ == "__main__":
    main()
