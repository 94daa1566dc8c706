"""Conformance of ``reshard.torch.StorageReader`` to torch's own ``FileSystemReader`` under
``dcp.load``, on checkpoints torch itself saves here, pattern by pattern.

Each test saves a small state dict with torch's ``dcp.save`` (one process with
``no_dist=True``, or one 4-process gloo job, run once for the module, for DTensors on 1-D and
2-D meshes, a 2-rank save on a sub-mesh and an HF-storage save), then loads it into fresh
targets twice: once through torch's ``FileSystemReader`` (the oracle; torch's
``HuggingFaceStorageReader`` for HF storage) and once through reshard's reader, and compares
the two: every tensor byte for byte with equal dtype and shape (a DTensor target by its local
shard), every other value with ``==`` (an ``io.BytesIO`` by ``getvalue()``); what was saved is
checked too where the target is the saved structure, and ``reshard.open`` must list the keys
torch's metadata lists.

Patterns: nested model/optimizer/scheduler state dicts, train-state values (plain values,
``io.BytesIO``, a user-defined class), tied weights, partial loads (with and without
``allow_partial_load``), dtype casts into the target's dtype, multi-file saves (writer
threads, ``single_file_per_rank=False``, 2 ranks), empty shards and zero-size tensors, 2-D
meshes (loaded at 1 rank into plain tensors, at 4 and at 2 ranks into other placements), every
dtype torch saves, the saved ``storage_meta``, a caller's stream transform through
``_extension_registry``, and HF storage folders whose shard numbers have gaps.
"""

import importlib
import io
import math
import os
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import _dist
import reshard
import reshard.torch as rt
from _util import _quiet  # noqa: F401  (autouse)
from test_reader_protocol import save  # dcp.save in this process through a FileSystemWriter
from test_storage_reader import _placeholder_template, assert_same, scribble, sentinel


def need(module: str):
    """``module`` imported; when this torch lacks it, the test skips, or fails under CI=true."""
    if os.environ.get("CI") == "true":
        return importlib.import_module(module)
    return pytest.importorskip(module)


# --- the harness (save: test_reader_protocol's; scribble: test_storage_reader's) ---------------
def plain(obj):
    """``obj`` with each ``io.BytesIO`` as ``("io.BytesIO", its bytes)``, for comparison."""
    if isinstance(obj, io.BytesIO):
        return ("io.BytesIO", obj.getvalue())
    if isinstance(obj, dict):
        return type(obj)((k, plain(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain(v) for v in obj)
    return obj


def load_both(path: Path, make, planner=None):
    """Two fresh targets from ``make()``, loaded by reshard's reader and by torch's
    ``FileSystemReader`` (each with a fresh ``planner()`` when given); returns ``(ours,
    torch's)``."""
    got, want = make(), make()
    dcp.load(got, storage_reader=rt.StorageReader(path), planner=planner and planner(), no_dist=True)
    dcp.load(want, storage_reader=FileSystemReader(str(path)), planner=planner and planner(), no_dist=True)
    return got, want


def same_keys(path: Path) -> None:
    """``reshard.open`` lists the keys of torch's metadata."""
    md = FileSystemReader(str(path)).read_metadata()
    assert sorted(reshard.open(path).keys()) == sorted(md.state_dict_metadata)


def conform(path: Path, sd: dict, **writer_kw) -> dict:
    """Save ``sd`` at ``path``, load it into a template of itself with both readers: equal to
    each other and to ``sd``; ``reshard.open`` lists the same keys. Returns reshard's load."""
    save(sd, path, **writer_kw)
    got, want = load_both(path, lambda: _placeholder_template(sd))
    assert_same(plain(got), plain(want))
    assert_same(plain(got), plain(sd))
    same_keys(path)
    return got


class TinyLM(torch.nn.Module):
    """A few layers of the usual kinds; ``tied``: ``lm_head.weight`` is ``embed.weight``."""

    def __init__(self, tied: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(10, 8)
        self.fc = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, 10, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(torch.relu(self.fc(self.embed(x)))))


def trained(model: torch.nn.Module, steps: int = 1):
    """``model`` with an AdamW and a StepLR after ``steps`` steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x = torch.arange(12).reshape(3, 4) % 10
    for _ in range(steps):
        model(x).float().pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return opt, sched


def full(name: str, shape, dtype=torch.float32) -> torch.Tensor:
    """A deterministic tensor, distinct per name (the multi-process job and the tests agree)."""
    base = sum(map(ord, name)) % 97
    n = math.prod(shape)
    return ((torch.arange(n, dtype=torch.float64) * 0.25 + base).reshape(shape)).to(dtype)


# --- nested dicts, train state, tied weights ---------------------------------------------------
def test_nested_model_optimizer_scheduler(tmp_path):
    """get_state_dict of a model and its AdamW after a step, and a StepLR, nested under
    model/optimizer/scheduler; loaded into a fresh model's and optimizer's state dicts."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = TinyLM()
    opt, sched = trained(model)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optimizer": osd, "scheduler": sched.state_dict(), "step": 1}
    save(sd, tmp_path / "ck")

    def fresh():
        m = TinyLM(seed=1)
        o, s = trained(m, steps=0)
        fm, fo = get_state_dict(m, o)
        return scribble({"model": fm, "optimizer": fo, "scheduler": s.state_dict(), "step": -1})

    got, want = load_both(tmp_path / "ck", fresh)
    assert_same(got, want)
    assert_same(got, sd)
    assert got["optimizer"]["state"]["fc.weight"]["step"] == 1
    same_keys(tmp_path / "ck")


def test_train_state_values(tmp_path):
    """The values a training loop keeps: ints, floats, strings, bools, bytes, lists, tuples,
    None, nested dicts of them, next to tensors."""
    sd = {
        "step": 123,
        "epoch": 2.5,
        "name": "run-7",
        "done": False,
        "blob": b"\x00\x01\xff",
        "lrs": [0.1, 0.05, 0.025],
        "shape": (3, 4),
        "nothing": None,
        "big": 2**62 + 1,
        "nan": float("inf"),
        "loop": {"seen": 4096, "phase": "warmup", "hist": [1, 2, 3], "sub": {"k": ("a", None)}},
        "w": torch.arange(6, dtype=torch.float32),
    }
    conform(tmp_path / "ck", sd)


def test_bytesio_value(tmp_path):
    """An io.BytesIO value (torch saves it as a BYTE_IO item, torch.save of the object)."""
    sd = {"state": {"buf": io.BytesIO(b"rng state \x00\x01\x02"), "n": 3}, "w": torch.ones(2, 3)}
    got = conform(tmp_path / "ck", sd)
    assert isinstance(got["state"]["buf"], io.BytesIO)


USER_MODULE = textwrap.dedent(
    """
    class TrainState:
        def __init__(self, step, tokens, tags):
            self.step, self.tokens, self.tags = step, tokens, tags

        def __eq__(self, other):
            return type(other) is type(self) and vars(self) == vars(other)
    """
)


def test_user_class_value(tmp_path, monkeypatch):
    """An instance of a user-defined picklable class (from a module on sys.path) as a value."""
    (tmp_path / "conformance_user_state.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "conformance_user_state", raising=False)
    import conformance_user_state as m

    sd = {"train_state": m.TrainState(7, 4096, ["a", "b"]), "w": torch.ones(3)}
    got = conform(tmp_path / "ck", sd)
    assert type(got["train_state"]) is m.TrainState


def test_tied_weights(tmp_path):
    """A model whose lm_head.weight is embed.weight: both keys saved, both targets (one
    tensor) filled."""
    model = TinyLM(tied=True)
    trained(model)
    sd = {"model": model.state_dict()}
    assert sd["model"]["lm_head.weight"].data_ptr() == sd["model"]["embed.weight"].data_ptr()
    save(sd, tmp_path / "ck")

    def fresh():
        m = TinyLM(tied=True, seed=1)
        return {"model": scribble(m.state_dict())}

    got, want = load_both(tmp_path / "ck", fresh)
    assert_same(got, want)
    assert_same(got, sd)
    g = got["model"]
    assert g["lm_head.weight"].data_ptr() == g["embed.weight"].data_ptr()
    same_keys(tmp_path / "ck")


# --- partial loads and casts -------------------------------------------------------------------
def _partial_state() -> dict:
    return {
        "model": {"a": full("a", (4, 3)), "b": full("b", (5,), torch.bfloat16)},
        "optim": {"m": full("m", (4, 3)), "lr": 0.1},
        "step": 9,
    }


@pytest.mark.parametrize("allow_partial", [False, True])
@pytest.mark.parametrize("ask", ["model_only", "one_tensor_one_value", "with_missing_key"])
def test_partial_load(tmp_path, ask, allow_partial):
    """A target asking for a part of the checkpoint; with allow_partial_load, also for a key
    the checkpoint lacks (left as it is); without it, that fails with either reader."""
    sd = _partial_state()
    save(sd, tmp_path / "ck")

    def make():
        t = {"model": {"a": sentinel((4, 3), torch.float32)}}
        if ask != "model_only":
            t["optim"] = {"lr": "PLACEHOLDER"}
        if ask == "with_missing_key":
            t["model"]["absent"] = sentinel((2,), torch.float32)
        return t

    planner = (lambda: DefaultLoadPlanner(allow_partial_load=True)) if allow_partial else None
    if ask == "with_missing_key" and not allow_partial:
        for reader in (rt.StorageReader(tmp_path / "ck"), FileSystemReader(str(tmp_path / "ck"))):
            with pytest.raises(CheckpointException, match="absent"):
                dcp.load(make(), storage_reader=reader, no_dist=True)
        return
    got, want = load_both(tmp_path / "ck", make, planner=planner)
    assert_same(got, want)
    assert_same(got["model"]["a"], sd["model"]["a"])
    if ask == "with_missing_key":
        assert_same(got["model"]["absent"], sentinel((2,), torch.float32))


CASTS = [
    (torch.float32, torch.float64),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.bfloat16),
    (torch.float64, torch.float32),
    (torch.int64, torch.int32),
    (torch.int32, torch.float32),
    (torch.float32, torch.int64),
    (torch.bool, torch.float32),
    (torch.uint8, torch.int16),
]


@pytest.mark.parametrize("saved,target", CASTS, ids=[f"{str(a)[6:]}-{str(b)[6:]}" for a, b in CASTS])
def test_dtype_cast(tmp_path, saved, target):
    """Targets of another dtype than saved: dcp.load copies into the target's dtype (torch's
    copy_ rules, truncation of floats into ints included); a non-contiguous target too."""
    src = (torch.arange(-6, 6, dtype=torch.float64) * 0.75).reshape(3, 4)
    src = (src > 0) if saved == torch.bool else src.abs().to(saved) if saved == torch.uint8 else src.to(saved)
    sd = {"x": src, "y": src[:, :2].clone()}
    save(sd, tmp_path / "ck")

    def make():
        return {"x": sentinel((3, 4), target), "y": sentinel((2, 3), target).t()}

    got, want = load_both(tmp_path / "ck", make)
    assert_same(got, want)
    assert got["x"].dtype == target and not got["y"].is_contiguous()
    assert_same(got["x"], src.to(target))


# --- multi-file saves, empty shards ------------------------------------------------------------
WRITERS = {
    "threads3": dict(thread_count=3),
    "threads2_copy_ahead": dict(thread_count=2, per_thread_copy_ahead=16),
    "file_per_item": dict(single_file_per_rank=False),
    "file_per_item_threads4": dict(single_file_per_rank=False, thread_count=4),
}


@pytest.mark.parametrize("kw", list(WRITERS))
def test_multi_file_save(tmp_path, kw):
    """One process's save spread over several data files by the writer's options."""
    sd = {
        "a": full("a", (16, 8)),
        "b": full("b", (3,), torch.bfloat16),
        "nested": {"c": full("c", (4, 4), torch.float64), "d": full("d", (7,), torch.int32), "v": "x"},
        "e": full("e", (2, 2, 2)),
        "step": 5,
    }
    conform(tmp_path / "ck", sd, **WRITERS[kw])
    assert len(list((tmp_path / "ck").glob("*.distcp"))) > 1


def test_zero_size_tensors(tmp_path):
    """Tensors with no elements, of several shapes and dtypes, next to ordinary ones."""
    sd = {
        "e0": torch.empty(0),
        "e04": torch.empty(0, 4, dtype=torch.bfloat16),
        "e30": torch.empty(3, 0, dtype=torch.int64),
        "e202": torch.empty(2, 0, 2, dtype=torch.float64),
        "scalar": torch.tensor(2.5),
        "w": full("w", (2, 3)),
    }
    conform(tmp_path / "ck", sd)


# --- every dtype torch saves ---------------------------------------------------------------------
# the dtypes beyond the 15 reshard read before complex, the other fp8s and fp4 were added
_BEYOND_CLASSIC = (
    "complex32", "complex64", "complex128", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "bcomplex32",
)
DTYPES = [
    "float32", "float64", "float16", "bfloat16", "bool", "uint8", "int8", "int16", "int32", "int64",
    "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
    "complex32", "complex64", "complex128", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2", "bcomplex32",
]


def _dtype_param(name: str):
    marks = []
    if not hasattr(torch, name):
        marks = [pytest.mark.skip(reason=f"torch {torch.__version__} has no {name}")]
    return pytest.param(name, marks=marks, id=name)


def _dtype_tensor(dt: torch.dtype, n: int = 12) -> torch.Tensor:
    """``n`` elements of ``dt`` from distinct bytes (no NaN or infinity patterns; bools 0/1)."""
    size = torch.empty(0, dtype=dt).element_size()
    raw = torch.arange(n * size, dtype=torch.uint8)
    if dt == torch.bool:
        raw = raw % 2
    return raw.view(dt).reshape(3, -1)


def _dtype_state(name: str) -> dict:
    return {"x": _dtype_tensor(getattr(torch, name)), "o": full("o", (2, 3))}


@pytest.mark.parametrize("name", [_dtype_param(n) for n in DTYPES])
def test_every_dtype(tmp_path, name):
    """A tensor of each dtype torch's DCP saves, next to an ordinary one."""
    conform(tmp_path / "ck", _dtype_state(name))


@pytest.mark.parametrize("name", [_dtype_param(n) for n in DTYPES if n in _BEYOND_CLASSIC])
def test_every_dtype_partial_load_of_the_ordinary_tensor(tmp_path, name):
    """A checkpoint holding a tensor of that dtype, loaded with allow_partial_load into a
    target asking only for the ordinary float32 tensor next to it."""
    sd = _dtype_state(name)
    save(sd, tmp_path / "ck")
    got, want = load_both(
        tmp_path / "ck", lambda: {"o": sentinel((2, 3), torch.float32)},
        planner=lambda: DefaultLoadPlanner(allow_partial_load=True),
    )
    assert_same(got, want)
    assert_same(got["o"], sd["o"])


# --- storage_meta, _extension_registry -----------------------------------------------------------
def test_storage_meta_save_id(tmp_path):
    """read_metadata().storage_meta: the writer's save_id and the saved checkpoint_id and
    modules as torch's reader gives them; load_id the reader's own."""
    writer = save({"w": torch.ones(2), "step": 1}, tmp_path / "ck")
    ours, theirs = rt.StorageReader(tmp_path / "ck"), FileSystemReader(str(tmp_path / "ck"))
    sm, want = ours.read_metadata().storage_meta, theirs.read_metadata().storage_meta
    assert want.save_id == writer.save_id is not None
    assert (sm.checkpoint_id, sm.save_id, sm.modules) == (want.checkpoint_id, want.save_id, want.modules)
    assert sm.load_id == ours.load_id and want.load_id == theirs.load_id


def test_rot13_extension_registry(tmp_path):
    """Items written through the caller's rot13 transform: both readers given a registry
    that knows it load the same nested state, values included; the items on disk are not
    the plain ones (the transform ran)."""
    sd = {
        "model": {"w": full("w", (5, 4)), "b": full("b", (4,), torch.bfloat16)},
        "meta": {"step": 3, "name": "rot"},
    }
    ext = need("torch.distributed.checkpoint._extension")
    from test_reader_protocol import Rot13 as Rot13Stream  # the caller's transform, rot13 of every byte
    save(sd, tmp_path / "ck", _extensions=[Rot13Stream()])
    save(sd, tmp_path / "plain")
    assert (tmp_path / "ck" / "__0_0.distcp").read_bytes() != (tmp_path / "plain" / "__0_0.distcp").read_bytes()

    def registry():
        reg = ext.ExtensionRegistry()
        reg.register(Rot13Stream)
        return reg

    got, want = _placeholder_template(sd), _placeholder_template(sd)
    dcp.load(got, storage_reader=rt.StorageReader(tmp_path / "ck", _extension_registry=registry()), no_dist=True)
    dcp.load(want, storage_reader=FileSystemReader(str(tmp_path / "ck"), _extension_registry=registry()), no_dist=True)
    assert_same(got, want)
    assert_same(got, sd)


# --- DTensors: one 4-process gloo job saves, reloads at 4 and 2 ranks ------------------------------
# name: (global shape, dtype, saved (mesh, placements), reloaded at 4 ranks, reloaded at 2 ranks)
# meshes: "2d" the 2x2 mesh, "1d" the 4 ranks, "sub" the 2 ranks of a row of the 2x2 mesh
DTENSORS = {
    "s0s1": ((8, 6), torch.float32, ("2d", "S0 S1"), ("2d", "S1 S0"), ("sub", "S1")),
    "s0r": ((6, 5), torch.float32, ("2d", "S0 R"), ("1d", "S1"), ("sub", "S1")),
    "rs1": ((4, 10), torch.float32, ("2d", "R S1"), ("2d", "S0 R"), ("sub", "S0")),
    "uneven": ((7, 5), torch.float64, ("2d", "S0 S1"), ("1d", "S0"), ("sub", "S0")),
    "bf16": ((4, 4), torch.bfloat16, ("2d", "S1 S0"), ("1d", "R"), ("sub", "S0")),
    # more ranks than rows: some ranks hold 0 rows, saved and loaded
    "empty_rows": ((2, 3), torch.float32, ("1d", "S0"), ("2d", "S0 S0"), ("sub", "S1")),
    "one_row": ((1, 4), torch.int64, ("2d", "S0 S1"), ("1d", "S0"), ("sub", "S0")),
    "zero": ((0, 4), torch.float32, ("1d", "S0"), ("2d", "S0 S1"), ("sub", "S1")),
}
PLAIN = {"plain_zero": torch.empty(0, 3), "plain": torch.arange(5, dtype=torch.int32), "step": 7}
# one tensor: with more, DCP's dedup gives the replicated ranks some of them to write
HF_TENSORS = {"w": ((8, 6), torch.float32)}


def _placements(spec: str):
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if p == "R" else Shard(int(p[1:])) for p in spec.split()]


def _state_fsdp2(model) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    opt, sched = trained(model)
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd, "scheduler": sched.state_dict(), "step": 1}


def job_save_and_reload(rank: int, world: int, root: str) -> dict:
    """One rank of 4: saves the DTensors of DTENSORS (and PLAIN) with the process group, an
    HF-storage folder of HF_TENSORS placed [Shard(0), Replicate()] on the 2x2 mesh, and (the 2
    ranks of the first row) an FSDP2 model with its AdamW and StepLR over several files each;
    then loads the DTensor checkpoint into the other placements at 4 ranks and at 2 ranks with
    reshard's reader and torch's. Returns what each reader gave this rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    meshes = {"2d": mesh2, "1d": init_device_mesh("cpu", (world,)), "sub": mesh2["tp"]}
    sub_group = meshes["sub"].get_group()

    def state(which: int, sentinel_values: bool) -> dict:
        sd = {}
        for name, (shape, dt, *specs) in DTENSORS.items():
            mesh, spec = specs[which]
            t = sentinel(shape, dt) if sentinel_values else full(name, shape, dt)
            sd[name] = distribute_tensor(t, meshes[mesh], _placements(spec))
        return sd

    out: dict = {}
    ck = os.path.join(root, "dtensors")
    writer = FileSystemWriter(ck)
    dcp.save({**state(0, False), **PLAIN}, storage_writer=writer)
    out["save_id"] = writer.save_id

    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter

    hf = {n: distribute_tensor(full(n, s, d), mesh2, _placements("S0 R")) for n, (s, d) in HF_TENSORS.items()}
    dcp.save(hf, storage_writer=HuggingFaceStorageWriter(os.path.join(root, "hf"), save_distributed=True))

    if rank < 2:  # the first row of the mesh: a 2-rank FSDP2 save, several files per rank
        model = TinyLM()
        fully_shard(model.fc, mesh=meshes["sub"])
        fully_shard(model, mesh=meshes["sub"])
        sd = _state_fsdp2(model)
        writer2 = FileSystemWriter(os.path.join(root, "fsdp2_w2"), thread_count=2, single_file_per_rank=False)
        dcp.save(sd, storage_writer=writer2, process_group=sub_group)
        out["fsdp2_model"] = {k: v.full_tensor() for k, v in sd["model"].items()}
    dist.barrier()

    for which, group in ((1, None), (2, sub_group)):
        loads = []
        for reader in (rt.StorageReader(ck), FileSystemReader(ck)):
            sd = {**state(which, True), "plain_zero": sentinel((0, 3), torch.float32), "step": -1}
            dcp.load(sd, storage_reader=reader, process_group=group)
            loads.append({k: (v.to_local().clone(), str(v.placements)) if hasattr(v, "to_local") else v
                          for k, v in sd.items()})
        out[("four", "two")[which - 1]] = loads
    buf = io.BytesIO()  # tensors as bytes: the queue would pass them as shared memory
    torch.save(out, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def saved_at_four(tmp_path_factory) -> dict:
    """The folders job_save_and_reload wrote, and what each rank loaded."""
    root = tmp_path_factory.mktemp("four")
    results = _dist.run(4, job_save_and_reload, str(root), timeout=240)
    return {"root": root, "ranks": [torch.load(io.BytesIO(r), weights_only=False) for r in results]}


def test_2d_mesh_loaded_at_one_rank(saved_at_four):
    """DTensors saved at 4 ranks ([Shard(0), Shard(1)], [Shard(0), Replicate()],
    [Replicate(), Shard(1)] on a 2x2 mesh, uneven, Shard(0) on 4 ranks with fewer rows),
    loaded into plain tensors in one process; the saved storage_meta."""
    ck = saved_at_four["root"] / "dtensors"

    def make():
        sd = {n: sentinel(shape, dt) for n, (shape, dt, *_s) in DTENSORS.items()}
        return {**sd, "plain_zero": sentinel((0, 3), torch.float32), "plain": sentinel((5,), torch.int32), "step": -1}

    got, want = load_both(ck, make)
    assert_same(got, want)
    assert_same(got, {**{n: full(n, s, d) for n, (s, d, *_r) in DTENSORS.items()}, **PLAIN})
    same_keys(ck)
    sm = rt.StorageReader(ck).read_metadata().storage_meta
    assert sm.save_id == FileSystemReader(str(ck)).read_metadata().storage_meta.save_id
    assert sm.save_id == saved_at_four["ranks"][0]["save_id"]


@pytest.mark.parametrize("where", ["four", "two"])
def test_2d_mesh_resharded_at_four_and_two_ranks(saved_at_four, where):
    """The same checkpoint loaded under dcp.load with a process group into other placements:
    at 4 ranks (2-D and 1-D meshes), at 2 ranks (a row's sub-mesh, its group); each rank's
    local shards equal torch's, and the shards together are the saved tensors."""
    col = 2 if where == "two" else 1
    ranks = saved_at_four["ranks"][: 2 if where == "two" else 4]  # the two: the first row
    for rank, res in enumerate(ranks):
        ours, theirs = res[where]
        assert_same(ours, theirs, f"rank {rank}")
    empty = 0
    for name, (shape, dt, *specs) in DTENSORS.items():
        locals_ = [res[where][0][name][0] for res in ranks]
        empty += sum(t.numel() == 0 for t in locals_) if math.prod(shape) else 0
        spec = specs[col][1]
        if spec == "R":
            for t in locals_:
                assert_same(t, full(name, shape, dt))
        elif spec.split() in (["S0"], ["S1"]):
            dim = int(spec[1])
            assert_same(torch.cat(locals_, dim=dim), full(name, shape, dt), name)
    assert empty > 0, "no rank held an empty shard of a non-empty tensor"


def test_two_rank_fsdp2_multi_file_save(saved_at_four):
    """An FSDP2 model, its AdamW after a step and a StepLR, saved by 2 gloo ranks with 2
    writer threads and a file per item: loaded at 1 rank into a plain model's state dicts."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    ck = saved_at_four["root"] / "fsdp2_w2"
    assert len(list(ck.glob("*.distcp"))) > 2

    def fresh():
        m = TinyLM(seed=1)
        o, s = trained(m, steps=0)
        fm, fo = get_state_dict(m, o)
        return scribble({"model": fm, "optimizer": fo, "scheduler": s.state_dict(), "step": -1})

    got, want = load_both(ck, fresh)
    assert_same(got, want)
    assert_same(dict(got["model"]), saved_at_four["ranks"][0]["fsdp2_model"])
    assert got["step"] == 1 and got["scheduler"]["last_epoch"] == 1
    same_keys(ck)


def test_hf_storage_with_shard_number_gaps(saved_at_four):
    """HuggingFaceStorageWriter(save_distributed=True) of [Shard(0), Replicate()] DTensors on
    a 2x2 mesh writes shard-00001 and shard-00003 only (the replicas write nothing): read by
    reshard.open, reshard.torch.load and reshard's StorageReader as torch's
    HuggingFaceStorageReader reads it."""
    HuggingFaceStorageReader = need("torch.distributed.checkpoint.hf_storage").HuggingFaceStorageReader
    hf = saved_at_four["root"] / "hf"
    assert sorted(p.name[:11] for p in hf.glob("*.safetensors")) == ["shard-00001", "shard-00003"]

    def make():
        return {n: sentinel(s, d) for n, (s, d) in HF_TENSORS.items()}

    want = make()
    dcp.load(want, storage_reader=HuggingFaceStorageReader(str(hf)), no_dist=True)
    assert_same(want, {n: full(n, s, d) for n, (s, d) in HF_TENSORS.items()})
    assert sorted(reshard.open(hf).keys()) == sorted(HF_TENSORS)
    got = make()
    rt.load(got, hf)
    assert_same(got, want)
    got = make()
    dcp.load(got, storage_reader=rt.StorageReader(hf), no_dist=True)
    assert_same(got, want)
