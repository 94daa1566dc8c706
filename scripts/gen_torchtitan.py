#!/usr/bin/env python3
"""Generate REAL torchtitan checkpoint folders (+ torchtitan's own loading as the oracle) for
reshard.

Every case runs a real job under torchrun (`N` local processes, gloo, CPU, OMP_NUM_THREADS=1)
that builds torchtitan 0.3.0's own training components around the tiny model below, wrapped
with FSDP2 (`torch.distributed.fsdp.fully_shard`, uneven and empty chunks at N = 2 and 3):

  - `OptimizersContainer` (two AdamW parameter groups matched by regex, implementation
    "for-loop"), whose state dict is torchtitan's flat FQN-keyed layout
    (`state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`, ...);
  - `LRSchedulersContainer` built by its Config (warmup + linear decay; saves `last_epoch`);
  - `ParallelAwareDataloader` (torchtitan's dataloader, a torchdata StatefulDataLoader) over a
    small stateful per-rank dataset: it saves `dp_rank_<r>` (pickled loader state, per rank)
    and `world_size`;
  - a `train_state` with the trainer's own state dict (`step`, `ntokens_seen`: what
    torchtitan.trainer.Trainer saves under `train_state`);
  - `CheckpointManager` (torchtitan.components.checkpoint), which saves them with its own
    `save(step)` into `checkpoint/step-<n>/` (DCP): model keys without prefix,
    `optimizer.*`, `lr_scheduler.*`, `dataloader.*`, `train_state.*`.

It trains 10 steps and saves at steps 2 and 10 (`step-10` sorts before `step-2` as text).
Output, per case, under <out>/<case>/:

  checkpoint/step-<n>/            exactly what torchtitan's CheckpointManager wrote
  oracle/step-<n>.safetensors     torchtitan's own loading: a fresh FSDP2 model and fresh
                                  containers at world size 1, `CheckpointManager.load(step=n)`
                                  (dataloader excluded: torchtitan refuses to load it at another
                                  dp degree), then every tensor gathered (`full_tensor()`) and
                                  keyed as in the checkpoint: model keys bare, optimizer state
                                  as `optimizer.state.<fqn>.<exp_avg|exp_avg_sq|step>`
  oracle/step-<n>.json            the non-tensor values torchtitan loaded at world size 1
                                  (`optimizer.param_groups.<fqn>.<key>`, `lr_scheduler.last_epoch`,
                                  `train_state.step`, `train_state.ntokens_seen`; tuples -> lists)
                                  and, under `dataloader`, what each rank saved
                                  (`dataloader.dp_rank_<r>`: the pickled bytes as hex and their
                                  unpickled state; `dataloader.world_size`)
  case.json                       versions, world size, dtype, how it was run, cross-checks done,
                                  file sizes

Cross-checks (the job fails otherwise): the world-size-1 load equals, byte for byte, the state
the training job held when it saved (gathered live with `full_tensor()`), and the non-tensor
values equal; loading each step at the case's own world size through CheckpointManager
(dataloader included) gives the same state, and every rank's dataloader then yields the very
batch the training run drew after that save.

The other mode loads any torchtitan-layout DCP folder (reshard's output) with
CheckpointManager at world size M and dumps what it loaded:

  python scripts/gen_torchtitan.py --load FOLDER --case NAME --world M --step N --dump OUT.safetensors

(FOLDER holds `step-<N>/`; dataloader excluded unless --with-dataloader; OUT.json beside the
dump gets the non-tensor values.)

Usage:
  .venv/bin/python scripts/gen_torchtitan.py [--out tests/fixtures/torchtitan] [--only NAME ...] [--list]
Needs: torchtitan 0.3.0 and the few of its dependencies these components import
(scripts/setup_venv.sh --torchtitan: torchtitan --no-deps, tyro, torchdata, spmd-types).
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import _gen
from _torchrun import job

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
SEED = 4321
STEPS = 10
SAVE_AT = (2, 10)
LOCAL_BATCH = 2
SEQ = 5
VOCAB = 11

CASES: dict[str, dict] = {
    "fsdp2_w2_f32": dict(world=2, dtype="float32"),
    "fsdp2_w3_f32": dict(world=3, dtype="float32"),
    "fsdp2_w3_bf16": dict(world=3, dtype="bfloat16"),
}


# ---------------------------------------------------------------------------- the job's parts

def make_model(dtype_name: str, shard: bool = True):
    """The tiny model (dims chosen for uneven chunks at 2 and 3 ranks; `scale` has one
    element, so some ranks hold an empty chunk), wrapped with FSDP2 over every rank (with
    `shard`; a plain module otherwise)."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_embeddings = nn.Embedding(VOCAB, 6)
            self.norm = nn.LayerNorm(6, bias=False)
            self.fc1 = nn.Linear(6, 7)
            self.output = nn.Linear(7, VOCAB, bias=False)
            self.scale = nn.Parameter(torch.ones(1) * 1.5)
            self.register_buffer("pos", torch.arange(SEQ, dtype=torch.float32) / 4)

        def forward(self, x):
            h = self.norm(self.tok_embeddings(x))
            h = torch.relu(self.fc1(h)) + self.pos.to(h.dtype).unsqueeze(-1)
            return self.output(h) * self.scale

    torch.manual_seed(SEED)
    model = Tiny()
    model.to(getattr(torch, dtype_name))
    if shard:
        fully_shard(model.fc1)
        fully_shard(model)
    return model


# (regex, AdamW hyperparameters) of the two parameter groups; first match wins: norms, biases
# and `scale` without weight decay
GROUPS = [
    (r"(norm|bias|scale)", dict(lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)),
    (r".*", dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)),
]


def make_optimizers(model):
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    cfg = OptimizersContainer.Config(
        implementation="for-loop",
        param_groups=[ParamGroupConfig(pattern=pat, optimizer_name="AdamW", optimizer_kwargs=dict(kw))
                      for pat, kw in GROUPS],
    )
    return OptimizersContainer(cfg, model_parts=[model])


def make_lr_schedulers(optimizers):
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    return LRSchedulersContainer.Config(warmup_steps=3, decay_type="linear", min_lr_factor=0.1).build(
        optimizers=optimizers, training_steps=STEPS)


class TrainState:
    """What torchtitan's Trainer saves under `train_state` (Trainer.state_dict)."""

    def __init__(self):
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step = sd["step"]
        self.ntokens_seen = sd["ntokens_seen"]


def make_dataset(rank: int):
    """A small infinite, stateful token stream of one dp rank (torchtitan's text datasets are
    IterableDatasets with `state_dict` too: their position rides in the loader's state)."""
    import torch
    from torch.utils.data import IterableDataset

    class Tokens(IterableDataset):
        def __init__(self):
            self.rank = rank
            self.sample_idx = 0

        def __iter__(self):
            while True:
                g = torch.Generator().manual_seed(SEED * 100 + self.rank * 1000 + self.sample_idx)
                t = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
                self.sample_idx += 1
                yield t[:-1], t[1:]

        def state_dict(self):
            return {"sample_idx": self.sample_idx, "rank": self.rank}

        def load_state_dict(self, sd):
            self.sample_idx = sd["sample_idx"]

    return Tokens()


def make_dataloader(rank: int, world: int):
    from torchtitan.components.dataloader import ParallelAwareDataloader

    return ParallelAwareDataloader(make_dataset(rank), dp_rank=rank, dp_world_size=world,
                                   batch_size=LOCAL_BATCH, num_workers=0)


def make_checkpointer(folder: str, model, optimizers, lr_schedulers, dataloader, train_state,
                      exclude=()):
    from torchtitan.components.checkpoint import CheckpointManager

    cfg = CheckpointManager.Config(enable=True, folder=folder, interval=1, keep_latest_k=0,
                                   async_mode="disabled", exclude_from_loading=list(exclude))
    return CheckpointManager(cfg, dataloader=dataloader, model_parts=[model], optimizers=optimizers,
                             lr_schedulers=lr_schedulers, states={"train_state": train_state},
                             sd_adapter=None)


def parts(rank: int, world: int, dtype_name: str):
    model = make_model(dtype_name)
    optimizers = make_optimizers(model)
    return dict(model=model, optimizers=optimizers, lr_schedulers=make_lr_schedulers(optimizers),
                dataloader=make_dataloader(rank, world), train_state=TrainState())


def full(t):
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().cpu().clone().contiguous()


def jsonable(v):
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, bytes):
        return {"bytes_hex": v.hex()}
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
        return v.item()
    return v


def held_state(p) -> tuple[dict, dict]:
    """Every tensor the components hold, gathered (a collective: call on every rank), keyed as
    the checkpoint keys them; and the non-tensor values (dataloader excluded)."""
    import torch

    tensors, values = {}, {}
    for k, v in p["model"].state_dict().items():
        tensors[k] = full(v)
    for k, v in p["optimizers"].state_dict().items():
        if isinstance(v, torch.Tensor):
            tensors[f"optimizer.{k}"] = full(v)
        else:
            values[f"optimizer.{k}"] = jsonable(v)
    for k, v in p["lr_schedulers"].state_dict().items():
        values[f"lr_scheduler.{k}"] = jsonable(v)
    for k, v in p["train_state"].state_dict().items():
        values[f"train_state.{k}"] = jsonable(v)
    return tensors, values


def train_step(p, it, world):
    import torch
    import torch.nn.functional as F

    x, y = next(it)
    logits = p["model"](x)
    loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
    loss.backward()
    p["optimizers"].step()
    p["lr_schedulers"].step()
    p["optimizers"].zero_grad()
    p["train_state"].step += 1
    p["train_state"].ntokens_seen += x.numel() * world
    return loss.item()


# ---------------------------------------------------------------------------- the workers

def save_job(rank, world, case, folder, scratch):
    """Train and save with CheckpointManager; dump the held state at each save, each rank's
    dataloader state and the batch drawn right after each save."""
    import torch
    from safetensors.torch import save_file

    spec = CASES[case]
    p = parts(rank, world, spec["dtype"])
    ckpt = make_checkpointer(folder, **p)
    it = iter(p["dataloader"])
    record = {"losses": [], "next_batch": {}, "dataloader": {}}
    for step in range(1, STEPS + 1):
        record["losses"].append(train_step(p, it, world))
        if step in SAVE_AT:
            assert ckpt.save(step)
            tensors, values = held_state(p)
            dl = p["dataloader"].state_dict()
            record["dataloader"][str(step)] = {k: jsonable(v) for k, v in dl.items()}
            if rank == 0:
                save_file(tensors, os.path.join(scratch, f"held-{step}.safetensors"))
                Path(scratch, f"held-{step}.json").write_text(json.dumps(values, indent=1, sort_keys=True))
            # the batch the run draws next (the resume check's reference); the loop goes on
            # with it consumed, which only shifts the data later steps see
            x, y = next(it)
            record["next_batch"][str(step)] = x.tolist()
    Path(scratch, f"rank{rank}.json").write_text(json.dumps(record))
    ckpt.close()
    torch.distributed.barrier()


def load_job(rank, world, case, folder, step, dump, with_dataloader):
    """Fresh components at this world size, CheckpointManager.load(step); dump the state held
    after it (rank 0) and, with the dataloader, each rank's next batch."""
    from safetensors.torch import save_file

    spec = CASES[case]
    p = parts(rank, world, spec["dtype"])
    exclude = () if with_dataloader else ("dataloader",)
    ckpt = make_checkpointer(folder, **p, exclude=exclude)
    assert ckpt.load(step=step), f"nothing loaded from {folder} step {step}"
    tensors, values = held_state(p)
    if rank == 0:
        save_file(tensors, dump)
        Path(dump).with_suffix(".json").write_text(json.dumps(values, indent=1, sort_keys=True))
    if with_dataloader:
        x, _ = next(iter(p["dataloader"]))
        Path(dump).with_suffix(f".rank{rank}.batch.json").write_text(json.dumps(x.tolist()))
    ckpt.close()


def worker(args):
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        if args.mode == "save":
            save_job(rank, world, args.case, args.dir, args.scratch)
        else:
            load_job(rank, world, args.case, args.dir, args.step, args.dump, args.with_dataloader)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- the driver

def torchrun(n, argv):
    job("gen_torchtitan", Path(__file__).resolve(), n, argv,
        env={"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")})


def load_with_torchtitan(folder, case, world, step, dump, with_dataloader=False):
    argv = ["--worker", "load", "--case", case, "--dir", str(folder), "--step", str(step), "--dump", str(dump)]
    if with_dataloader:
        argv.append("--with-dataloader")
    torchrun(world, argv)


def same_tensors(a: dict, b: dict, what: str):
    import torch

    if set(a) != set(b):
        raise SystemExit(f"gen_torchtitan: {what}: keys differ: {sorted(set(a) ^ set(b))}")
    for k in a:
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(
                x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            raise SystemExit(f"gen_torchtitan: {what}: `{k}` differs")


def generate(name, out):
    import torch
    import torchtitan
    from safetensors.torch import load_file, save_file

    spec = CASES[name]
    world = spec["world"]
    case_dir = out / name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    (case_dir / "oracle").mkdir(parents=True)
    ckpt = case_dir / "checkpoint"
    checks = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # the job writes under a relative folder "checkpoint" (as torchtitan's default
        # `checkpoint.folder`), from the case folder
        cwd = os.getcwd()
        os.chdir(case_dir)
        try:
            torchrun(world, ["--worker", "save", "--case", name, "--dir", "checkpoint", "--scratch", str(tmp)])
        finally:
            os.chdir(cwd)
        ranks = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]
        for step in SAVE_AT:
            held = load_file(str(tmp / f"held-{step}.safetensors"))
            held_values = json.loads((tmp / f"held-{step}.json").read_text())
            # the oracle: torchtitan's own loading at world size 1
            dump = tmp / f"one-{step}.safetensors"
            load_with_torchtitan(ckpt, name, 1, step, dump)
            loaded = load_file(str(dump))
            loaded_values = json.loads(dump.with_suffix(".json").read_text())
            same_tensors(loaded, held, f"{name} step {step}: world-size-1 load vs held at save")
            if loaded_values != held_values:
                raise SystemExit(f"gen_torchtitan: {name} step {step}: non-tensor values differ after load")
            # the same at the case's own world size, dataloader included: same state, same next batch
            dump_n = tmp / f"own-{step}.safetensors"
            load_with_torchtitan(ckpt, name, world, step, dump_n, with_dataloader=True)
            same_tensors(load_file(str(dump_n)), held, f"{name} step {step}: world-size-{world} load vs held")
            for r in range(world):
                got = json.loads(dump_n.with_suffix(f".rank{r}.batch.json").read_text())
                if got != ranks[r]["next_batch"][str(step)]:
                    raise SystemExit(f"gen_torchtitan: {name} step {step}: rank {r}'s dataloader resumed elsewhere")
            save_file(loaded, str(case_dir / "oracle" / f"step-{step}.safetensors"))
            values = dict(sorted(loaded_values.items()))
            dl = {}
            for r in range(world):
                saved = ranks[r]["dataloader"][str(step)]
                raw = bytes.fromhex(saved[f"dp_rank_{r}"]["bytes_hex"])
                dl[f"dataloader.dp_rank_{r}"] = {"bytes_hex": raw.hex(), "state": jsonable(pickle.loads(raw))}
                dl["dataloader.world_size"] = saved["world_size"]
            values["dataloader"] = dl
            (case_dir / "oracle" / f"step-{step}.json").write_text(json.dumps(values, indent=1) + "\n")
        checks = [
            "CheckpointManager.load at world size 1 (fresh FSDP2 model and containers, dataloader excluded) "
            "== the state held at save (full_tensor), byte for byte, and the same non-tensor values",
            f"CheckpointManager.load at world size {world} with the dataloader == held state; every rank's "
            "dataloader then yields the batch the training run drew after the save",
        ]
    files = _gen.files(ckpt)
    info = dict(
        spec, torch=torch.__version__, torchtitan=getattr(torchtitan, "__version__", "?"),
        steps=STEPS, saved_steps=list(SAVE_AT), local_batch=LOCAL_BATCH, seq=SEQ,
        run=f"torchrun --nproc-per-node {world} (gloo, CPU, OMP_NUM_THREADS=1): FSDP2 fully_shard(fc1, root); "
            "torchtitan OptimizersContainer (AdamW x2 groups, for-loop), LRSchedulersContainer "
            "(warmup 3, linear decay), ParallelAwareDataloader, train_state {step, ntokens_seen}; "
            f"CheckpointManager(folder='checkpoint', interval=1, keep_latest_k=0).save(step) at {list(SAVE_AT)}",
        oracle="CheckpointManager.load(step) at world size 1 into fresh components, tensors full_tensor()'d",
        cross_checks=checks, files=files)
    _gen.write_case(case_dir, info, "gen_torchtitan", name)


def main():
    ap = _gen.parser(__doc__, REPO / "tests/fixtures/torchtitan", ["save", "load"])
    ap.add_argument("--load", type=Path, help="load this folder (holding step-<N>/) with CheckpointManager")
    ap.add_argument("--world", type=int)
    ap.add_argument("--step", type=int, default=-1)
    ap.add_argument("--dump", type=Path)
    ap.add_argument("--with-dataloader", action="store_true")
    ap.add_argument("--scratch")
    args = ap.parse_args()
    if args.mode:
        return worker(args)
    if args.load:
        if not (args.case in CASES and args.world and args.dump):
            ap.error("--load needs --case NAME, --world M and --dump OUT.safetensors")
        load_with_torchtitan(args.load, args.case, args.world, args.step, args.dump, args.with_dataloader)
        return
    _gen.generate_cases(ap, args, CASES, generate, "gen_torchtitan")


if __name__ == "__main__":
    main()
