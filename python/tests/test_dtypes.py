"""Every dtype torch saves as plain bytes per element, beside ordinary tensors, read by reshard
byte for byte as torch's own loaders read it: complex32/64/128, float8_e4m3fnuz,
float8_e5m2fnuz, float8_e8m0fnu and float4_e2m1fn_x2, from ``dcp.save`` and ``torch.save``
checkpoints, through ``reshard.open``, ``reshard.torch.load``, ``dcp.load`` with
``reshard.torch.StorageReader`` (``allow_partial_load`` too), ``reshard.convert`` to .pt, DCP
and safetensors (judged by torch's and safetensors' own loaders), at another world size from a
DTensor source sharded over 2 gloo ranks; and casts to or from them refused with the tensor
named, while the ordinary tensors beside them are cast."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import reshard
import reshard.torch as rt

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dist  # noqa: E402
from _util import _quiet, same  # noqa: E402,F401  (_quiet: an autouse fixture)

# torch name -> reshard name
DTYPES = {
    "complex32": "C32",
    "complex64": "C64",
    "complex128": "C128",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
    "float4_e2m1fn_x2": "F4_E2M1FN_X2",
    "bcomplex32": "BC32",
}
COMPLEX_PART = {"complex32": torch.float16, "complex64": torch.float32, "complex128": torch.float64}
# the dtype safetensors' own loader gives back, and whether the tensor comes back as real pairs
ST_DTYPE = {
    "complex32": (torch.float16, True),
    "complex64": (torch.complex64, False),
    "complex128": (torch.float64, True),
    "float8_e4m3fnuz": (torch.float8_e4m3fnuz, False),
    "float8_e5m2fnuz": (torch.float8_e5m2fnuz, False),
    "float8_e8m0fnu": (torch.float8_e8m0fnu, False),
    "bcomplex32": (torch.bfloat16, True),
}
SHAPE = (4, 6)


def value(name: str, seed: int = 0) -> torch.Tensor:
    """A tensor of dtype ``torch.<name>``: complex from random real pairs (as a Llama
    ``freqs_cis`` of ``torch.polar`` for complex64), the byte types from random bytes."""
    g = torch.Generator().manual_seed(seed)
    if name == "complex64":
        return torch.polar(torch.ones(SHAPE), torch.rand(SHAPE, generator=g) * 6.28)
    if name in COMPLEX_PART:
        return torch.view_as_complex(torch.randn(SHAPE + (2,), generator=g).to(COMPLEX_PART[name]))
    if name == "bcomplex32":
        # torch has no view_as_complex for bf16: the pairs' bytes viewed as bcomplex32
        pairs = torch.randn(SHAPE + (2,), generator=g).to(torch.bfloat16)
        return pairs.view(torch.uint8).reshape(SHAPE[0], -1).view(torch.bcomplex32)
    return torch.randint(0, 256, SHAPE, dtype=torch.uint8, generator=g).view(getattr(torch, name))


def state(name: str) -> dict:
    return {"w": torch.randn(3, 2), "ids": torch.arange(5), "x": value(name)}


def save(kind: str, name: str, root: Path):
    sd = state(name)
    p = root / f"src.{kind}"
    if kind == "dcp":
        dcp.save(sd, checkpoint_id=str(p), no_dist=True)
    else:
        torch.save(sd, p)
    return p, sd


def torch_loads(p: Path, template: dict) -> dict:
    """The checkpoint at ``p`` as torch's own loader reads it."""
    if p.is_dir():
        got = {k: torch.empty_like(v) for k, v in template.items()}
        dcp.load(got, storage_reader=FileSystemReader(str(p)), no_dist=True)
        return got
    return torch.load(p, weights_only=True)


def assert_all_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert same(got[k], want[k]), k


@pytest.mark.parametrize("kind", ["dcp", "pt"])
@pytest.mark.parametrize("name", list(DTYPES))
def test_reads_as_torch_does(tmp_path, kind, name):
    p, sd = save(kind, name, tmp_path)
    want = torch_loads(p, sd)
    assert_all_same(want, sd)  # torch's own round trip, the oracle
    ck = reshard.open(p)
    info = {t.name: t for t in ck.tensors()}
    assert (info["x"].dtype, tuple(info["x"].shape)) == (DTYPES[name], SHAPE)
    assert (info["w"].dtype, info["ids"].dtype) == ("F32", "I64")
    assert_all_same({k: ck.get_tensor(k) for k in sd}, want)

    # reshard.torch.load fills a state dict in place
    got = {k: torch.empty_like(v) for k, v in sd.items()}
    rt.load(got, p)
    assert_all_same(got, want)

    # dcp.load through reshard's StorageReader gives torch's values
    got = {k: torch.empty_like(v) for k, v in sd.items()}
    dcp.load(got, storage_reader=rt.StorageReader(p), no_dist=True)
    assert_all_same(got, want)
    # the other keys stay readable when only they are asked for
    only = {"w": torch.empty(3, 2)}
    dcp.load(only, storage_reader=rt.StorageReader(p), planner=DefaultLoadPlanner(allow_partial_load=True),
             no_dist=True)
    assert same(only["w"], want["w"])


@pytest.mark.parametrize("name", list(DTYPES))
def test_convert_round_trips(tmp_path, name):
    src, sd = save("dcp", name, tmp_path)
    want = torch_loads(src, sd)

    reshard.convert(src, tmp_path / "out.pt", world_size=1)
    assert_all_same(torch.load(tmp_path / "out.pt", weights_only=True), want)

    for world in (1, 3):
        out = tmp_path / f"out{world}.dcp"
        reshard.convert(src, out, world_size=world, format="dcp")
        assert_all_same(torch_loads(out, sd), want)
        # and back through .pt
        back = tmp_path / f"back{world}.pt"
        reshard.convert(out, back, world_size=1)
        assert_all_same(torch.load(back, weights_only=True), want)

    st = tmp_path / "out.safetensors"
    if name not in ST_DTYPE:
        # safetensors has no fp4 type: refused at plan time, naming the tensor; the rest converts
        with pytest.raises(reshard.ReshardError, match=r"`x`.*F4_E2M1FN_X2.*no safetensors counterpart"):
            reshard.convert(src, st, world_size=1)
        assert not st.exists()
        reshard.convert(src, st, world_size=1, exclude=["x"])
        assert_all_same(load_file(str(st)), {"w": want["w"], "ids": want["ids"]})
        return
    reshard.convert(src, st, world_size=1)
    got = load_file(str(st))
    dt, pairs = ST_DTYPE[name]
    assert got["x"].dtype == dt
    assert same(got["x"], torch.view_as_real(want["x"]) if pairs else want["x"])
    assert same(got["w"], want["w"]) and same(got["ids"], want["ids"])
    # reshard reads back what it wrote, as safetensors has it
    assert same(reshard.open(st).get_tensor("x"), got["x"])


def test_safetensors_written_by_safetensors_are_read(tmp_path):
    from safetensors.torch import save_file

    sd = {n: value(n, seed=i) for i, n in enumerate(ST_DTYPE) if not ST_DTYPE[n][1]}
    sd["w"] = torch.randn(2, 2)
    save_file(sd, str(tmp_path / "m.safetensors"))
    ck = reshard.open(tmp_path / "m.safetensors")
    assert {t.name: t.dtype for t in ck.tensors()} == {**{n: DTYPES[n] for n in sd if n != "w"}, "w": "F32"}
    assert_all_same({k: ck.get_tensor(k) for k in sd}, sd)


def job_save_sharded(rank, world, path, names):
    """Save each dtype's tensor as a DTensor sharded on dim 0 over the ranks (gloo), with an
    ordinary sharded f32 weight beside them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    full = {n: value(n, seed=7) for n in names}
    full["w"] = torch.arange(24, dtype=torch.float32).reshape(SHAPE)
    # distribute_tensor would scatter, which gloo cannot do for every dtype: each rank cuts
    # its own shard of the same full tensor
    sd = {
        k: DTensor.from_local(t.chunk(world, 0)[rank].clone(), mesh, [Shard(0)], run_check=False,
                              shape=t.shape, stride=t.stride())
        for k, t in full.items()
    }
    dcp.save(sd, checkpoint_id=path)
    return True


def test_resharding_a_tensor_sharded_over_two_ranks(tmp_path):
    names = list(DTYPES)
    src = tmp_path / "sharded"
    assert _dist.run(2, job_save_sharded, str(src), names, timeout=180) == [True, True]
    full = {n: value(n, seed=7) for n in names}
    full["w"] = torch.arange(24, dtype=torch.float32).reshape(SHAPE)
    # torch's own reader, the oracle, assembles the full tensors from the two ranks' shards
    assert_all_same(torch_loads(src, full), full)

    ck = reshard.open(src)
    assert ck.world_size == 2
    assert {t.name: t.dtype for t in ck.tensors()} == {**DTYPES, "w": "F32"}
    assert_all_same({k: ck.get_tensor(k) for k in full}, full)
    for world in (1, 3):
        out = tmp_path / f"w{world}"
        reshard.convert(src, out, world_size=world, format="dcp")
        assert_all_same(torch_loads(out, full), full)
    reshard.convert(src, tmp_path / "one.pt", world_size=1)
    assert_all_same(torch.load(tmp_path / "one.pt", weights_only=True), full)


def test_casts_to_or_from_them_are_refused_the_rest_cast(tmp_path):
    src, sd = save("dcp", "complex64", tmp_path)
    # --dtype casts the floating tensors only: complex, like ints, is kept as it is
    out = tmp_path / "bf16.pt"
    reshard.convert(src, out, world_size=1, dtype="bf16")
    got = torch.load(out, weights_only=True)
    assert same(got["w"], sd["w"].to(torch.bfloat16))
    assert same(got["x"], sd["x"]) and same(got["ids"], sd["ids"])
    # reading the others cast works, with the complex tensor beside them
    ck = reshard.open(src)
    assert same(ck.get_tensor("w", dtype=torch.float64), sd["w"].to(torch.float64))
    # a cast asked of the complex tensor is refused, naming it and both dtypes
    with pytest.raises(reshard.ReshardError, match=r"`x`.*C64 to F32"):
        ck.get_tensor("x", dtype=torch.float32)
    with pytest.raises(reshard.ReshardError, match=r"`x`.*C64 to BF16"):
        rt.load({"x": torch.empty(SHAPE, dtype=torch.bfloat16)}, src, strict=False)
    with pytest.raises(reshard.ReshardError, match=r"`w`.*F32 to C64"):
        rt.load({"w": torch.empty(3, 2, dtype=torch.complex64)}, src, strict=False)
    # and no cast targets one of these dtypes
    with pytest.raises(reshard.RequestError, match=r"^cannot cast to C64: only floating dtypes"):
        reshard.convert(src, tmp_path / "c.pt", world_size=1, dtype="complex64")
    r = subprocess.run([sys.executable, "-m", "reshard._cli", "convert", str(src), str(tmp_path / "c2.pt"),
                        "--to", "1", "--dtype", "float8_e8m0fnu"], capture_output=True, text=True)
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot cast to F8_E8M0: only floating dtypes" in lines[0], r.stderr
