"""reshard.open and the Checkpoint API, convert/verify/diff, errors and the `reshard` command,
against torch's own consolidated results (the fixtures' oracles)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures"


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN-safe)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def oracle(case: str):
    return load_file(str(FIX / case / "oracle" / "full.safetensors"))


DCP_CASES = ["fsdp2_w4_f32", "fsdp2_w3_bf16", "fsdp1_w4_f32", "dtensor2d_w4", "fabric_fsdp1_w4_f32_torch21", "torch21_shardedtensor_w3"]


@pytest.mark.parametrize("case", DCP_CASES + ["hf_storage_w3_bf16"])
def test_every_tensor_equals_torchs_consolidation(case):
    want = oracle(case)
    with reshard.open(FIX / case / "checkpoint") as ck:
        assert ck.world_size > 1
        names = [t.name for t in ck.tensors()]
        assert sorted(names) == sorted(want)
        for t in ck.tensors():
            got = ck.get_tensor(t.name)
            assert same(got, want[t.name]), t.name
            assert t.shape == tuple(want[t.name].shape)


def test_metadata_of_a_dcp_checkpoint():
    ck = reshard.open(FIX / "fsdp2_w4_f32" / "checkpoint")
    assert ck.format == "dcp" and ck.world_size == 4
    assert len(ck.files) >= 4 and all(os.path.exists(f) for f in ck.files)
    info = ck.info("model.embed.weight")
    assert info.dtype == "F32" and info.shape == (10, 12)
    assert "4 chunks" in info.layout
    assert "model.embed.weight" in ck and "nope" not in ck
    assert set(ck.keys()) >= set(ck) | set(ck.values())
    assert repr(ck).startswith("<reshard.Checkpoint dcp")


def test_values_equal_what_dcp_stored():
    want = json.loads((FIX / "fsdp2_w4_f32" / "oracle" / "nontensor.json").read_text())
    values = reshard.open(FIX / "fsdp2_w4_f32" / "checkpoint").values()
    assert set(values) == set(want)
    for k, v in want.items():
        got = values[k]
        # the oracle is JSON-ified: tuples became lists
        assert json.loads(json.dumps(got)) == v, k
    assert isinstance(values["optimizer.param_groups.0.betas"], tuple)


def test_values_of_a_lightning_meta_pt():
    ck = reshard.open(FIX / "fabric_fsdp1_w4_f32" / "checkpoint")
    meta = torch.load(FIX / "fabric_fsdp1_w4_f32" / "checkpoint" / "meta.pt", weights_only=True)
    values = ck.values()
    for k, v in meta.items():
        assert values[k] == v, k


def test_slices_read_only_their_region():
    want = oracle("fsdp2_w4_f32")["model.blocks.0.qkv.weight"]
    s = reshard.open(FIX / "fsdp2_w4_f32" / "checkpoint").get_slice("model.blocks.0.qkv.weight")
    assert s.get_shape() == [36, 12] and s.dtype == "F32"
    for ix in [
        (slice(3, 20), slice(None)),
        (slice(None), slice(2, 7)),
        (5,),
        (-1, slice(1, None, 3)),
        (Ellipsis, 4),
        (slice(30, 100),),
        (slice(7, 7),),
        (slice(None, None, 5), Ellipsis),
    ]:
        got = s[ix]
        assert same(got, want[ix].contiguous()), ix
    with pytest.raises(reshard.RequestError, match="out of range"):
        s[36]
    with pytest.raises(reshard.RequestError, match="indices"):
        s[1, 2, 3]


def test_numpy_framework_and_casts():
    np = pytest.importorskip("numpy")
    want = oracle("fsdp2_w4_f32")["model.embed.weight"]
    ck = reshard.open(FIX / "fsdp2_w4_f32" / "checkpoint", framework="numpy")
    a = ck.get_tensor("model.embed.weight")
    assert isinstance(a, np.ndarray) and a.dtype == np.float32
    assert np.array_equal(a, want.numpy())
    b = ck.get_tensor("model.embed.weight", dtype="f64")
    assert b.dtype == np.float64 and np.array_equal(b, want.double().numpy())
    with pytest.raises(reshard.RequestError, match="no numpy dtype"):
        ck.get_tensor("model.embed.weight", dtype="bf16")
    t = reshard.open(FIX / "fsdp2_w4_f32" / "checkpoint").get_tensor("model.embed.weight", dtype=torch.bfloat16)
    assert same(t, want.to(torch.bfloat16))


@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_local_shards_of_every_rank_tile_the_tensors(m):
    want = oracle("fsdp2_w4_f32")
    ck = reshard.open(FIX / "fsdp2_w4_f32" / "checkpoint")
    rebuilt = {n: torch.full_like(t, 0) if t.dtype != torch.bool else torch.zeros_like(t) for n, t in want.items()}
    covered = {n: 0 for n in want}
    for r in range(m):
        for s in ck.local_shards(r, m):
            idx = tuple(slice(o, o + n) for o, n in zip(s.offsets, s.tensor.shape))
            assert same(s.tensor, want[s.name][idx].contiguous()), (s.name, r)
            covered[s.name] += s.tensor.numel()
    for n, t in want.items():
        # replicated 0-d / small tensors are held by every rank under Shard(0)
        assert covered[n] >= t.numel(), n


def test_local_shards_under_a_layout():
    ck = reshard.open(FIX / "fsdp2_w4_f32" / "checkpoint")
    layout = {"mesh": [2, 2], "rules": [{"match": "model.*.weight", "placements": ["Shard(0)", "Shard(1)"]}]}
    want = oracle("fsdp2_w4_f32")["model.blocks.0.qkv.weight"]
    got = {s.offsets: s.tensor for s in ck.local_shards(3, 4, layout, include=["model.blocks.0.qkv.weight"])}
    assert list(got) == [(18, 6)]
    assert same(got[(18, 6)], want[18:36, 6:12].contiguous())
    with pytest.raises(reshard.RequestError, match="disagrees"):
        ck.local_shards(0, 3, layout)


def test_progress_true_without_tqdm_prints_on_stderr(tmp_path, monkeypatch, capfd):
    """``progress=True`` works without tqdm (an optional extra): a progress line on stderr."""
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    summary = reshard.convert(FIX / "fsdp2_w4_f32" / "checkpoint", tmp_path / "m.safetensors", world_size=1,
                              progress=True)
    err = capfd.readouterr().err
    assert summary["bytes"] > 0 and re.search(r"reshard: (\d+\.\d) MiB of \1 MiB \(100%\)\n$", err), err


def test_convert_verify_diff(tmp_path):
    src = FIX / "fsdp2_w4_f32" / "checkpoint"
    out = tmp_path / "model.safetensors"
    seen = []
    summary = reshard.convert(src, out, world_size=1, exclude=["optimizer.*"], progress=lambda d, t: seen.append((d, t)))
    assert summary["format"] == "safetensors" and summary["world_size"] == 1
    assert seen and seen[-1][0] == seen[-1][1] >= summary["bytes"] > 0
    got = load_file(str(out))
    want = oracle("fsdp2_w4_f32")
    assert set(got) == {n for n in want if not n.startswith("optimizer.")}
    assert all(same(got[n], want[n]) for n in got)
    assert reshard.verify(out)["ok"]
    d = reshard.diff(src, tmp_path / "model.safetensors")
    assert not d["equal"]  # the optimizer state is missing from the output
    two = tmp_path / "two"
    src2 = FIX / "fsdp2_w2_f32" / "checkpoint"
    reshard.convert(src2, two, world_size=2)
    assert reshard.diff(src2, two)["equal"]
    with pytest.raises(reshard.RequestError, match="overwrite=True"):
        reshard.convert(src2, two, world_size=2)
    with pytest.raises(reshard.RequestError, match='per_rank_state="drop"'):
        reshard.convert(src, two, world_size=3, overwrite=True)
    reshard.convert(src, two, world_size=3, overwrite=True, per_rank_state="drop")
    assert reshard.open(two).world_size == 3
    plan = reshard.convert(src, tmp_path / "never", world_size=8, dry_run=True, per_rank_state="drop")
    assert plan["format"] == "dcp" and not (tmp_path / "never").exists()


def test_verify_finds_damage(tmp_path):
    src = tmp_path / "ck"
    shutil.copytree(FIX / "fsdp2_w4_f32" / "checkpoint", src)
    reshard.convert(src, tmp_path / "m.safetensors", world_size=1)
    # a DCP checkpoint of torch >= 2.4 has no CRCs; the .pt writer records them in its zip
    pt = tmp_path / "m.pt"
    reshard.convert(src, pt, world_size=1)
    assert reshard.verify(pt)["ok"]
    data = bytearray(pt.read_bytes())
    big = max(reshard.open(pt).tensors(), key=lambda t: t.shape[0] if t.shape else 0)
    # flip one byte inside the largest tensor's bytes
    blob = reshard.open(pt).get_tensor(big.name).contiguous().view(torch.uint8).numpy().tobytes()
    at = bytes(data).find(blob)
    assert at > 0
    data[at + 1] ^= 0xFF
    pt.write_bytes(bytes(data))
    report = reshard.verify(pt)
    assert not report["ok"] and len(report["mismatches"]) == 1
    assert str(pt) in report["mismatches"][0]


def test_errors_are_one_line_and_typed(tmp_path):
    with pytest.raises(reshard.ReshardIOError) as e:
        reshard.open(tmp_path / "missing")
    assert str(tmp_path / "missing") in str(e.value) and "\n" not in str(e.value)
    ck = tmp_path / "ck"
    shutil.copytree(FIX / "fsdp2_w4_f32" / "checkpoint", ck)
    os.remove(ck / "__1_0.distcp")
    with pytest.raises(reshard.ReshardError) as e:
        reshard.open(ck)
    assert "__1_0.distcp" in str(e.value) and "\n" not in str(e.value)
    shutil.rmtree(ck)
    shutil.copytree(FIX / "fsdp2_w4_f32" / "checkpoint", ck)
    f = ck / "__2_0.distcp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(reshard.CheckpointError, match="__2_0.distcp.*truncated"):
        reshard.open(ck)
    ok = reshard.open(FIX / "fsdp2_w4_f32" / "checkpoint")
    with pytest.raises(reshard.RequestError, match="no tensor `nope`"):
        ok.get_tensor("nope")
    with pytest.raises(reshard.ReshardError, match="cannot convert"):
        ok.get_tensor("model.embed.weight", dtype=torch.int32)
    with pytest.raises(reshard.RequestError, match="unknown dtype"):
        ok.get_tensor("model.embed.weight", dtype="f7")
    with pytest.raises(reshard.RequestError, match="format"):
        reshard.open(FIX / "fsdp2_w4_f32" / "checkpoint", format="nope")
    assert issubclass(reshard.CheckpointError, reshard.ReshardError)
    assert issubclass(reshard.RequestError, reshard.ReshardError)


def test_every_format_opens(tmp_path):
    want = oracle("fsdp2_w2_f32")
    src = FIX / "fsdp2_w2_f32" / "checkpoint"
    outs = {
        "pt": tmp_path / "m.pt",
        "safetensors": tmp_path / "m.safetensors",
        "hf": tmp_path / "hf",
        "hf-storage": tmp_path / "hfs",
    }
    for fmt, out in outs.items():
        reshard.convert(src, out, world_size=1 if fmt != "hf-storage" else 3, format=fmt, per_rank_state="drop")
        ck = reshard.open(out)
        assert ck.format == fmt
        for t in ck.tensors():
            assert same(ck.get_tensor(t.name), want[t.name]), (fmt, t.name)


def test_the_reshard_command_is_installed():
    exe = shutil.which("reshard", path=str(Path(sys.executable).parent))
    assert exe, "pip install puts `reshard` next to the interpreter"
    out = subprocess.run([exe, "inspect", str(FIX / "fsdp2_w2_f32" / "checkpoint")], capture_output=True, text=True)
    assert out.returncode == 0 and "dcp checkpoint, 2 rank(s)" in out.stdout
    bad = subprocess.run([exe, "inspect", "/nonexistent"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("reshard: error: /nonexistent") and bad.stderr.count("\n") == 1
    v = subprocess.run([exe, "--version"], capture_output=True, text=True)
    assert v.returncode == 0 and reshard.__version__ in v.stdout


def test_a_safetensors_file_round_trip(tmp_path):
    t = {"a": torch.randn(7, 5), "b": torch.arange(10, dtype=torch.int64), "c": torch.randn(3).to(torch.bfloat16)}
    save_file(t, str(tmp_path / "x.safetensors"))
    ck = reshard.open(tmp_path / "x.safetensors")
    assert ck.format == "safetensors" and ck.world_size == 1
    for k, v in t.items():
        assert same(ck.get_tensor(k), v)
    assert same(ck.get_slice("a")[2:4], t["a"][2:4].contiguous())
