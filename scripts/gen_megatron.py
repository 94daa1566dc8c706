#!/usr/bin/env python3
"""Generate REAL megatron-core `dist_checkpointing` checkpoints (torch_dist backend) for reshard.

Every case runs megatron-core itself on CPU: `python -m torch.distributed.run --nproc-per-node
TP*DP` (gloo, master 127.0.0.1, a free port), each rank builds its part of the tiny model's
sharded state dict below by hand (the way megatron-core's own `sharded_state_dict()` methods
do) and `megatron.core.dist_checkpointing.save(sharded_sd, dir)` writes it with the default
torch_dist strategy. Output, per case, under <out>/<case>/:

  checkpoint/                   exactly what megatron-core wrote: metadata.json, common.pt,
                                .metadata (the DCP pickle) and __<rank>_<thread>.distcp
  oracle/full.safetensors       every sharded tensor, loaded back UNSHARDED by megatron-core's own
                                `dist_checkpointing.load` in a job of ONE process (a TP=1, DP=1
                                request: stacked layers as per-layer ShardedTensors with
                                prepend_axis_num=1, flattened optimizer tensors as one whole flat
                                range), under the checkpoint's keys, in the real (unflattened) shape
  oracle/nontensor.json         common.pt (`load_common_state_dict`) and every ShardedObject shard
                                (loaded by `dist_checkpointing.load`), bytes as hex
  oracle/loads.json             megatron-core's loads of the checkpoint at other splits: TP=1 with
                                `load_plain_tensors`, TP=4 (4 processes), a wrong global shape (the
                                "Global shape mismatch" users hit, NVIDIA/Megatron-LM#1490), and for
                                flattened cases a load by the other megatron-core version
  case.json                     versions, TP/DP, processes, what each key exercises, files and sizes,
                                how it was run

Every loaded tensor is also checked against the values the generator put in (the global tensors are
a function of the key alone), so the oracle is megatron-core's own reading AND known-correct.

Cases: megatron-core 0.16.1 at TP=2 x DP=1, TP=2 x DP=2 (replicas stored once) and TP=4; megatron-core
0.15.3 (the last release with `ShardedTensor.from_rank_offsets_flat` / `flattened_range`) at
TP=2 x DP=2 and TP=2 x DP=1, adding distributed-optimizer-style flattened tensors, stored reshaped
as [X/x, Y/y, x*y] with the real shape in `.metadata`'s `mcore_data`.

Usage:
  python3 scripts/gen_megatron.py --setup      # create the two venvs below (idempotent)
  python3 scripts/gen_megatron.py [--out tests/fixtures/megatron] [--only NAME ...] [--list]

Any python3 runs the driver; the jobs run in their case's venv (not the project's .venv):
  ~/.cache/reshard/venv-mcore016: python3 -m venv ...; pip install torch==2.15.0 megatron-core==0.16.1 safetensors psutil
  ~/.cache/reshard/venv-mcore015: python3 -m venv ...; pip install torch==2.15.0 megatron-core==0.15.3 safetensors psutil
(`--setup` runs exactly that; RESHARD_MCORE016_VENV / RESHARD_MCORE015_VENV override the paths.)
The torch wheel from PyPI is the CUDA build (~3 GB with its nvidia-* deps); it runs on CPU.
megatron-core 0.15.3 pulls numpy<2; under numpy 2 it would need `np.product = np.prod` (done below
anyway). Transformer Engine / Apex are not needed (megatron-core warns and falls back).

What it took on CPU (done in `_cpu_patches`): `torch.cuda.synchronize` made a no-op and
`torch.cuda.current_device` return "cpu" (megatron's writer calls both); the script is import-safe
(all work under `if __name__ == "__main__"`), because megatron's FileSystemWriterAsync starts a
`spawn` multiprocessing Manager that re-imports the main module; rank 0 creates the directory
before a barrier (`save` expects it to exist); OMP_NUM_THREADS=1.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import _gen
from _torchrun import job

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
CACHE = Path.home() / ".cache/reshard"
VENVS = {
    "0.16.1": Path(os.environ.get("RESHARD_MCORE016_VENV", CACHE / "venv-mcore016")),
    "0.15.3": Path(os.environ.get("RESHARD_MCORE015_VENV", CACHE / "venv-mcore015")),
}
TORCH = "2.15.0"
LAYERS = 2

# name -> spec
CASES: dict[str, dict] = {
    "mcore016_tp2_dp1": dict(mcore="0.16.1", tp=2, dp=1, flat=False),
    "mcore016_tp2_dp2": dict(mcore="0.16.1", tp=2, dp=2, flat=False),
    "mcore016_tp4_dp1": dict(mcore="0.16.1", tp=4, dp=1, flat=False),
    "mcore015_tp2_dp2_flat": dict(mcore="0.15.3", tp=2, dp=2, flat=True),
    "mcore015_tp2_dp1_flat": dict(mcore="0.15.3", tp=2, dp=1, flat=True),
}

# The tiny GPT-like model: key -> (global shape, TP axis of the LOCAL tensor or None for
# replicated over TP, layer-stacked (prepend_axis_num=1: global axis 0 is the layer), what it exercises)
MODEL = {
    "embedding.word_embeddings.weight": ((16, 8), 0, False,
                                         "2-D, TP split along dim 0 (vocab/column parallel), no prepended axis"),
    "mlp_head.linear_fc2.weight": ((8, 12), 1, False, "2-D, TP split along dim 1 (row parallel), no prepended axis"),
    "mlp_head.linear_fc2.bias": ((8,), None, False,
                                 "1-D bias replicated over TP and DP: replica_id (0, tp, dp), stored once"),
    "decoder.layers.self_attention.linear_qkv.weight": (
        (LAYERS, 12, 8), 0, True,
        "layer-stacked: one ShardedTensor per layer with prepend_axis_num=1, (0, layer, L) + TP along local dim 0"),
    "decoder.layers.self_attention.linear_proj.weight": (
        (LAYERS, 8, 12), 1, True, "layer-stacked (prepend_axis_num=1), TP along local dim 1"),
    "decoder.layers.input_layernorm.weight": (
        (LAYERS, 8), None, True, "layer-stacked (prepend_axis_num=1), replicated over TP"),
    "decoder.final_layernorm.weight": ((8,), None, False, "1-D replicated over TP and DP"),
}
# Distributed-optimizer-style flattened tensors (0.15 only): key -> (model key it shadows, DP cut
# points as fractions of each local shard's numel: the flat ranges are uneven on purpose)
FLAT = {
    "optimizer.state.exp_avg.embedding.word_embeddings.weight": ("embedding.word_embeddings.weight", 0.42),
    "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight":
        ("decoder.layers.self_attention.linear_qkv.weight", 0.5),
    "optimizer.state.exp_avg.mlp_head.linear_fc2.weight": ("mlp_head.linear_fc2.weight", 0.42),
    "optimizer.state.exp_avg.decoder.final_layernorm.weight": ("decoder.final_layernorm.weight", 0.4),
}
COMMON = {"iteration": 7, "checkpoint_version": 3.0, "num_floating_point_operations_so_far": 123456,
          "note": "reshard megatron fixture", "model_config": {"hidden": 8, "layers": LAYERS, "vocab": 16}}


# --------------------------------------------------------------------------- values and sharding

def global_tensor(key, shape):
    """The global value of a key: a function of the key alone (all ranks and loaders agree)."""
    import torch

    seed = sum((i + 1) * ord(c) for i, c in enumerate(key)) % (2 ** 31)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32)


def local_slice(full, tp_axis, stacked, tp, tp_rank, layer=None):
    """This TP rank's local tensor (of one layer if stacked)."""
    t = full[layer] if stacked else full
    if tp_axis is not None:
        n = t.shape[tp_axis] // tp
        t = t.narrow(tp_axis, tp_rank * n, n)
    return t.contiguous().clone()


def flat_ranges(numel, dp, frac):
    """DP flat ranges of a local shard of `numel` elements: uneven cut at `frac` for dp=2."""
    if dp == 1:
        return [(0, numel)]
    assert dp == 2
    cut = max(1, min(numel - 1, int(numel * frac)))
    return [(0, cut), (cut, numel)]


def model_sharded_sd(tp, tp_rank, dp_rank, keys=None):
    """The model part of a rank's sharded state dict, as megatron-core's layers build it
    (`keys`: checkpoint key -> the MODEL key whose shape and sharding it has)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    sd = {}
    for key, mkey in (keys or {k: k for k in MODEL}).items():
        shape, tp_axis, stacked, _ = MODEL[mkey]
        full = global_tensor(key, shape)
        replica = (0, 0, dp_rank) if tp_axis is not None else (0, tp_rank, dp_rank)
        offs = [] if tp_axis is None else [(tp_axis + (1 if stacked else 0), tp_rank, tp)]
        if stacked:
            for layer in range(shape[0]):
                loc = local_slice(full, tp_axis, stacked, tp, tp_rank, layer)
                # state-dict key per layer (as in megatron: decoder.layers.<i>...), one checkpoint key
                sd_key = key.replace("decoder.layers.", f"decoder.layers.{layer}.")
                sd[sd_key] = ShardedTensor.from_rank_offsets(key, loc, (0, layer, shape[0]), *offs,
                                                             replica_id=replica, prepend_axis_num=1)
        else:
            loc = local_slice(full, tp_axis, stacked, tp, tp_rank)
            sd[key] = ShardedTensor.from_rank_offsets(key, loc, *offs, replica_id=replica)
    return sd


def flat_sharded_sd(tp, tp_rank, dp, dp_rank):
    """Distributed-optimizer-style flattened tensors (megatron-core <= 0.15): each DP rank holds a
    contiguous range of the flattened TP-local shard (from_rank_offsets_flat, flattened_range)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    sd = {}
    for key, (mkey, frac) in FLAT.items():
        shape, tp_axis, stacked, _ = MODEL[mkey]
        full = global_tensor(key, shape)
        replica = (0, 0, 0) if tp_axis is not None else (0, tp_rank, 0)
        offs = [] if tp_axis is None else [(tp_axis + (1 if stacked else 0), tp_rank, tp)]
        for layer in (range(shape[0]) if stacked else [None]):
            loc = local_slice(full, tp_axis, stacked, tp, tp_rank, layer)
            lo, hi = flat_ranges(loc.numel(), dp, frac)[dp_rank]
            data = loc.reshape(-1)[lo:hi].clone()
            extra = [(0, layer, shape[0])] if stacked else []
            sd_key = key if not stacked else key.replace("decoder.layers.", f"decoder.layers.{layer}.")
            sd[sd_key] = ShardedTensor.from_rank_offsets_flat(
                key, data, tuple(loc.shape), *extra, *offs, replica_id=replica,
                prepend_axis_num=1 if stacked else 0, flattened_range=slice(lo, hi))
    return sd


def objects_sd(tp, tp_rank, dp, dp_rank, rank, world):
    from megatron.core.dist_checkpointing import ShardedObject

    # like megatron's rng_state: sharded over (PP, TP), replicated over DP (replica_id = dp rank)
    rng = {"random_rng_state": bytes((tp_rank * 37 + i * 11) % 256 for i in range(24)),
           "seed": 1234 + tp_rank, "tp_rank": tp_rank}
    # one object per process (1-D, shard per global rank)
    dl = {"consumed_samples": 96, "rank": rank, "blob": bytes([rank] * 5)}
    return {
        "rng_state": ShardedObject("rng_state", rng, (1, tp), (0, tp_rank), replica_id=dp_rank),
        "dataloader_state": ShardedObject("dataloader_state", dl, (world,), (rank,), replica_id=0),
    }


def expected_objects(tp, dp):
    """unique_key -> value of every ShardedObject shard the case stores."""
    out = {}
    world = tp * dp
    for rank in range(world):
        tp_rank, dp_rank = rank % tp, rank // tp
        for o in objects_sd(tp, tp_rank, dp, dp_rank, rank, world).values():
            if all(r == 0 for r in ([o.replica_id] if isinstance(o.replica_id, int) else o.replica_id)):
                out[o.unique_key] = o.data
    return out


def expected_full(spec):
    out = {k: global_tensor(k, v[0]) for k, v in MODEL.items()}
    if spec["flat"]:
        out.update({k: global_tensor(k, MODEL[m][0]) for k, (m, _) in FLAT.items()})
    return out


# --------------------------------------------------------------------------- worker side

def _cpu_patches():
    import numpy as np
    import torch

    if not hasattr(np, "product"):  # megatron-core 0.15 under numpy 2
        np.product = np.prod
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"


def _init():
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    import torch
    import torch.distributed as dist

    _cpu_patches()
    dist.init_process_group("gloo")
    return torch, dist


def worker_save(args):
    torch, dist = _init()
    from megatron.core import dist_checkpointing

    spec = CASES[args.case]
    rank, world = dist.get_rank(), dist.get_world_size()
    tp, dp = spec["tp"], spec["dp"]
    assert world == tp * dp
    tp_rank, dp_rank = rank % tp, rank // tp  # megatron's default order: TP fastest
    sd = dict(COMMON)
    sd["model"] = model_sharded_sd(tp, tp_rank, dp_rank)
    if spec["flat"]:
        sd["optimizer"] = flat_sharded_sd(tp, tp_rank, dp, dp_rank)
    sd.update(objects_sd(tp, tp_rank, dp, dp_rank, rank, world))
    if rank == 0:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sd, args.dir)
    dist.barrier()
    if rank == 0:
        import megatron.core

        Path(args.json).write_text(json.dumps({"megatron_core": megatron.core.__version__,
                                               "torch": torch.__version__}) + "\n")
    dist.destroy_process_group()


def _request(spec, tp, tp_rank, dp, dp_rank, ckpt_flat, unflattened=False):
    """The sharded state dict a model at (tp, dp) would load with (no data); `unflattened`:
    the optimizer's keys as regular tensors of their real shapes, sharded as their parameters
    (how megatron-core >= 0.16, which has no flattened ranges, asks for them)."""
    sd = {"model": model_sharded_sd(tp, tp_rank, dp_rank)}
    if ckpt_flat and unflattened:
        sd["optimizer"] = model_sharded_sd(tp, tp_rank, dp_rank, keys={k: m for k, (m, _) in FLAT.items()})
    elif ckpt_flat:
        sd["optimizer"] = flat_sharded_sd(tp, tp_rank, dp, dp_rank)
    for part in sd.values():
        for v in part.values():
            v.data = None
    return sd


def _flatten_loaded(spec, loaded, tp, tp_rank, dp, dp_rank, unflattened=False):
    """Map a loaded sharded state dict back to checkpoint key -> pieces (for checks)."""
    out = []
    req = _request(spec, tp, tp_rank, dp, dp_rank, spec["flat"], unflattened)
    for part in req:
        for sd_key, sh in req[part].items():
            out.append((sh, loaded[part][sd_key]))
    return out


def _check_pieces(spec, pieces):
    """Compare every loaded local piece with the truth; return the number of mismatches."""
    import torch

    truth = expected_full(spec)
    bad = []
    for sh, got in pieces:
        full = truth[sh.key]
        sl = sh.global_slice()
        want = full[sl]
        if getattr(sh, "flattened_range", None) is not None:
            want = want.reshape(-1)[sh.flattened_range]
        if tuple(got.shape) != tuple(want.shape) or not torch.equal(got, want):
            bad.append(sh.key)
    return bad


def _err(e):
    msg = f"{type(e).__name__}: {e}"
    return msg if len(msg) < 600 else msg[:600] + " ..."


def worker_oracle(args):
    """World size 1: megatron-core's own full (TP=1, DP=1) load + the other checks."""
    torch, dist = _init()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject
    from safetensors.torch import save_file

    import megatron.core

    spec = CASES[args.case]
    ckpt = args.dir
    truth = expected_full(spec)
    res = {"megatron_core": megatron.core.__version__}
    out = Path(args.oracle)

    # 1. the oracle: a TP=1, DP=1 model's request, loaded by dist_checkpointing.load
    req = _request(spec, 1, 0, 1, 0, spec["flat"])
    # (megatron-core 0.16.1's load_sharded_metadata fails under torch 2.15: it passes
    # TensorProperties.__dict__, which now has `strides`, to torch.empty; the objects' keys are
    # the checkpoint's BYTE_IO entries)
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    dcp_meta = FileSystemReader(str(ckpt)).read_metadata()
    obj_keys = sorted(k for k, v in dcp_meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    req["objects"] = {k: ShardedObject.empty_from_unique_key(k) for k in obj_keys}
    loaded = dist_checkpointing.load(req, ckpt)
    full = {}
    for part in ("model", "optimizer"):
        for sd_key, sh in req.get(part, {}).items():
            t = loaded[part][sd_key]
            if getattr(sh, "flattened_range", None) is not None:
                t = t.reshape(sh.local_shape)  # the whole flat range of a TP=1 shard
            if sh.prepend_axis_num:
                layer = sh.global_offset[0]
                full.setdefault(sh.key, [None] * sh.global_shape[0])[layer] = t
            else:
                full[sh.key] = t
    full = {k: (torch.stack(v) if isinstance(v, list) else v).contiguous() for k, v in full.items()}
    assert set(full) == set(truth), (sorted(full), sorted(truth))
    for k, v in full.items():
        assert torch.equal(v, truth[k]), f"oracle mismatch for {k}"
    save_file(full, str(out / "full.safetensors"))

    common = dist_checkpointing.load_common_state_dict(ckpt)
    objs = {k: loaded["objects"][k] for k in obj_keys}
    want_objs = expected_objects(spec["tp"], spec["dp"])
    assert objs == want_objs, (objs, want_objs)
    (out / "nontensor.json").write_text(json.dumps({"common.pt": common, "sharded_objects": objs},
                                                   indent=1, default=_jsonable) + "\n")
    res["full_load_tp1"] = {"api": "dist_checkpointing.load(TP=1 request, world size 1)", "ok": True,
                            "objects": obj_keys}

    # 2. load_plain_tensors (every tensor whole, as the checkpoint metadata describes it)
    try:
        plain = dist_checkpointing.load_plain_tensors(ckpt)
        shapes = {k: list(v.shape) for k, v in sorted(plain.items())}
        same = sorted(k for k, v in plain.items() if k in truth and tuple(v.shape) == tuple(truth[k].shape)
                      and torch.equal(v, truth[k]))
        res["load_plain_tensors"] = {"ok": True, "shapes": shapes, "equal_to_oracle": same,
                                     "not_equal": sorted(set(plain) - set(same))}
    except BaseException as e:  # noqa: BLE001 (torch.distributed.checkpoint raises CheckpointException, a BaseException)
        res["load_plain_tensors"] = {"ok": False, "error": _err(e)}
    try:
        md = dist_checkpointing.load_tensors_metadata(ckpt)
    except BaseException as e:  # noqa: BLE001 (torch.distributed.checkpoint raises CheckpointException, a BaseException)
        md = {}
        res["load_tensors_metadata_error"] = _err(e)
    res["load_tensors_metadata"] = {k: {"global_shape": list(v.global_shape), "dtype": str(v.dtype),
                                        "flattened_range": (None if getattr(v, "flattened_range", None) is None
                                                            else [v.flattened_range.start, v.flattened_range.stop])}
                                    for k, v in sorted(md.items())}

    # 3. the mistake behind "Global shape mismatch" (NVIDIA/Megatron-LM#1490): a model that declares
    #    its TP-local shard as the global tensor (TP=2's [8, 8] against the stored [16, 8])
    from megatron.core.dist_checkpointing import ShardedTensor

    k = "embedding.word_embeddings.weight"
    bad = {"w": ShardedTensor.from_rank_offsets(k, torch.empty(8, 8))}
    try:
        dist_checkpointing.load(bad, ckpt)
        res["wrong_global_shape"] = {"request": {k: [8, 8]}, "ok": True}
    except BaseException as e:  # noqa: BLE001 (torch.distributed.checkpoint raises CheckpointException, a BaseException)
        res["wrong_global_shape"] = {"request": {k: [8, 8]}, "ok": False, "error": _err(e)}
    if spec["flat"]:
        # a flattened key requested as a regular (non-flat) tensor of its real shape
        fk = "optimizer.state.exp_avg.embedding.word_embeddings.weight"
        try:
            got = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets(fk, torch.empty(16, 8))}, ckpt)["w"]
            res["flat_key_as_regular"] = {"request": {fk: [16, 8]}, "ok": True, "equal": torch.equal(got, truth[fk])}
        except BaseException as e:  # noqa: BLE001 (torch.distributed.checkpoint raises CheckpointException, a BaseException)
            res["flat_key_as_regular"] = {"request": {fk: [16, 8]}, "ok": False, "error": _err(e)}
    Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    dist.destroy_process_group()


def worker_reload(args):
    """Load at another split (TP = args.tp, DP = world / TP) with dist_checkpointing.load and
    check every piece against the truth."""
    torch, dist = _init()
    from megatron.core import dist_checkpointing

    import megatron.core

    spec = CASES[args.case]
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = args.tp
    dp = world // tp
    tp_rank, dp_rank = rank % tp, rank // tp
    req = _request(spec, tp, tp_rank, dp, dp_rank, spec["flat"], args.unflattened)
    ok, err, bad = True, None, []
    try:
        loaded = dist_checkpointing.load(req, args.dir)
        bad = _check_pieces(spec, _flatten_loaded(spec, loaded, tp, tp_rank, dp, dp_rank, args.unflattened))
    except BaseException as e:  # noqa: BLE001 (torch.distributed.checkpoint raises CheckpointException, a BaseException)
        ok, err = False, _err(e)
    flags = torch.tensor([0 if ok else 1, len(bad)])
    dist.all_reduce(flags)
    if rank == 0:
        r = {"megatron_core": megatron.core.__version__, "tp": tp, "dp": dp, "processes": world,
             "ok": ok and int(flags[0]) == 0, "values_equal": ok and int(flags[1]) == 0}
        if err:
            r["error"] = err
        if bad:
            r["mismatched_keys"] = sorted(set(bad))
        Path(args.json).write_text(json.dumps(r, indent=1) + "\n")
    dist.destroy_process_group()


def worker_crossver(args):
    """Another megatron-core version reading the checkpoint (world size 1): what its metadata
    reader and load_plain_tensors make of it."""
    torch, dist = _init()
    from megatron.core import dist_checkpointing

    import megatron.core

    spec = CASES[args.case]
    truth = expected_full(spec)
    r = {"megatron_core": megatron.core.__version__}
    try:
        md = dist_checkpointing.load_tensors_metadata(args.dir)
        r["load_tensors_metadata"] = {k: list(v.global_shape) for k, v in sorted(md.items())}
        plain = dist_checkpointing.load_plain_tensors(args.dir)
        r["load_plain_tensors_ok"] = True
        r["equal_to_oracle"] = sorted(k for k, v in plain.items()
                                      if tuple(v.shape) == tuple(truth[k].shape) and torch.equal(v, truth[k]))
        r["not_equal"] = sorted(set(plain) - set(r["equal_to_oracle"]))
        r["plain_shapes_not_equal"] = {k: list(plain[k].shape) for k in r["not_equal"]}
    except BaseException as e:  # noqa: BLE001 (torch.distributed.checkpoint raises CheckpointException, a BaseException)
        r["error"] = _err(e)
    Path(args.json).write_text(json.dumps(r, indent=1) + "\n")
    dist.destroy_process_group()


def _jsonable(o):
    if isinstance(o, bytes):
        return {"__bytes_hex__": o.hex()}
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"not JSON: {type(o)}")


# --------------------------------------------------------------------------- driver side

def venv_python(version):
    return VENVS[version] / "bin/python"


def setup():
    for version, venv in VENVS.items():
        py = venv / "bin/python"
        want = f"megatron-core=={version}"
        if py.exists():
            r = subprocess.run([str(py), "-c", "import importlib.metadata as m, safetensors, torch;"
                                "print(m.version('megatron-core'), m.version('torch'))"],
                               capture_output=True, text=True)
            if r.returncode == 0 and r.stdout.split() == [version, TORCH]:
                print(f"gen_megatron: {venv}: megatron-core {version}, torch {TORCH}: ok")
                continue
        else:
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", f"torch=={TORCH}", want, "safetensors", "psutil"], check=True)
        print(f"gen_megatron: {venv}: installed {want}, torch {TORCH}")


def torchrun(version, nproc, argv):
    py = venv_python(version)
    if not py.exists():
        raise SystemExit(f"gen_megatron: no venv for megatron-core {version} at {py.parent.parent}; "
                         "run: python3 scripts/gen_megatron.py --setup")
    return job("gen_megatron", Path(__file__), nproc, argv, python=py,
               env={"PYTHONWARNINGS": "ignore", "PYTHONPATH": None})


def run_steps(spec, nproc, mode):
    return (f"{venv_python(spec['mcore']).parent.parent.name}/bin/python -m torch.distributed.run "
            f"--nproc-per-node {nproc} --master-addr 127.0.0.1 --master-port <free> "
            f"scripts/gen_megatron.py --worker {mode} ...")


def generate(name, out):
    spec = CASES[name]
    tp, dp = spec["tp"], spec["dp"]
    case_dir = out / name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    (case_dir / "oracle").mkdir(parents=True)
    ckpt = case_dir / "checkpoint"
    tmp = case_dir / "tmp"
    tmp.mkdir()
    times = {}
    times["save"] = torchrun(spec["mcore"], tp * dp, ["--worker", "save", "--case", name, "--dir", str(ckpt),
                                                      "--json", str(tmp / "versions.json")])
    versions = json.loads((tmp / "versions.json").read_text())
    times["oracle"] = torchrun(spec["mcore"], 1, ["--worker", "oracle", "--case", name, "--dir", str(ckpt),
                                                  "--oracle", str(case_dir / "oracle"),
                                                  "--json", str(tmp / "oracle.json")])
    loads = json.loads((tmp / "oracle.json").read_text())
    for other_tp, nproc in ((1, 2), (4, 4)):
        label = f"tp{other_tp}_dp{nproc // other_tp}"
        times[f"load_{label}"] = torchrun(spec["mcore"], nproc, ["--worker", "reload", "--case", name, "--dir",
                                                                 str(ckpt), "--tp", str(other_tp),
                                                                 "--json", str(tmp / f"{label}.json")])
        loads[f"load_{label}"] = json.loads((tmp / f"{label}.json").read_text())
    if spec["flat"]:
        other = next(v for v in VENVS if v != spec["mcore"])
        times["crossver"] = torchrun(other, 1, ["--worker", "crossver", "--case", name, "--dir", str(ckpt),
                                                "--json", str(tmp / "crossver.json")])
        loads[f"read_by_megatron_core_{other}"] = json.loads((tmp / "crossver.json").read_text())
    (case_dir / "oracle/loads.json").write_text(json.dumps(loads, indent=1) + "\n")
    shutil.rmtree(tmp)

    files = _gen.files(ckpt)
    keys = {k: dict(global_shape=list(v[0]), tp_split_local_dim=v[1], prepend_axis_num=int(v[2]), exercises=v[3])
            for k, v in MODEL.items()}
    if spec["flat"]:
        for k, (m, frac) in FLAT.items():
            shape, tp_axis, stacked, _ = MODEL[m]
            local = list(shape[1:] if stacked else shape)
            if tp_axis is not None:
                local[tp_axis] //= tp
            n = 1
            for s in local:
                n *= s
            keys[k] = dict(global_shape=list(shape), tp_split_local_dim=tp_axis, prepend_axis_num=int(stacked),
                           local_shape=local, dp_flat_ranges=flat_ranges(n, dp, frac),
                           exercises="flattened (distributed optimizer) ShardedTensor.from_rank_offsets_flat: "
                                     "stored as [X/x, ..., x*y] with the real shape in mcore_data")
    keys["rng_state"] = dict(sharded_object=True, global_shape=[1, tp],
                             exercises="ShardedObject over (PP=1, TP), replica_id = dp rank: one shard per TP rank")
    keys["dataloader_state"] = dict(sharded_object=True, global_shape=[tp * dp],
                                    exercises="ShardedObject with one shard per process")
    info = dict(spec, megatron_core=versions["megatron_core"], torch=versions["torch"], processes=tp * dp,
                layout="rank = dp_rank * TP + tp_rank (TP fastest); replica_id (pp, tp, dp)-style tuples; "
                       "a shard is stored by the rank whose replica_id is all zeros",
                common=sorted(COMMON), keys=keys,
                oracle="oracle/full.safetensors: dist_checkpointing.load of a TP=1, DP=1 request in a world of "
                       "1 process; checked equal to the generated values; oracle/nontensor.json: "
                       "load_common_state_dict + the ShardedObjects from dist_checkpointing.load",
                steps=[f"python3 -m venv {VENVS[spec['mcore']]}; pip install torch=={TORCH} "
                       f"megatron-core=={spec['mcore']} safetensors (python3 scripts/gen_megatron.py --setup)",
                       "CPU patches in each worker: torch.cuda.synchronize = no-op, torch.cuda.current_device = "
                       "lambda: 'cpu'; np.product = np.prod if numpy 2; OMP_NUM_THREADS=1; gloo process group",
                       "script import-safe (megatron's writer starts a spawn multiprocessing Manager that "
                       "re-imports __main__); rank 0 mkdirs the checkpoint dir, barrier",
                       "save: " + run_steps(spec, tp * dp, "save") + " -> dist_checkpointing.save(sharded_sd, dir)",
                       "oracle: " + run_steps(spec, 1, "oracle"),
                       "other splits: " + run_steps(spec, 2, "reload") + " --tp 1 and with 4 processes --tp 4"],
                seconds=times, files=files)
    _gen.write_case(case_dir, info, "gen_megatron", name,
                    f"; {sum(times.values()):.0f} s ({', '.join(f'{k} {v}' for k, v in times.items())})")


def main():
    ap = _gen.parser(__doc__, REPO / "tests/fixtures/megatron", ["save", "oracle", "reload", "crossver"])
    ap.add_argument("--setup", action="store_true", help="create the megatron-core venvs (idempotent)")
    ap.add_argument("--oracle")
    ap.add_argument("--json")
    ap.add_argument("--tp", type=int)
    ap.add_argument("--unflattened", action="store_true",
                    help="reload: ask for flattened keys as regular tensors of their real shapes")
    args = ap.parse_args()
    if args.mode:
        {"save": worker_save, "oracle": worker_oracle, "reload": worker_reload,
         "crossver": worker_crossver}[args.mode](args)
        # the work is done and written: leave without running C++ destructors (a gloo/megatron
        # thread still joinable at exit aborts the process: "terminate called without an
        # active exception")
        import multiprocessing

        for child in multiprocessing.active_children():
            child.kill()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if args.setup:
        return setup()
    _gen.generate_cases(ap, args, CASES, generate, "gen_megatron")


if __name__ == "__main__":
    main()
