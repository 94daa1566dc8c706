#!/usr/bin/env python3
"""Generate Megatron-LM `--ckpt-format fsdp_dtensor` checkpoints (Megatron-FSDP, `--use-megatron-fsdp`)
of the tiny Llama-style megatron-core GPTModel of scripts/gen_frameworks.py, with their oracles.

Every case builds the seeded GPTModel of gen_frameworks.py (same configuration, same seeds: at TP 2
its weights are those of tests/fixtures/frameworks/llama_tp2) on CPU under torchrun (gloo, one
process per TP x FSDP rank), computes its logits, saves it with megatron-core's own
`dist_checkpointing.save` (the torch_dist oracle) and exports it with mbridge (the Hugging Face
oracle), then wraps it in megatron-core's Megatron-FSDP (`FullyShardedDataParallel` of
megatron.core.distributed.fsdp.mcore_fsdp_adapter, `data_parallel_sharding_strategy
optim_grads_params`, the wrapper Megatron-LM's get_model builds for `--use-megatron-fsdp`) and
saves it the way Megatron-LM's save_checkpoint does for `--ckpt-format fsdp_dtensor`: its
`generate_state_dict` (the wrapper's `state_dict_for_save_checkpoint()`: DTensors over the
(dp_cp, tp) device mesh), `num_floating_point_operations_so_far`, its
`preprocess_fsdp_dtensor_state_dict` (SwiGLU's linear_fc1 split into `weight_w` / `weight_v`,
the uneven chunks' metadata), and `torch.distributed.checkpoint.save` through a
`FileSystemWriter`; the tracker file written as Megatron-LM writes it. Output, per case, under
<out>/<case>/:

  fsdp_dtensor/  the Megatron-LM save directory: latest_checkpointed_iteration.txt ("7") and
                 iter_0000007/ (.metadata + __R_0.distcp), no optimizer (as with --no-save-optim)
  torch_dist/    megatron-core's dist_checkpointing.save of the same model (iter_0000007/ and the
                 tracker, as in gen_frameworks.py)
  hf_mbridge/    mbridge's save_weights of the same model
  inputs.json, logits.safetensors   the tokens and the megatron model's fp32 logits
  case.json      the case: tp, fsdp, the model, versions, files, the DCP keys and chunks

What is megatron's code and what is not: the model, the Megatron-FSDP wrapper and its sharding,
`generate_state_dict`, `preprocess_fsdp_dtensor_state_dict` and the `args` (Megatron-LM's own
parse_args + validate_args for `--use-megatron-fsdp --ckpt-format fsdp_dtensor`) are megatron's
code at core_v0.16.1, run unchanged; `torch.distributed.checkpoint.save` is torch's. What is
emulated: the few lines of save_checkpoint around them (the directory, the tracker file,
`rng_state` built as its get_rng_state builds it for fsdp_dtensor but without `cuda_rng_state`,
no rerun-state-machine entry) — save_checkpoint itself needs a whole training setup (timers,
optimizer, schedulers). CPU shims (Megatron-FSDP is written for CUDA): torch.cuda.current_device
returns 0, torch.cuda.Stream / current_stream / stream are no-ops,
torch.cuda.get_rng_state an empty tensor and set_rng_state a no-op (with TP the wrapper broadcasts
the generators of TP rank 0 to its group), and the DeviceMesh Megatron-FSDP
builds from its process groups is built on "cpu" (gloo) instead of "cuda"; the wrapper is given
device=cpu; and the adapter's `TELinear` (a MagicMock placeholder without TransformerEngine, which its TP
attribute fix-up passes to isinstance) is a class nothing is an instance of, as the local layer spec has no
TransformerEngine layers. Nothing of the format is written by hand.

Usage:
  python3 scripts/gen_megatron_fsdp.py [--out tests/fixtures/megatron_fsdp] [--only NAME ...] [--list]
        [--megatron-lm DIR]

Needs what gen_frameworks.py needs (the venv with megatron-core 0.16.1, transformers, mbridge, and
Megatron-LM's training sources at tag core_v0.16.1).
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import _gen
import gen_frameworks as gf
from _torchrun import job

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
ITERATION = gf.ITERATION

# name -> tensor-parallel size and FSDP (data-parallel) size
CASES = {
    "llama_fsdp2": dict(tp=1, fsdp=2),
    "llama_tp2_fsdp2": dict(tp=2, fsdp=2),
}


def model_config(case: str) -> dict:
    """The gen_frameworks BASE model with the vocabulary padded for this case's TP."""
    m = dict(gf.BASE)
    mult = m["make_vocab_size_divisible_by"] * CASES[case]["tp"]
    m["padded_vocab_size"] = -(-m["vocab_size"] // mult) * mult
    return m


def _cpu_shims(torch):
    """What Megatron-FSDP needs to run on CPU (see the module's doc)."""
    import contextlib

    from torch.distributed.device_mesh import DeviceMesh

    class _Stream:
        def __init__(self, *a, **k):
            pass

        def wait_stream(self, *a, **k):
            pass

        def synchronize(self):
            pass

    torch.cuda.Stream = _Stream
    torch.cuda.current_stream = lambda *a, **k: _Stream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.current_device = lambda: 0
    torch.cuda.empty_cache = lambda: None
    # (with TP, the wrapper broadcasts TP rank 0's generators, CUDA's among them, to its TP group)
    torch.cuda.get_rng_state = lambda *a, **k: torch.zeros(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda *a, **k: None
    from_group = DeviceMesh.from_group

    def on_cpu(*a, **k):
        k["device_type"] = "cpu"
        return from_group(*a, **k)

    DeviceMesh.from_group = staticmethod(on_cpu)


def worker_save(args):
    torch, dist = gf._init()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject
    from safetensors.torch import save_file

    spec = CASES[args.case]
    tp = spec["tp"]
    m = model_config(args.case)
    ps = gf._parallel(tp, 1, 1)
    tp_rank = ps.get_tensor_model_parallel_rank()
    dp_rank = ps.get_data_parallel_rank()
    rank = dist.get_rank()
    import random

    import numpy as np

    random.seed(1234)
    np.random.seed(1234)
    torch.manual_seed(1234)
    model = gf.build_model(m, tp, 1, 1, 0)
    gf.seed_parameters(model, tp_rank, 0, 0)
    out = Path(args.dir)
    logits = gf.forward_logits(model, m, 1, 0, ps.get_pipeline_model_parallel_group(), dist)
    if tp_rank == 0 and dp_rank == 0:
        save_file({"logits": logits}, str(out / "logits.safetensors"))

    mlm = Path(args.megatron_lm)
    flops = 123456789
    it = f"iter_{ITERATION:07d}"
    # --- the torch_dist oracle, as gen_frameworks.py writes it
    import os

    # (Megatron-LM's validate_args wants CUDA_DEVICE_MAX_CONNECTIONS 1 with TP, and not 1 with
    # Megatron-FSDP: each set of args is made as its own job would be started)
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    margs = gf.megatron_lm_args(m, tp, 1, 1, "torch_dist", mlm)
    content_metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    rng = ShardedObject("rng_state", [gf._rng_state(tp_rank)], (1, tp), (0, tp_rank), replica_id=dp_rank)
    sd = {"args": margs, "checkpoint_version": 3.0, "iteration": ITERATION,
          "model": model.sharded_state_dict(metadata=content_metadata), "rng_state": rng,
          "num_floating_point_operations_so_far": flops}
    td = out / "torch_dist"
    if rank == 0:
        (td / it).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sd, str(td / it), content_metadata=content_metadata)
    dist.barrier()
    if rank == 0:
        (td / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    gf.mbridge_export(model, m, out / "hf_mbridge")
    dist.barrier()

    # --- Megatron-FSDP and the fsdp_dtensor save
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"
    fargs = gf.megatron_lm_args(m, tp, 1, 1, "fsdp_dtensor", mlm,
                                extra=["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                       "optim_grads_params", "--no-save-optim"])
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.training import global_vars
    from megatron.training.checkpointing import generate_state_dict, preprocess_fsdp_dtensor_state_dict

    global_vars.set_args(fargs)
    _cpu_shims(torch)  # (after the forward pass and the torch_dist save, which want current_device "cpu")
    import dataclasses

    # the DistributedDataParallelConfig Megatron-LM's get_model builds from the args
    kwargs = {f.name: getattr(fargs, f.name) for f in dataclasses.fields(DistributedDataParallelConfig)
              if hasattr(fargs, f.name)}
    kwargs["grad_reduce_in_fp32"] = fargs.accumulate_allreduce_grads_in_fp32
    kwargs["check_for_nan_in_grad"] = fargs.check_for_nan_in_loss_and_grad
    kwargs["check_for_large_grads"] = fargs.check_for_large_grads
    kwargs["bucket_size"] = None  # (no --overlap-grad-reduce)
    ddp_config = DistributedDataParallelConfig(**kwargs)
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    if not isinstance(mcore_fsdp_adapter.TELinear, type):  # (a MagicMock without TransformerEngine)
        mcore_fsdp_adapter.TELinear = type("NoTELinear", (), {})
    wrapped = FullyShardedDataParallel(config=model.config, ddp_config=ddp_config, module=model,
                                       device=torch.device("cpu"))
    # get_rng_state's fsdp_dtensor branch (less cuda_rng_state: no CUDA here)
    rng_state = {f"(0, {tp_rank})": [gf._rng_state(tp_rank)]}
    state_dict = generate_state_dict(fargs, [wrapped], None, None, rng_state, iteration=ITERATION)
    state_dict["num_floating_point_operations_so_far"] = flops
    state_dict = preprocess_fsdp_dtensor_state_dict(fargs, state_dict, wrapped)
    fd = out / "fsdp_dtensor"
    if rank == 0:
        (fd / it).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    writer = torch.distributed.checkpoint.FileSystemWriter(str(fd / it))
    torch.distributed.checkpoint.save(state_dict=state_dict, storage_writer=writer)
    dist.barrier()
    if rank == 0:
        (fd / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dist.barrier()
    dist.destroy_process_group()


WORKERS = {"save": worker_save}


def dcp_layout(folder: Path) -> dict:
    """Each tensor key of a DCP checkpoint: its global shape and its chunks (offsets, sizes)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return {k: {"size": list(v.size), "chunks": [[list(c.offsets), list(c.sizes)] for c in v.chunks]}
            for k, v in md.items() if isinstance(v, TensorStorageMetadata)}


def generate(name: str, out_root: Path, megatron_lm: Path) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import mbridge
    import megatron.core
    import torch
    import transformers
    from safetensors.torch import load_file

    spec = CASES[name]
    nproc = spec["tp"] * spec["fsdp"]
    case = out_root / name
    if case.exists():
        shutil.rmtree(case)
    case.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        secs = job(name, Path(__file__), nproc,
                   ["--worker", "save", "--case", name, "--dir", str(case), "--megatron-lm", str(megatron_lm)],
                   env={"PYTHONWARNINGS": "ignore", "CUDA_DEVICE_MAX_CONNECTIONS": "8"}, cwd=Path(tmp))
    (case / "inputs.json").write_text(json.dumps({"input_ids": gf.INPUT_IDS}) + "\n")
    want = load_file(str(case / "logits.safetensors"))["logits"]
    got = gf.hf_logits(case / "hf_mbridge")
    diff = float((got - want).abs().max())
    assert diff <= 1e-5, f"{name}: transformers' logits of mbridge's export differ from megatron's by {diff}"
    info = {"case": name, "tp": spec["tp"], "fsdp": spec["fsdp"], "processes": nproc, "model": model_config(name),
            "iteration": ITERATION, "input_ids": gf.INPUT_IDS, "hf_mbridge_logits_max_abs_diff": diff,
            "versions": {"torch": torch.__version__, "megatron_core": megatron.core.__version__,
                         "transformers": transformers.__version__, "mbridge": mbridge.__version__,
                         "megatron_lm_args": "core_v0.16.1"},
            "fsdp_dtensor_tensors": dcp_layout(case / "fsdp_dtensor" / f"iter_{ITERATION:07d}"),
            "job_seconds": secs, "files": _gen.files(case)}
    _gen.write_case(case, info, "gen_megatron_fsdp", name, f"; logits vs transformers: {diff:.2e}")


def main():
    ap = _gen.parser(__doc__, REPO / "tests" / "fixtures" / "megatron_fsdp", list(WORKERS))
    ap.add_argument("--megatron-lm", type=Path, default=gf.default_megatron_lm(),
                    help="Megatron-LM sources at tag core_v0.16.1 (for the saved args)")
    args = ap.parse_args()
    if args.mode:
        WORKERS[args.mode](args)
        return
    if not args.list and not (args.megatron_lm / "megatron" / "training" / "arguments.py").is_file():
        ap.error(f"no Megatron-LM training sources at {args.megatron_lm} (see --help)")
    _gen.generate_cases(ap, args, CASES, lambda n, out: generate(n, out, args.megatron_lm), "gen_megatron_fsdp")


if __name__ == "__main__":
    sys.path.insert(0, str(SCRIPTS))
    main()
