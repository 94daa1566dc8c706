"""Non-tensor values torch's ``dcp.save`` writes as BYTE_IO items of any picklable kind: an
``io.BytesIO`` (torch's own train-state pattern) is read as a value; an object whose pickle
names a class reshard does not import (a user class, or ``os.system``) is opaque: the
checkpoint opens and lists it, its stored bytes go to torch unchanged under ``dcp.load`` and
into DCP outputs, nothing of it is ever run, and asking reshard for its value is an error
naming the key and the global. torch's own FileSystemReader / ``dcp.load`` /
``dcp_to_torch_save`` is the oracle throughout."""

import io
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import reshard
import reshard.torch as rt
from _util import _quiet, same  # noqa: F401  (autouse fixture)

MODULE = "reshard_opaque_mymod"


@pytest.fixture(scope="module")
def mymod(tmp_path_factory):
    """A helper module defining the user's class, importable by torch's unpickler."""
    d = tmp_path_factory.mktemp("mod")
    (d / f"{MODULE}.py").write_text(textwrap.dedent("""
        class TrainState:
            def __init__(self, step, losses):
                self.step = step
                self.losses = losses
    """))
    sys.path.insert(0, str(d))
    try:
        yield __import__(MODULE)
    finally:
        sys.path.remove(str(d))
        sys.modules.pop(MODULE, None)


def _buf(data: bytes, pos: int) -> io.BytesIO:
    b = io.BytesIO(data)
    b.seek(pos)
    return b


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, mymod):
    path = tmp_path_factory.mktemp("ck") / "bio"
    sd = {
        "t": torch.arange(6.0).reshape(2, 3),
        "losses": _buf(b"abc\x00\xff", 2),
        "obj": mymod.TrainState(7, [0.5, 0.25]),
        "nested": {"buf": _buf(b"xyz", 3), "epoch": 3},
    }
    dcp.save(sd, checkpoint_id=str(path))
    return path


def _template(mymod):
    return {
        "t": torch.zeros(2, 3),
        "losses": io.BytesIO(),
        "obj": mymod.TrainState(0, []),
        "nested": {"buf": io.BytesIO(), "epoch": 0},
    }


def _same_values(a, b):
    assert same(a["t"], b["t"])
    for x, y in ((a["losses"], b["losses"]), (a["nested"]["buf"], b["nested"]["buf"])):
        assert isinstance(x, io.BytesIO) and isinstance(y, io.BytesIO)
        assert (x.getvalue(), x.tell()) == (y.getvalue(), y.tell())
    assert type(a["obj"]) is type(b["obj"]) and vars(a["obj"]) == vars(b["obj"])
    assert a["nested"]["epoch"] == b["nested"]["epoch"]


def _torch_load(path, mymod, reader=None):
    sd = _template(mymod)
    dcp.load(sd, storage_reader=reader or FileSystemReader(str(path)))
    return sd


def test_it_opens_and_lists_every_entry(ckpt):
    ck = reshard.open(ckpt)
    assert ck.keys() == ["t", "losses", "obj", "nested.buf", "nested.epoch"]
    assert ck.paths()["nested.buf"] == ["nested", "buf"]


def test_a_bytes_io_is_given_as_torch_gives_it(ckpt, mymod):
    want = _torch_load(ckpt, mymod)
    sd = {"t": torch.zeros(2, 3), "losses": io.BytesIO(), "nested": {"buf": io.BytesIO(), "epoch": 0}}
    rt.load(sd, ckpt, strict=False)
    for got, exp in ((sd["losses"], want["losses"]), (sd["nested"]["buf"], want["nested"]["buf"])):
        assert isinstance(got, io.BytesIO)
        assert (got.getvalue(), got.tell()) == (exp.getvalue(), exp.tell())
    assert sd["nested"]["epoch"] == 3 and same(sd["t"], want["t"])


def test_only_the_tensor_is_loaded(ckpt):
    sd = {"t": torch.zeros(2, 3)}
    res = rt.load(sd, ckpt)
    assert same(sd["t"], torch.arange(6.0).reshape(2, 3))
    assert res.missing_keys == [] and res.unexpected_keys == []  # only keys under the state dict's own


def test_asking_reshard_for_an_opaque_value_names_the_key_and_the_global(ckpt, mymod):
    ck = reshard.open(ckpt)
    with pytest.raises(reshard.CheckpointError) as e:
        rt.load({"t": torch.zeros(2, 3), "obj": mymod.TrainState(0, [])}, ckpt)
    msg = str(e.value)
    assert "`obj`" in msg and f"`{MODULE}.TrainState`" in msg and "\n" not in msg
    with pytest.raises(reshard.CheckpointError, match=f"`obj` is a pickle naming `{MODULE}.TrainState`"):
        ck.values()
    # its stored bytes are what torch itself makes the object from
    raw = ck.value_bytes("obj")
    obj = torch.load(io.BytesIO(raw), weights_only=False)
    assert type(obj) is mymod.TrainState and vars(obj) == {"step": 7, "losses": [0.5, 0.25]}


def test_the_storage_reader_gives_torch_what_its_reader_gives(ckpt, mymod):
    _same_values(_torch_load(ckpt, mymod, rt.StorageReader(str(ckpt))), _torch_load(ckpt, mymod))


def test_a_dcp_output_keeps_the_stored_bytes(ckpt, mymod, tmp_path):
    out = tmp_path / "out"
    reshard.convert(ckpt, out, world_size=2, format="dcp")
    _same_values(_torch_load(out, mymod), _torch_load(ckpt, mymod))
    assert reshard.open(out).value_bytes("obj") == reshard.open(ckpt).value_bytes("obj")


def test_a_pt_output_needs_the_value(ckpt, mymod, tmp_path):
    with pytest.raises(reshard.RequestError) as e:
        reshard.convert(ckpt, tmp_path / "m.pt", world_size=1)
    msg = str(e.value)
    assert "`obj`" in msg and f"`{MODULE}.TrainState`" in msg and "--exclude 'obj'" in msg
    assert not (tmp_path / "m.pt").exists()
    # left out, the rest is what torch's own dcp_to_torch_save gives
    reshard.convert(ckpt, tmp_path / "m.pt", world_size=1, exclude=["obj"])
    dcp_to_torch_save(str(ckpt), str(tmp_path / "torch.pt"))
    got = torch.load(tmp_path / "m.pt", weights_only=False)
    want = torch.load(tmp_path / "torch.pt", weights_only=False)
    del want["obj"]
    assert sorted(got) == sorted(want)
    want["obj"] = got["obj"] = mymod.TrainState(0, [])
    _same_values(got, want)


def test_a_safetensors_output_keeps_the_bytes_io_values(ckpt, tmp_path):
    with pytest.raises(reshard.RequestError, match="`obj`"):
        reshard.convert(ckpt, tmp_path / "m.safetensors", world_size=1)
    reshard.convert(ckpt, tmp_path / "m.safetensors", world_size=1, exclude=["obj"])
    values = reshard.open(tmp_path / "m.safetensors").values()
    assert (values["losses"].getvalue(), values["losses"].tell()) == (b"abc\x00\xff", 2)
    assert (values["nested.buf"].getvalue(), values["nested.buf"].tell()) == (b"xyz", 3)


class _Hostile:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_hostile_pickle_is_never_run(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil"
    dcp.save({"t": torch.ones(2), "evil": _Hostile(marker)}, checkpoint_id=str(path))
    ck = reshard.open(path)
    assert ck.keys() == ["t", "evil"]
    with pytest.raises(reshard.CheckpointError, match=r"`evil` is a pickle naming `(posix|os)\.system`"):
        ck.values()
    with pytest.raises(reshard.CheckpointError, match="`evil`"):
        rt.load({"t": torch.zeros(2), "evil": None}, path)
    sd = {"t": torch.zeros(2)}
    rt.load(sd, path)
    assert same(sd["t"], torch.ones(2))
    reshard.convert(path, tmp_path / "out", world_size=1, format="dcp")
    assert reshard.open(tmp_path / "out").value_bytes("evil") == ck.value_bytes("evil")
    exe = shutil.which("reshard", path=str(Path(sys.executable).parent))
    r = subprocess.run([exe, "inspect", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "evil [dcp] = \"<opaque" in r.stdout
    assert not marker.exists()


def test_inspect_lists_the_values(ckpt):
    exe = shutil.which("reshard", path=str(Path(sys.executable).parent))
    r = subprocess.run([exe, "inspect", str(ckpt)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert f'obj [dcp] = "<opaque {MODULE}.TrainState>"' in r.stdout
    assert 'losses [dcp] = "<_io.BytesIO>"' in r.stdout
