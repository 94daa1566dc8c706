"""Meta's torch_checkpointing (``tests/fixtures/torch_checkpointing``, written by the library's
own ``CheckpointManager.save`` on CPU: ``scripts/gen_torch_checkpointing.py``), judged by the
library itself:

- reshard reads each fixture (world 1, and FSDP2 DTensor shards of world 2) to the tensors the
  library's own load at world 1 gives, byte for byte;
- reshard writes the format (``--format torch-checkpointing``, one process's files), and the
  library's ``CheckpointManager.load`` loads the result into an unsharded model at world 1 and
  into an FSDP2 model at world 2 and 3 (it reshards on load), every tensor and the step equal to
  the source; its ``metadata.pkl`` equals what the library writes for one process;
- a DCP checkpoint (torch's own FSDP2 save) converts to it and loads the same way.

torch-checkpointing is installed by ``scripts/setup_venv.sh --torch-checkpointing`` (CI passes
it); under ``CI=true`` a missing library is a failure.
"""
from __future__ import annotations

import importlib.util
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import reshard

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dist  # noqa: E402
from _util import _quiet  # noqa: E402,F401  (_quiet: an autouse fixture)

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "torch_checkpointing"
MISSING = importlib.util.find_spec("torch_checkpointing") is None
if MISSING and os.environ.get("CI") == "true":
    raise RuntimeError("CI=true: torch_checkpointing missing (scripts/setup_venv.sh --torch-checkpointing)")
pytestmark = pytest.mark.skipif(MISSING, reason="torch_checkpointing not installed "
                                "(scripts/setup_venv.sh --torch-checkpointing)")


def same_bytes(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, a.shape, b.dtype, b.shape)
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), what


def _gen():
    sys.path.insert(0, str(REPO / "scripts"))
    import gen_torch_checkpointing as g

    return g


def oracle(case: str):
    """The library's own load of the fixture at world 1: model, flat optimizer state, step."""
    o = FIX / case / "oracle"
    return (load_file(str(o / "model.safetensors")), load_file(str(o / "optim.safetensors")),
            int((o / "step.txt").read_text()))


def _manager(items, resharded):
    """The library's ``CheckpointManager`` on CPU (as the fixtures' generator makes it) for
    ``items``, those in ``resharded`` with its ``DefaultResharder``."""
    g = _gen()
    from torch_checkpointing import CheckpointManager, ItemSpec, SyncCheckpointSaverConfig
    from torch_checkpointing.default_resharder import DefaultResharder
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    g.patch_cpu()
    return CheckpointManager(CheckpointManager.Config(
        items={i: ItemSpec(resharder=DefaultResharder()) if i in resharded else ItemSpec() for i in items},
        save=SyncCheckpointSaverConfig(),
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))


def _load(rank: int, world: int, ckpt: str):
    """The library's ``CheckpointManager.load`` of ``ckpt`` into the fixtures' model (FSDP2 at
    world > 1) and an AdamW optimizer with state: every tensor gathered whole, flat."""
    g = _gen()
    model = g.build()
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",)))
    opt = g.blank(model)  # an optimizer with state to load into, everything zeroed
    into = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    if world == 1:
        # (an item without a resharder, as `step` is, is read from each rank's own file: the
        # library loads a world-1 folder's `step` at world 1 only, its own saves' too)
        into["step"] = None
    got = _manager(sorted(into), resharded={"model", "optimizer"}).load(ckpt, into=into)

    def whole(v):
        return v.full_tensor() if hasattr(v, "full_tensor") else v

    # (numpy arrays: a torch tensor would travel as shared memory the exiting process frees)
    model_sd = {k: whole(v).detach().numpy().copy() for k, v in got["model"].items()}
    optim = {f"state.{i}.{n}": whole(v).detach().numpy().copy()
             for i, st in got["optimizer"]["state"].items() for n, v in st.items() if torch.is_tensor(v)}
    local = {k: v.to_local().detach().numpy().copy() for k, v in got["model"].items()
             if hasattr(v, "to_local")}
    return model_sd, optim, got.get("step"), got["optimizer"]["param_groups"], local


def check(got, case: str, world: int):
    want_model, want_optim, want_step = oracle(case)
    t = torch.from_numpy
    for r, (model_sd, optim, step, groups, local) in enumerate(got):
        model_sd = {k: t(v) for k, v in model_sd.items()}
        optim = {k: t(v) for k, v in optim.items()}
        local = {k: t(v) for k, v in local.items()}
        assert sorted(model_sd) == sorted(want_model)
        for k, v in want_model.items():
            same_bytes(model_sd[k], v, f"rank {r}: {k}")
            if world > 1:  # the rank's own shard is torch.chunk's of the whole tensor
                same_bytes(local[k], torch.chunk(v, world)[r] if r < len(torch.chunk(v, world))
                           else v[:0], f"rank {r} local: {k}")
        assert sorted(optim) == sorted(want_optim)
        for k, v in want_optim.items():
            same_bytes(optim[k], v, f"rank {r}: {k}")
        assert step == (want_step if world == 1 else None)
        assert groups[0]["lr"] == 0.01 and groups[0]["params"] == [0, 1, 2, 3]


@pytest.mark.parametrize("case", ["w1", "fsdp2_w2"])
def test_read_equals_the_librarys_own_load(case):
    want_model, want_optim, want_step = oracle(case)
    ck = reshard.open(FIX / case / "checkpoint")
    for k, v in want_model.items():
        same_bytes(ck.get_tensor(k), v, k)
    for k, v in want_optim.items():
        same_bytes(ck.get_tensor(f"optimizer.{k}"), v, k)
    assert ck.values()["step"] == want_step


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """fsdp2_w2 (world 2, DTensor shards) written back as torch_checkpointing by reshard."""
    out = tmp_path_factory.mktemp("tc") / "out"
    reshard.convert(FIX / "fsdp2_w2" / "checkpoint", out, world_size=1, format="torch-checkpointing")
    return out


def test_written_files_are_the_librarys_single_process_layout(written):
    assert sorted(p.name for p in written.iterdir()) == [
        "metadata.pkl", "model_0.pt", "optimizer_0.pt", "step_0.pt"]
    # the same model saved by the library at world 1 (w1): the same metadata.pkl
    with open(written / "metadata.pkl", "rb") as f:
        ours = pickle.load(f)
    with open(FIX / "w1" / "checkpoint" / "metadata.pkl", "rb") as f:
        theirs = pickle.load(f)
    assert ours == theirs
    assert torch.load(written / "step_0.pt", weights_only=True) == 1
    theirs_o = torch.load(FIX / "w1" / "checkpoint" / "optimizer_0.pt", weights_only=True)
    ours_o = torch.load(written / "optimizer_0.pt", weights_only=True)
    assert ours_o["param_groups"] == theirs_o["param_groups"]
    assert sorted(ours_o["state"]) == sorted(theirs_o["state"]) == [0, 1, 2, 3]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_the_library_loads_what_reshard_writes(written, world):
    """At world 2 and 3 into FSDP2 (DTensor Shard(0)): the library reshards on load."""
    got = _dist.run(world, _load, str(written), timeout=240)
    check(got, "fsdp2_w2", world)


def _flat(prefix, v):
    """The tensors of a nested state dict under flat dotted names."""
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _flat(f"{prefix}{k}.", x)
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _flat(f"{prefix}{i}.", x)
    elif torch.is_tensor(v):
        yield prefix[:-1], v


def _load_like(rank: int, world: int, ckpt: str, items: list):
    """The library's load of ``ckpt`` at world 1 into zeroed state dicts of the structure its
    item files hold: each item's tensors, flat."""

    def zeroed(v):
        if isinstance(v, dict):
            return {k: zeroed(x) for k, x in v.items()}
        if isinstance(v, list):
            return [zeroed(x) for x in v]
        return torch.zeros_like(v) if torch.is_tensor(v) else v

    into = {i: zeroed(torch.load(Path(ckpt) / f"{i}_0.pt", weights_only=True)) for i in items}
    got = _manager(items, resharded=set(items)).load(ckpt, into=into)
    return {k: (str(v.dtype), tuple(v.shape), v.reshape(-1).view(torch.uint8).numpy().tobytes())
            for i in items for k, v in _flat(f"{i}.", got[i])}


def test_dcp_converts_to_torch_checkpointing(tmp_path):
    """torch's own FSDP2 DCP save (model and optimizer, world 2) written as torch_checkpointing:
    the library's load gives DCP's tensors, under the DCP state dict's top-level keys as items."""
    src = REPO / "tests" / "fixtures" / "fsdp2_w2_f32" / "checkpoint"
    out = tmp_path / "tc"
    reshard.convert(src, out, world_size=1, format="torch-checkpointing")
    ck = reshard.open(src)
    items = sorted(p.name.rsplit("_", 1)[0] for p in out.glob("*_0.pt"))
    # an item per top-level key of the DCP state dict
    assert items == sorted({n.split(".", 1)[0] for n in ck.keys()}), items
    with_tensors = sorted({t.name.split(".", 1)[0] for t in ck.tensors()})
    (got,) = _dist.run(1, _load_like, str(out), with_tensors, timeout=240)
    assert sorted(got) == sorted(t.name for t in ck.tensors())
    for k, (dtype, shape, data) in got.items():
        want = ck.get_tensor(k)
        assert (dtype, shape) == (str(want.dtype), tuple(want.shape)), k
        assert data == want.reshape(-1).view(torch.uint8).numpy().tobytes(), k
