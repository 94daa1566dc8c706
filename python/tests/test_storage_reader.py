"""reshard.torch.StorageReader under torch's own ``dcp.load``: byte-exact against torch's
FileSystemReader (and HuggingFaceStorageReader) on every DCP fixture, under 2 gloo processes
with FSDP2 DTensor targets, on .pt / safetensors / HF inputs, and its errors."""

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

import reshard
import reshard.torch as rt

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures"
SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(SCRIPTS))
from torch_interop import jsonify  # noqa: E402  (as the fixtures' oracle JSON-ified non-tensor values)

DCP_CASES = sorted(
    d.name
    for d in FIX.iterdir()
    if (d / "checkpoint").is_dir() and any(p.suffix == ".distcp" for p in (d / "checkpoint").iterdir())
)


def _zstd_available() -> bool:
    try:
        import zstandard  # noqa: F401

        return True
    except ImportError:
        try:
            import pyzstd  # noqa: F401

            return True
        except ImportError:
            return False


# Fixtures torch's FileSystemReader cannot load itself here (checked against the oracle only).
TORCH_CANNOT = {
    "fsdp2_w2_f32_nocoll": "no global .metadata: torch falls back to rank 0's, which lacks rank 1's chunks",
    "fmt_fs_safetensors_w2": "torch 2.15's FileSystemReader torch.load()s items its safetensors writer wrote",
}
if not _zstd_available():
    TORCH_CANNOT["fsdp2_w2_f32_zstd"] = "torch needs zstandard or pyzstd to read zstd items"


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# --- helpers ---------------------------------------------------------------------------------
def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same(a, b, where="") -> None:
    """Nested equality: same structure and types (dict keys in any order), tensors equal
    byte for byte (same dtype, shape), DTensors also in placements and mesh."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if type(a).__name__ == "DTensor":
        assert a.placements == b.placements and a.device_mesh == b.device_mesh, where
        assert a.shape == b.shape, where
        assert_same(a.to_local(), b.to_local(), where + " (local)")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(_bytes(a), _bytes(b)), f"{where}: bytes differ"
    elif isinstance(a, dict):
        assert sorted(a, key=repr) == sorted(b, key=repr), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}.{i}")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def sentinel(shape, dtype) -> torch.Tensor:
    """A tensor no checkpoint holds: every byte 0xA5 (bools: all True)."""
    t = torch.empty(tuple(shape), dtype=dtype)
    t.reshape(-1).view(torch.uint8).fill_(0x01 if dtype == torch.bool else 0xA5)
    return t


def scribble(obj):
    """Every tensor (a DTensor's local shard) of ``obj`` overwritten with the sentinel."""
    if type(obj).__name__ == "DTensor":
        scribble(obj._local_tensor)
    elif isinstance(obj, torch.Tensor):
        obj.detach().copy_(sentinel(obj.shape, obj.dtype))
    elif isinstance(obj, dict):
        for v in obj.values():
            scribble(v)
    elif isinstance(obj, list):
        for v in obj:
            scribble(v)
    return obj


def set_path(root: dict, path, value) -> None:
    """torch's ``set_element``: ints make lists, strings dicts."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, tuple(path), value)


def get_path(root, path):
    for p in path:
        root = root[p]
    return root


def template_from(md) -> dict:
    """A nested state dict shaped as the checkpoint was saved (from the metadata's
    planner_data): sentinel tensors, placeholder values."""
    sd: dict = {}
    for k, v in md.state_dict_metadata.items():
        val = sentinel(v.size, v.properties.dtype) if isinstance(v, TensorStorageMetadata) else "PLACEHOLDER"
        path = (md.planner_data or {}).get(k, (k,))
        set_path(sd, path, val)
    return sd


def flat_values(sd: dict, md) -> dict:
    return {k: get_path(sd, (md.planner_data or {}).get(k, (k,))) for k in md.state_dict_metadata}


def oracle_tensors(case: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(FIX / case / "oracle" / "full.safetensors"))


def torch_metadata(ckpt: Path):
    return FileSystemReader(str(ckpt)).read_metadata()


# --- (1) every DCP fixture, single process, against torch's FileSystemReader ------------------
@pytest.mark.parametrize("case", DCP_CASES)
def test_dcp_fixture_matches_filesystem_reader(case):
    ckpt = FIX / case / "checkpoint"
    reader = rt.StorageReader(ckpt)
    ours_md = reader.read_metadata()
    md = ours_md if case in TORCH_CANNOT else torch_metadata(ckpt)

    got = template_from(md)
    dcp.load(got, storage_reader=reader, no_dist=True)

    if case not in TORCH_CANNOT:
        # the same keys (and kinds) as torch's own metadata; Fabric's meta.pt adds `step`
        theirs = {k: type(v) for k, v in md.state_dict_metadata.items()}
        mine = {k: type(v) for k, v in ours_md.state_dict_metadata.items()}
        if (ckpt / "meta.pt").exists():
            assert mine.pop("step") is BytesStorageMetadata
        assert mine == theirs
        for k, v in md.state_dict_metadata.items():
            if isinstance(v, TensorStorageMetadata):
                w = ours_md.state_dict_metadata[k]
                assert (w.size, w.properties.dtype) == (v.size, v.properties.dtype), k
        want = template_from(md)
        dcp.load(want, storage_reader=FileSystemReader(str(ckpt)), no_dist=True)
        assert_same(got, want, case)

    # and the oracle, gathered in the live job
    oracle = oracle_tensors(case)
    nontensor = json.loads((FIX / case / "oracle" / "nontensor.json").read_text())
    flat = flat_values(got, md)
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    assert sorted(tensors) == sorted(oracle)
    for k, t in oracle.items():
        assert_same(tensors[k].contiguous(), t, k)
    values = {k: jsonify(v) for k, v in flat.items() if not isinstance(v, torch.Tensor)}
    assert values == nontensor
    assert "PLACEHOLDER" not in json.dumps(values)


def test_lightning_meta_pt_values():
    """A Fabric folder's meta.pt keys are entries too (torch's reader does not see them)."""
    ckpt = FIX / "fabric_fsdp1_w4_f32" / "checkpoint"
    want = torch.load(ckpt / "meta.pt", weights_only=False)
    sd = {k: "PLACEHOLDER" for k in want}
    dcp.load(sd, storage_reader=rt.StorageReader(ckpt), no_dist=True)
    assert_same(sd, want)


def test_odd_targets_match_filesystem_reader():
    """Targets that cannot take the bytes in place (another dtype, non-contiguous, one
    tensor under two names) are filled through a temporary, as torch's copy_ fills them."""
    case = "fsdp2_w2_tied"
    ckpt = FIX / case / "checkpoint"
    md = torch_metadata(ckpt)

    def build():
        sd = template_from(md)
        m = sd["model"]
        m["lm_head.weight"] = m["embed.weight"]  # tied: one tensor under two names
        # a transposed (non-contiguous) target
        w = m["blocks.0.qkv.weight"]
        m["blocks.0.qkv.weight"] = sentinel(tuple(reversed(w.shape)), w.dtype).t()
        # another dtype (cast by copy_), and a view with a storage offset
        m["head.weight"] = sentinel(m["head.weight"].shape, torch.float64)
        big = sentinel((3 + m["head.bias"].numel(),), torch.float32)
        m["head.bias"] = big[3:]
        return sd

    got, want = build(), build()
    assert not got["model"]["blocks.0.qkv.weight"].is_contiguous()
    dcp.load(got, storage_reader=rt.StorageReader(ckpt), no_dist=True)
    dcp.load(want, storage_reader=FileSystemReader(str(ckpt)), no_dist=True)
    assert_same(got, want)
    assert got["model"]["lm_head.weight"] is got["model"]["embed.weight"]
    oracle = oracle_tensors(case)
    assert_same(got["model"]["head.weight"], oracle["model.head.weight"].double())
    assert_same(got["model"]["blocks.0.qkv.weight"].contiguous(), oracle["model.blocks.0.qkv.weight"])


def test_empty_state_dict_planner_rebuilds_nested_dict():
    """planner_data lets torch's planner that builds the state dict from the metadata (as
    dcp_to_torch_save does) rebuild the nested dict, as with torch's reader."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    ckpt = FIX / "fsdp2_w4_f32" / "checkpoint"
    got: dict = {}
    want: dict = {}
    _load_state_dict(got, storage_reader=rt.StorageReader(ckpt), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    _load_state_dict(want, storage_reader=FileSystemReader(str(ckpt)), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    assert_same(got, want)
    assert got["step"] == 1 and isinstance(got["model"]["embed.weight"], torch.Tensor)


def test_interface():
    """Every abstract method of torch's StorageReader is implemented; ids validate."""
    from torch.distributed.checkpoint.storage import StorageReader

    assert issubclass(rt.StorageReader, StorageReader)
    assert not getattr(rt.StorageReader, "__abstractmethods__", set())
    ckpt = FIX / "fsdp2_w2_f32" / "checkpoint"
    assert rt.StorageReader.validate_checkpoint_id(ckpt)
    # as torch's FileSystemReader: a path that does not exist (yet) is valid too
    assert rt.StorageReader.validate_checkpoint_id(FIX / "no_such_checkpoint")
    assert not rt.StorageReader.validate_checkpoint_id("nope://bucket/ck")
    r = rt.StorageReader(reshard.open(ckpt))
    assert r.checkpoint_id == str(ckpt)
    md = r.read_metadata()
    t = md.state_dict_metadata["model.embed.weight"]
    assert t.size == torch.Size([10, 12]) and t.properties.dtype == torch.float32
    assert [(c.offsets, c.sizes) for c in t.chunks] == [(torch.Size([0, 0]), torch.Size([10, 12]))]
    assert isinstance(md.state_dict_metadata["optimizer.param_groups.0.lr"], BytesStorageMetadata)
    assert md.planner_data["model.embed.weight"] == ("model", "embed.weight")
    if getattr(md, "storage_meta", None) is not None:
        assert md.storage_meta.load_id
    r.reset(FIX / "fsdp2_w4_f32" / "checkpoint")
    assert r.checkpoint.world_size == 4


# --- (3) other formats --------------------------------------------------------------------
PT_CASES = sorted(d.name for d in (FIX / "pt").iterdir() if (d / "model.pt").exists())


def _is_leaf(v) -> bool:
    """torch's flattening rule: dicts are walked, lists holding tensors, dicts or such lists
    too; everything else is one entry."""
    if isinstance(v, dict):
        return False
    if isinstance(v, list):
        return not any(isinstance(x, torch.Tensor) or not _is_leaf(x) for x in v)
    return True


def _placeholder_template(obj):
    """``obj`` with every leaf replaced: tensors by sentinels, values by a placeholder."""
    if not _is_leaf(obj):
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        out = type(obj)() if isinstance(obj, dict) else [None] * len(obj)
        for k, v in items:
            out[k] = _placeholder_template(v)
        return out
    if isinstance(obj, torch.nn.Parameter):
        return torch.nn.Parameter(sentinel(obj.shape, obj.dtype), requires_grad=obj.requires_grad)
    if isinstance(obj, torch.Tensor):
        return sentinel(obj.shape, obj.dtype)
    return "PLACEHOLDER"


@pytest.mark.parametrize("case", PT_CASES)
def test_torch_save_file(case):
    """A torch.save file loads into the structure torch.load gives, byte for byte; the flat
    names are the ones torch's flattening makes."""
    path = FIX / "pt" / case / "model.pt"
    ref = torch.load(path, weights_only=False, map_location="cpu")
    sd = _placeholder_template(ref)
    dcp.load(sd, storage_reader=rt.StorageReader(path), no_dist=True)
    assert_same(sd, ref, case)


def test_torch_size_value():
    path = FIX / "pt" / "ordered" / "model.pt"
    sd = {"shape": "PLACEHOLDER"}
    dcp.load(sd, storage_reader=rt.StorageReader(path), no_dist=True)
    assert_same(sd["shape"], torch.load(path, weights_only=False)["shape"])


def test_safetensors_file(tmp_path):
    from safetensors.torch import save_file

    oracle = oracle_tensors("fsdp2_w4_f32")
    oracle = {k: v for k, v in oracle.items() if v.dtype != torch.uint16 or hasattr(torch, "uint16")}
    f = tmp_path / "model.safetensors"
    save_file(oracle, str(f))
    sd = {k: sentinel(v.shape, v.dtype) for k, v in oracle.items()}
    dcp.load(sd, storage_reader=rt.StorageReader(f), no_dist=True)
    assert_same(sd, oracle)


@pytest.mark.parametrize("case", ["hf_storage_w4_f32", "hf_storage_w3_bf16"])
def test_hf_storage_folder_matches_torch(case):
    """torch's HuggingFaceStorageWriter(save_distributed=True) output, against torch's
    HuggingFaceStorageReader and the oracle."""
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    ckpt = FIX / case / "checkpoint"
    oracle = oracle_tensors(case)
    got = {k: sentinel(v.shape, v.dtype) for k, v in oracle.items()}
    want = {k: sentinel(v.shape, v.dtype) for k, v in oracle.items()}
    dcp.load(got, storage_reader=rt.StorageReader(ckpt), no_dist=True)
    dcp.load(want, storage_reader=HuggingFaceStorageReader(str(ckpt)), no_dist=True)
    assert_same(got, want)
    assert_same(got, oracle)


def test_hf_sharded_folder(tmp_path):
    """An HF sharded folder (written by reshard.convert) with the values it carries."""
    case = "fsdp2_w2_f32"
    out = tmp_path / "hf"
    summary = reshard.convert(FIX / case / "checkpoint", out, world_size=1, format="hf", max_shard_size=8000)
    assert summary["format"] == "hf" and len(list(out.glob("*.safetensors"))) >= 2
    md = torch_metadata(FIX / case / "checkpoint")
    sd = template_from(md)
    dcp.load(sd, storage_reader=rt.StorageReader(out), no_dist=True)
    flat = flat_values(sd, md)
    oracle = oracle_tensors(case)
    for k, t in oracle.items():
        assert_same(flat[k].contiguous(), t, k)
    nontensor = json.loads((FIX / case / "oracle" / "nontensor.json").read_text())
    assert {k: jsonify(v) for k, v in flat.items() if k in nontensor} == nontensor


# --- (4) errors ------------------------------------------------------------------------------
def test_missing_checkpoint_raises_reshard_error(tmp_path):
    """As torch's FileSystemReader, the reader opens nothing before read_metadata: a missing
    checkpoint raises a reshard error there, and fails dcp.load as torch's reader's
    FileNotFoundError does (torch's loader reports the read_metadata error)."""
    from torch.distributed.checkpoint.api import CheckpointException

    r = rt.StorageReader(tmp_path / "no_such")
    with pytest.raises(reshard.ReshardError, match="no_such") as ei:
        r.read_metadata()
    good = rt.StorageReader(FIX / "fsdp2_w2_f32" / "checkpoint")
    with pytest.raises(CheckpointException) as ce:
        dcp.load({}, checkpoint_id=str(tmp_path / "no_such"), storage_reader=good, no_dist=True)
    (err, _tb), = ce.value.failures.values()
    assert f"global metadata read failed: {ei.value}" in str(err)


def test_read_metadata_error_and_read_error(tmp_path):
    """A checkpoint that goes missing after the reader opened it: read_metadata (after a
    reset) raises a reshard error naming the file; a data file truncated under a load fails
    the load with reshard's error, promptly."""
    from torch.distributed.checkpoint.api import CheckpointException

    ckpt = tmp_path / "ck"
    shutil.copytree(FIX / "fsdp2_w2_f32" / "checkpoint", ckpt)
    r = rt.StorageReader(ckpt)
    md = r.read_metadata()
    sd = {k: sentinel(v.size, v.properties.dtype) for k, v in md.state_dict_metadata.items()
          if isinstance(v, TensorStorageMetadata)}

    data = ckpt / "__1_0.distcp"
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(CheckpointException) as ei:
        dcp.load(sd, storage_reader=r, no_dist=True)
    (err, _tb), = ei.value.failures.values()
    assert isinstance(err, reshard.CheckpointError) and "__1_0.distcp" in str(err) and "truncated" in str(err)

    (ckpt / ".metadata").unlink()
    r.reset()
    with pytest.raises(reshard.ReshardError, match=r"\.metadata|ck"):
        r.read_metadata()


def test_errors_cross_processes():
    """DCP pickles a rank's exception to send it to the others: reshard's must survive it."""
    import pickle

    for cls in (reshard.ReshardError, reshard.CheckpointError, reshard.RequestError, reshard.ReshardIOError):
        e = pickle.loads(pickle.dumps(cls("/x/__1_0.distcp: is truncated")))
        assert type(e) is cls and str(e) == "/x/__1_0.distcp: is truncated"


# --- (2) two gloo processes, FSDP2 DTensor targets ---------------------------------------------
WORKER = textwrap.dedent(
    r"""
    import os, sys, shutil, warnings
    warnings.filterwarnings("ignore")
    sys.path.insert(0, os.environ["SCRIPTS"])
    import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from safetensors.torch import load_file
    import gen_fixtures as g
    import reshard, reshard.torch as rt
    sys.path.insert(0, os.environ["TESTS"])
    from test_storage_reader import assert_same, scribble, sentinel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    ckpt = os.environ["CKPT"]

    def fresh():
        model = g.build_model(1, torch.float32)
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt, sched = g.make_optim(model)
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optimizer": osd, "scheduler": sched.state_dict(), "step": -1,
              "extra": g.make_extra()}
        scribble(sd)
        return sd

    want = fresh()
    dcp.load(want, storage_reader=FileSystemReader(ckpt))
    n = 0
    for no_dist in (True, False):
        got = fresh()
        dcp.load(got, storage_reader=rt.StorageReader(ckpt), no_dist=no_dist)
        assert_same(got, want, f"no_dist={no_dist}")
        n += 1
    assert want["step"] == 1 and want["scheduler"]["last_epoch"] == 1
    dt = want["model"]["embed.weight"]
    assert type(dt).__name__ == "DTensor" and dt.to_local().shape[0] == 5
    # the loaded DTensors are the whole tensors the live job saved
    oracle = load_file(os.environ["ORACLE"])
    for k, v in want["model"].items():
        full = v.full_tensor() if type(v).__name__ == "DTensor" else v
        assert_same(full, oracle["model." + k], k)
    print(f"rank {rank}: {n} loads equal", flush=True)

    # an error in one rank's reads fails the load on every rank, without a hang
    bad = os.environ["BAD"]
    if rank == 0:
        shutil.copytree(ckpt, bad)
    dist.barrier()
    reader = rt.StorageReader(bad)
    reader.read_metadata()  # opened (and checked) before the file is cut: the reads fail
    dist.barrier()
    if rank == 0:
        f = os.path.join(bad, "__3_0.distcp")
        os.truncate(f, os.path.getsize(f) // 2)
    dist.barrier()
    try:
        dcp.load(fresh(), storage_reader=reader)
    except CheckpointException as e:
        msgs = [str(err) for err, _tb in e.failures.values()]
        assert all("truncated" in m for m in msgs), msgs
        print(f"rank {rank}: load failed on ranks {sorted(e.failures)}", flush=True)
    else:
        raise AssertionError("the load of a truncated checkpoint succeeded")
    dist.destroy_process_group()
    # No interpreter teardown: torch 2.15's gloo worker thread can free a finished all_gather's
    # tensors during Py_Finalize, fail to take the GIL and abort ("terminate called without an
    # active exception") after all the work is done (scripts/torch_interop.py does the same).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_dtensors_two_gloo_ranks(tmp_path):
    """fsdp2_w4_f32 (4 ranks) into an FSDP2 model at world 2, with no_dist=True and with the
    process group: equal to FileSystemReader's load, DTensor local shards byte for byte."""
    case = "fsdp2_w4_f32"
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = _free_port()
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE="2",
        SCRIPTS=str(SCRIPTS),
        TESTS=str(Path(__file__).resolve().parent),
        CKPT=str(FIX / case / "checkpoint"),
        ORACLE=str(FIX / case / "oracle" / "full.safetensors"),
        BAD=str(tmp_path / "bad"),
        OMP_NUM_THREADS="1",
    )
    procs = []
    for rank in range(2):
        e = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{out}\n{err[-4000:]}"
        assert f"rank {rank}: 2 loads equal" in out
    failed = [[l for l in out.splitlines() if "load failed on ranks" in l] for _p, (out, _e) in zip(procs, outs)]
    assert [len(f) for f in failed] == [1, 1], failed
    assert failed[0][0].split(":", 1)[1] == failed[1][0].split(":", 1)[1], failed
