"""reshard.torch.StorageReader's protocol against torch's FileSystemReader on the same
checkpoints: nothing opened before read_metadata (a reader made before its checkpoint, used
for several loads), reset, validate_checkpoint_id, the metadata's storage_meta (save_id), and
_extension_registry (a caller's stream transform, rot13 as in torch's tests)."""

import io
import os
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import _dist
import reshard
import reshard.torch as rt
from _util import _quiet  # noqa: F401  (autouse)
from test_storage_reader import DCP_CASES, FIX, TORCH_CANNOT, assert_same, sentinel

_extension = pytest.importorskip("torch.distributed.checkpoint._extension")
ExtensionRegistry = _extension.ExtensionRegistry
StreamTransformExtension = _extension.StreamTransformExtension


# --- helpers ---------------------------------------------------------------------------------
def state(seed: int = 0, rows: int = 4) -> dict:
    """A small state dict: tensors of several dtypes (one nested), non-tensor values."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(rows, 6, generator=g),
        "b": torch.randn(6, generator=g).to(torch.bfloat16),
        "sub": {"i": torch.arange(10, dtype=torch.int64) + seed, "flag": torch.tensor([True, False])},
        "step": 7 + seed,
        "names": ["a", "b", str(seed)],
    }


def template(sd: dict) -> dict:
    """``sd`` with sentinel tensors and placeholder values, to load into."""
    out: dict = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = template(v)
        elif isinstance(v, torch.Tensor):
            out[k] = sentinel(v.shape, v.dtype)
        else:
            out[k] = "PLACEHOLDER"
    return out


def save(sd: dict, path: Path, **writer_kw) -> FileSystemWriter:
    writer = FileSystemWriter(str(path), **writer_kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, storage_writer=writer, no_dist=True)
    return writer


def load(reader, like: dict) -> dict:
    sd = template(like)
    dcp.load(sd, storage_reader=reader, no_dist=True)
    return sd


_ROT13 = bytes.maketrans(
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz",
    b"NOPQRSTUVWXYZABCDEFGHIJKLMnopqrstuvwxyzabcdefghijklm",
)


class Rot13(StreamTransformExtension):
    """A caller's stream transform (as torch's tests register one): rot13 of every byte."""

    @staticmethod
    def registry_name() -> str:
        return "test.rot13"

    @staticmethod
    def from_descriptor(version: str) -> "Rot13":
        if version != "1":
            raise ValueError(f"Unknown rot13 version {version}")
        return Rot13()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output):
        class Writer(io.RawIOBase):
            def writable(self) -> bool:
                return True

            def write(self, b) -> int:
                data = bytes(b)
                output.write(data.translate(_ROT13))
                return len(data)

            def close(self) -> None:
                if not self.closed:
                    output.close()
                super().close()

        return Writer()

    def transform_from(self, input):
        class Reader(io.RawIOBase):
            def readable(self) -> bool:
                return True

            def readinto(self, b) -> int:
                data = input.read(len(b))
                b[: len(data)] = data.translate(_ROT13)
                return len(data)

        return Reader()


def rot13_registry() -> "ExtensionRegistry":
    reg = ExtensionRegistry()
    reg.register(Rot13)
    return reg


# --- (1) lazy open -----------------------------------------------------------------------------
def test_reader_made_before_the_checkpoint_exists(tmp_path):
    """Nothing is opened by the constructor (torch's reader opens nothing either): a reader of
    a path that does not exist yet loads what is saved there afterwards."""
    ck = tmp_path / "ck"
    ours, theirs = rt.StorageReader(ck), FileSystemReader(str(ck))
    sd = state()
    save(sd, ck)
    got, want = load(ours, sd), load(theirs, sd)
    assert_same(got, want)
    assert_same(got, sd)


def test_reader_reused_for_a_new_save(tmp_path):
    """One reader, two loads with no reset between, the checkpoint saved again (another
    shape, another key) in between: the second load reads the new checkpoint, as torch's."""
    ck = tmp_path / "ck"
    first = state(0, rows=4)
    save(first, ck)
    ours, theirs = rt.StorageReader(ck), FileSystemReader(str(ck))
    assert_same(load(ours, first), load(theirs, first))
    second = dict(state(1, rows=9), extra=torch.ones(3))
    save(second, ck)
    got, want = load(ours, second), load(theirs, second)
    assert_same(got, want)
    assert_same(got, second)


def test_open_checkpoint_object_keeps_working(tmp_path):
    """A reader made with an open reshard.Checkpoint reads that object, load after load."""
    ck = tmp_path / "ck"
    sd = state()
    save(sd, ck)
    r = rt.StorageReader(reshard.open(ck))
    assert r.checkpoint_id == str(ck)
    for _ in range(2):
        assert_same(load(r, sd), load(FileSystemReader(str(ck)), sd))
        r.reset()


def test_errors_come_from_read_metadata(tmp_path):
    """A missing or corrupt checkpoint: the constructor is silent, read_metadata raises
    reshard's one-line error; the same reader works once the checkpoint is there."""
    missing = rt.StorageReader(tmp_path / "missing")
    with pytest.raises(reshard.ReshardError, match="missing") as ei:
        missing.read_metadata()
    assert "\n" not in str(ei.value)

    bad = tmp_path / "bad"
    sd = state()
    save(sd, bad)
    good_md = (bad / ".metadata").read_bytes()
    (bad / ".metadata").write_bytes(b"not a pickle")
    r = rt.StorageReader(bad)
    with pytest.raises(reshard.CheckpointError, match="metadata") as ei:
        r.read_metadata()
    assert "\n" not in str(ei.value)
    (bad / ".metadata").write_bytes(good_md)
    assert_same(load(r, sd), sd)


# --- (2) reset -------------------------------------------------------------------------------
def test_reset_as_torch(tmp_path):
    """reset(): a new load_id; reset(checkpoint_id): that path from now on, opened by the next
    read_metadata (it may not exist yet), as torch's reader."""
    a, b = tmp_path / "a", tmp_path / "b"
    sa, sb = state(0), state(1, rows=5)
    save(sa, a)
    ours, theirs = rt.StorageReader(a), FileSystemReader(str(a))
    for r in (ours, theirs):
        ids = [r.load_id]
        r.reset()
        ids.append(r.load_id)
        r.reset(b)  # b does not exist yet
        ids.append(r.load_id)
        assert len(set(ids)) == 3 and all(ids)
        assert str(r.checkpoint_id) == str(b)
    save(sb, b)
    assert_same(load(ours, sb), load(theirs, sb))
    assert ours.read_metadata().storage_meta.load_id == ours.load_id
    # dcp.load(checkpoint_id=...) resets the reader to it
    got = template(sa)
    dcp.load(got, checkpoint_id=str(a), storage_reader=ours, no_dist=True)
    assert_same(got, sa)
    assert ours.checkpoint_id == str(a)


# --- (3) validate_checkpoint_id --------------------------------------------------------------
def test_validate_checkpoint_id_as_torch(tmp_path):
    """The answer of torch's FileSystemReader for local ids (existing or not, str or Path),
    and True for the object-store URLs reshard reads (torch's says False)."""
    ck = FIX / "fsdp2_w2_f32" / "checkpoint"
    ids = [
        ck, str(ck), tmp_path / "not_yet", str(tmp_path / "not_yet"), str(tmp_path / "a" / "b" / "c"),
        "nope://bucket/ck", "relative/ck",
    ]
    for i in ids:
        assert rt.StorageReader.validate_checkpoint_id(i) == FileSystemReader.validate_checkpoint_id(i), i
    assert rt.StorageReader.validate_checkpoint_id(str(tmp_path / "not_yet"))
    for url in ("s3://bucket/ck", "gs://bucket/ck", "az://container/ck", "https://host/ck"):
        assert rt.StorageReader.validate_checkpoint_id(url), url
    assert not rt.StorageReader.validate_checkpoint_id(42)  # type: ignore[arg-type]


# --- (4) storage_meta ------------------------------------------------------------------------
@pytest.mark.parametrize("protocol", [None, 2, 5])
def test_storage_meta_as_torch(tmp_path, protocol):
    """read_metadata().storage_meta: the StorageMeta saved in the DCP metadata (checkpoint_id,
    the writer's save_id, modules) with the reader's load_id, as torch's reader returns it
    (torch's test_storage_meta); also when the .metadata was pickled at another protocol."""
    ck = tmp_path / "ck"
    writer = save(state(), ck)
    if protocol is not None:  # the same metadata pickled again at that protocol
        with open(ck / ".metadata", "rb") as f:
            md = pickle.load(f)
        with open(ck / ".metadata", "wb") as f:
            pickle.dump(md, f, protocol=protocol)
    ours, theirs = rt.StorageReader(ck), FileSystemReader(str(ck))
    sm, want = ours.read_metadata().storage_meta, theirs.read_metadata().storage_meta
    assert sm is not None and sm.save_id is not None
    assert str(sm.checkpoint_id) == str(ck)
    assert sm.save_id == writer.save_id
    assert sm.load_id == ours.load_id
    assert (sm.checkpoint_id, sm.save_id, sm.modules) == (want.checkpoint_id, want.save_id, want.modules)


@pytest.mark.parametrize("case", [c for c in DCP_CASES if c not in TORCH_CANNOT])
def test_storage_meta_of_fixtures_as_torch(case):
    """Every DCP fixture torch's reader reads: the same storage_meta but for load_id."""
    ck = FIX / case / "checkpoint"
    ours, theirs = rt.StorageReader(ck), FileSystemReader(str(ck))
    sm, want = ours.read_metadata().storage_meta, theirs.read_metadata().storage_meta
    if want.save_id is None:  # saved before torch 2.4: no StorageMeta (torch makes an empty one)
        assert (sm.checkpoint_id, sm.save_id) == (str(ck), None)
    else:
        assert (sm.checkpoint_id, sm.save_id, sm.modules) == (want.checkpoint_id, want.save_id, want.modules)
    assert (sm.load_id, want.load_id) == (ours.load_id, theirs.load_id)


def test_storage_meta_per_rank_metadata_and_other_formats(tmp_path):
    """No global .metadata (use_collectives=False): rank 0's saved StorageMeta; a DCP
    fixture from before torch 2.4 and a safetensors file have none: the path read."""
    ck = tmp_path / "nocoll"
    shutil.copytree(FIX / "fsdp2_w2_f32_nocoll" / "checkpoint", ck)
    with open(ck / "__0.metadata", "rb") as f:
        want = pickle.load(f).storage_meta
    sm = rt.StorageReader(ck).read_metadata().storage_meta
    assert want is not None and sm.save_id == want.save_id is not None

    old = FIX / "fabric_fsdp1_w4_f32_torch21" / "checkpoint"
    for path in (old, FIX / "pt" / "ordered" / "model.pt"):
        if not path.exists():
            continue
        r = rt.StorageReader(path)
        sm = r.read_metadata().storage_meta
        assert (sm.checkpoint_id, sm.save_id, sm.load_id) == (str(path), None, r.load_id)


_CALLED: list = []


def _record(*args) -> None:
    _CALLED.append(args)


class _Call:
    """Unpickling it calls _record."""

    def __reduce__(self):
        return (_record, ("called",))


def test_a_hostile_storage_meta_calls_nothing(tmp_path):
    """The saved StorageMeta is read by the native reader, which calls nothing: a .metadata
    whose StorageMeta holds a call or a function is refused, with an error naming the file;
    fields of other plain types are left out; a path and a str come back as saved; a
    storage_meta that is no StorageMeta, or a truncated .metadata, is not read as one."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    ck = tmp_path / "ck"
    save(state(), ck)
    with open(ck / ".metadata", "rb") as f:
        md = pickle.load(f)

    def saved(sm, protocol=None):
        md.storage_meta = sm
        with open(ck / ".metadata", "wb") as f:
            pickle.dump(md, f, protocol=protocol)
        r = rt.StorageReader(ck)
        got = r.read_metadata().storage_meta
        assert got.load_id == r.load_id
        return (got.checkpoint_id, got.save_id, got.modules)

    for proto in range(2, pickle.HIGHEST_PROTOCOL + 1):
        for odd in (
            StorageMeta(checkpoint_id=_Call(), save_id="abc"),
            StorageMeta(checkpoint_id="ck", save_id="abc", modules=[os.path.join]),
        ):
            with pytest.raises(reshard.CheckpointError, match=r"\.metadata.*global"):
                saved(odd, proto)
            assert not _CALLED, "the reader called what the pickle names"
        assert saved(StorageMeta(checkpoint_id=Path("/x/ck"), save_id="abc", modules=["m"]), proto) == (
            Path("/x/ck"), "abc", ["m"]
        )
    assert saved(StorageMeta(checkpoint_id="s3://b/ck", save_id="abc")) == ("s3://b/ck", "abc", [])
    assert saved(StorageMeta(checkpoint_id=3, save_id=b"abc", modules="m")) == (None, None, [])
    assert saved(StorageMeta(checkpoint_id=Path("rel/ck"), save_id="x", modules=["a", 1])) == (Path("rel/ck"), "x", [])
    for other in (None, 5, {"save_id": "abc"}):  # no StorageMeta saved: torch's own, the path read
        assert saved(other) == (str(ck), None, [])
    data = (ck / ".metadata").read_bytes()
    for junk in (b"", data[: len(data) // 2], data[:-1]):
        (ck / ".metadata").write_bytes(junk)
        with pytest.raises(reshard.ReshardError):
            rt.StorageReader(ck).read_metadata()


# --- (5) _extension_registry -----------------------------------------------------------------
def test_custom_stream_transform_with_registry(tmp_path):
    """Items saved through a caller's stream transform (torch's _extensions): with an
    _extension_registry that knows it, the same values as torch's FileSystemReader with
    that registry (and as saved), the saved storage_meta included."""
    ck = tmp_path / "rot13"
    sd = state()
    writer = save(sd, ck, _extensions=[Rot13()])
    with open(ck / ".metadata", "rb") as f:
        infos = pickle.load(f).storage_data.values()
    assert {tuple(i.transform_descriptors or ()) for i in infos} == {("test.rot13/1",)}

    ours = rt.StorageReader(ck, _extension_registry=rot13_registry())
    theirs = FileSystemReader(str(ck), _extension_registry=rot13_registry())
    got, want = load(ours, sd), load(theirs, sd)
    assert_same(got, want)
    assert_same(got, sd)
    md = ours.read_metadata()
    assert md.storage_meta.save_id == writer.save_id and md.storage_meta.load_id == ours.load_id
    # positionally, as torch's constructor takes it; and reused after a reset
    r = rt.StorageReader(str(ck), rot13_registry())
    assert_same(load(r, sd), sd)
    r.reset()
    assert_same(load(r, sd), sd)


def job_rot13(rank: int, world: int, ck: str) -> bool:
    """One rank of a process group: the rot13 checkpoint through reshard's reader (with the
    registry) and torch's: equal, and equal to what was saved."""
    sd = state()
    got, want = template(sd), template(sd)
    dcp.load(got, storage_reader=rt.StorageReader(ck, _extension_registry=rot13_registry()))
    dcp.load(want, storage_reader=FileSystemReader(ck, _extension_registry=rot13_registry()))
    assert_same(got, want)
    assert_same(got, sd)
    return True


def test_custom_stream_transform_two_gloo_ranks(tmp_path):
    """The same under dcp.load with a 2-process gloo group (collectives, rank= kwargs)."""
    ck = tmp_path / "rot13"
    save(state(), ck, _extensions=[Rot13()])
    assert _dist.run(2, job_rot13, str(ck), timeout=150) == [True, True]


def test_custom_stream_transform_without_registry(tmp_path):
    """Without the transform registered, read_metadata raises reshard's one-line error naming
    it (torch's reader raises a ValueError when it reads the items)."""
    ck = tmp_path / "rot13"
    save(state(), ck, _extensions=[Rot13()])
    with pytest.raises(reshard.CheckpointError, match="test.rot13/1") as ei:
        rt.StorageReader(ck).read_metadata()
    assert "\n" not in str(ei.value)
    with pytest.raises(reshard.CheckpointError, match="test.rot13.*_extension_registry") as ei:
        rt.StorageReader(ck, _extension_registry=ExtensionRegistry()).read_metadata()
    assert "\n" not in str(ei.value)


def test_zstd_stays_native_with_a_registry():
    """zstd items are decoded by reshard itself, registry or not (torch's reader needs the
    zstandard or pyzstd module for them)."""
    from safetensors.torch import load_file

    ck = FIX / "fsdp2_w2_f32_zstd" / "checkpoint"
    oracle = load_file(str(FIX / "fsdp2_w2_f32_zstd" / "oracle" / "full.safetensors"))
    for reader in (rt.StorageReader(ck), rt.StorageReader(ck, _extension_registry=rot13_registry())):
        md = reader.read_metadata()
        assert reader._torch_reader is None
        sd = {k: sentinel(v.shape, v.dtype) for k, v in oracle.items() if k in md.state_dict_metadata}
        assert sd
        dcp.load(sd, storage_reader=reader, no_dist=True)
        for k, v in sd.items():
            assert_same(v, oracle[k], k)
