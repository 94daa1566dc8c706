#!/usr/bin/env python3
"""Write a DCP checkpoint shaped like a large FSDP2 + AdamW job, small enough to fit on disk.

The state dict is a Llama-shaped model of ``--layers`` decoder layers (9 parameters each,
plus the embedding, the final norm and the output projection) with AdamW's ``exp_avg`` and
``exp_avg_sq`` for every parameter, each tensor sharded ``Shard(0)`` over ``--ranks`` ranks as
FSDP2 does, so the checkpoint has ``3 × (9 L + 3) × N`` chunks (``--layers 80 --ranks 512``:
2,169 tensors, 1.11 million chunks, Llama-70B on 512 ranks). Tensors are tiny (``--rows``
rows per rank, 1 or 2 columns), so the data stays small while the metadata has its real size.

Everything is written by torch's own code, as ``dcp.save`` would on N ranks, without a process
group: each rank's ``SavePlan`` of ``WriteItem``s is made here (what ``DefaultSavePlanner``
makes of an FSDP2 state dict), torch's ``DefaultSavePlanner.create_global_plan`` turns the N
plans into the global plan and the ``Metadata``, ``FileSystemWriter.write_data`` writes each
rank's ``__<r>_0.distcp`` (one ``torch.save`` item per chunk) and ``FileSystemWriter.finish``
pickles ``.metadata``. Ranks are written by ``--jobs`` worker processes.

Values are deterministic: element ``(i, j)`` of tensor number ``t`` is
``t * 1000 + i * cols + j`` (float32, rounded), so any consolidation can be checked against
:func:`expected`.

    .venv/bin/python scripts/gen_scale_dcp.py OUT --layers 80 --ranks 512
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import sys
import time

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

LAYER_PARAMS = [
    ("self_attn.q_proj.weight", 2),
    ("self_attn.k_proj.weight", 2),
    ("self_attn.v_proj.weight", 2),
    ("self_attn.o_proj.weight", 2),
    ("mlp.gate_proj.weight", 2),
    ("mlp.up_proj.weight", 2),
    ("mlp.down_proj.weight", 2),
    ("input_layernorm.weight", 1),
    ("post_attention_layernorm.weight", 1),
]


def params(layers: int) -> list[tuple[str, int]]:
    """(name, number of dimensions) of every model parameter, in module order."""
    out = [("embed_tokens.weight", 2)]
    for i in range(layers):
        out += [(f"layers.{i}.{n}", d) for n, d in LAYER_PARAMS]
    out += [("norm.weight", 1), ("lm_head.weight", 2)]
    return out


def tensors(layers: int) -> list[tuple[str, tuple, int]]:
    """(fqn, planner path, dims) of every state-dict tensor: parameters, then AdamW state."""
    ps = params(layers)
    out = [(f"model.{n}", ("model", n), d) for n, d in ps]
    for n, d in ps:
        for s in ("exp_avg", "exp_avg_sq"):
            out.append((f"optim.state.{n}.{s}", ("optim", "state", n, s), d))
    return out


def global_shape(dims: int, ranks: int, rows: int) -> tuple[int, ...]:
    return (ranks * rows, 2) if dims == 2 else (ranks * rows,)


def expected(t: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The full value of tensor number ``t``."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64) + t * 1000).to(torch.float32).reshape(shape)


def local_plan(layers: int, ranks: int, rows: int, rank: int) -> SavePlan:
    """Rank ``rank``'s plan: its ``Shard(0)`` chunk of every tensor (even torch.chunk split)."""
    items = []
    planner_data = {}
    props = TensorProperties(dtype=torch.float32)
    for fqn, path, dims in tensors(layers):
        shape = global_shape(dims, ranks, rows)
        offsets = torch.Size((rank * rows,) + (0,) * (dims - 1))
        sizes = torch.Size((rows,) + shape[1:])
        items.append(
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                    properties=props,
                    size=torch.Size(shape),
                ),
            )
        )
        planner_data[fqn] = path
    return SavePlan(items, planner_data=planner_data)


class _Planner(DefaultSavePlanner):
    """Resolves each write item to its chunk of the deterministic tensors."""

    def __init__(self, layers: int, ranks: int, rows: int):
        super().__init__()
        self.number = {fqn: t for t, (fqn, _, _) in enumerate(tensors(layers))}
        self.ranks, self.rows = ranks, rows

    def resolve_data(self, item: WriteItem):
        t = self.number[item.index.fqn]
        c = item.tensor_data.chunk
        row = c.offsets[0]
        n = 1
        for s in c.sizes:
            n *= s
        cols = n // c.sizes[0]
        start = t * 1000 + row * cols
        return (torch.arange(n, dtype=torch.float64) + start).to(torch.float32).reshape(c.sizes)


# the jobs of a run, inherited by forked workers (sending them through a pipe would pickle
# every rank's plan once more)
_JOBS: list = []


def _write_job(i: int):
    return _write_rank(_JOBS[i])


def _write_rank(args):
    out, layers, ranks, rows, plan = args
    writer = FileSystemWriter(out, single_file_per_rank=True, sync_files=False, thread_count=1)
    writer.set_up_storage_writer(False)
    return writer.write_data(plan, _Planner(layers, ranks, rows)).wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="checkpoint directory to create")
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--ranks", type=int, default=512)
    ap.add_argument("--rows", type=int, default=1, help="rows per rank of every tensor")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    if os.path.exists(os.path.join(a.out, ".metadata")):
        print(f"{a.out}: already a checkpoint", file=sys.stderr)
        return 2
    t0 = time.time()
    plans = [local_plan(a.layers, a.ranks, a.rows, r) for r in range(a.ranks)]
    planner = DefaultSavePlanner()
    global_plans, metadata = planner.create_global_plan(plans)
    writer = FileSystemWriter(a.out, single_file_per_rank=True, sync_files=False)
    writer.set_up_storage_writer(True)
    global_plans = writer.prepare_global_plan(global_plans)
    chunks = sum(len(p.items) for p in plans)
    del plans
    os.makedirs(a.out, exist_ok=True)
    _JOBS[:] = [(a.out, a.layers, a.ranks, a.rows, p) for p in global_plans]
    del global_plans
    if a.jobs > 1:
        # Forked workers share the parent's pages until they write to them; keep the
        # collector from touching (and so copying) every object of the plans in each.
        gc.freeze()
        with mp.get_context("fork").Pool(a.jobs) as pool:
            n = len(_JOBS)
            results = pool.map(_write_job, range(n), chunksize=max(1, n // (4 * a.jobs)))
    else:
        results = [_write_rank(j) for j in _JOBS]
    _JOBS.clear()
    writer.finish(metadata, results)
    size = os.path.getsize(os.path.join(a.out, ".metadata"))
    print(
        f"{a.out}: {len(tensors(a.layers))} tensors, {chunks} chunks, "
        f".metadata {size} bytes, {time.time() - t0:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
