#!/usr/bin/env python3
"""Generate torch.save (`.pt`, zip format) fixtures and their oracles for reshard's `.pt` reader.

Every case is written by `torch.save` itself under <out>/<case>/:

  model.pt              exactly what torch.save wrote
  oracle.safetensors    every tensor of torch.load(model.pt, weights_only=True), flattened with
                        torch DCP's own flatten_state_dict, keyed by the flat key, contiguous
  nontensor.json        the flattened non-tensor values, JSON-ified as reshard's
                        `dcp::to_json` renders them (tuples -> lists, None -> null, dtypes
                        `torch.float32`, bytes "<bytes: N>")

and damaged or unsupported files under <out>/bad/ (legacy format, bare tensor, tensor in a
tuple, missing storage record, storage record shorter than its tensor).

Usage (with the project venv, which has torch):
  .venv/bin/python scripts/gen_pt_fixtures.py [--out tests/fixtures/pt]
  .venv/bin/python scripts/gen_pt_fixtures.py compare A.pt B.pt
      torch.load both (weights_only=True) and require the same nested structure: the same
      keys (compared as str(key): flattening, like DCP's, names dict keys by str()), the same
      list/tuple lengths, tensors equal in dtype, shape and bytes, other values equal.
Outputs are deterministic (fixed seed; torch.save of the same objects is byte-stable).
"""
from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
SEED = 20240601


# ------------------------------------------------------------------------------- oracles


def jsonify(v):
    """A non-tensor value as reshard's dcp::to_json renders it."""
    if isinstance(v, torch.dtype):
        return str(v)
    if isinstance(v, (list, tuple, set, frozenset)):
        return [jsonify(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonify(x) for k, x in v.items()}
    if isinstance(v, (bytes, bytearray)):
        return f"<bytes: {len(v)}>"
    if isinstance(v, torch.device):
        return str(v)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise TypeError(f"no JSON rendering for {type(v)}")


def flatten(sd):
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(sd)
    return flat


def write_case(out: Path, name: str, obj, check=None):
    d = out / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    torch.save(obj, d / "model.pt")
    loaded = torch.load(d / "model.pt", weights_only=True)
    flat = flatten(loaded)
    tensors, other = {}, {}
    for k, v in flat.items():
        if isinstance(v, torch.Tensor):
            tensors[k] = v.detach().clone().contiguous()
        else:
            other[k] = jsonify(v)
    from safetensors.torch import save_file

    save_file({k: tensors[k] for k in sorted(tensors)}, str(d / "oracle.safetensors"))
    (d / "nontensor.json").write_text(json.dumps(other, indent=1, sort_keys=True) + "\n")
    if check is not None:
        check(d / "model.pt")
    size = sum(f.stat().st_size for f in d.iterdir())
    print(f"{name}: {len(tensors)} tensors, {len(other)} non-tensor values, {size} bytes")


def data_records(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as z:
        return [n for n in z.namelist() if "/data/" in n]


# ------------------------------------------------------------------------------- cases


class Dtypes(nn.Module):
    """Parameters and buffers of many dtypes, prime dims, a 0-d and a zero-size tensor."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(7, 5)  # f32 (5,7) + (5,)
        self.proj = nn.Parameter(torch.randn(3, 13).to(torch.bfloat16))
        self.register_buffer("halves", torch.randn(11).to(torch.float16))
        self.register_buffer("ids", torch.randint(-(2**40), 2**40, (3, 7), dtype=torch.int64))
        self.register_buffer("counts", torch.randint(-1000, 1000, (13,), dtype=torch.int32))
        self.register_buffer("codes", torch.randint(0, 256, (2, 3, 5), dtype=torch.uint8))
        self.register_buffer("mask", torch.rand(17) > 0.5)
        self.register_buffer("scale", torch.tensor(0.125))  # 0-d
        self.register_buffer("empty", torch.zeros(0, 3))  # zero-size
        self.register_buffer("wide", torch.randn(2, 3).to(torch.float64))  # f64


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.fc2 = nn.Linear(7, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.norm = nn.LayerNorm(6)
        self.lm_head = nn.Linear(6, 11, bias=False)
        self.lm_head.weight = self.embed.weight  # one Parameter, two keys


def case_flat(out: Path):
    torch.manual_seed(SEED)
    write_case(out, "flat_dtypes", Dtypes().state_dict())


def case_training(out: Path):
    torch.manual_seed(SEED + 1)
    m = Mlp()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.999))
    loss = m(torch.randn(4, 5)).square().mean()
    loss.backward()
    opt.step()
    ckpt = {
        "model": m.state_dict(),
        "optimizer": opt.state_dict(),
        "step": 7,
        "epoch": 1.5,
        "name": "run-a",
        "hparams": {"lr": 1e-3, "betas": (0.9, 0.999)},
    }
    write_case(out, "training", ckpt)


def case_tied(out: Path):
    torch.manual_seed(SEED + 2)

    def one_storage(p: Path):
        recs = data_records(p)
        assert len(recs) == 3, recs  # embed/lm_head share one; norm weight and bias

    write_case(out, "tied", Tied().state_dict(), one_storage)


def case_views(out: Path):
    torch.manual_seed(SEED + 3)
    base = torch.randn(6, 10)
    flat = torch.arange(40, dtype=torch.int32)
    ckpt = {
        "base": base,
        "transposed": base.t(),  # (10, 6), strides (1, 10)
        "row": base[4],  # storage offset 40
        "cols": base[1:5, 3::2],  # offset 13, strides (10, 2)
        "slice": flat[7:19].view(3, 4),  # offset 7, contiguous
        "expanded": torch.randn(1, 5).expand(3, 5),  # stride 0 along dim 0
        "lone": torch.randn(9, 4)[2:7].t(),  # a view of a storage nothing else saves
    }

    def shares(p: Path):
        recs = data_records(p)
        assert len(recs) == 4, recs

    write_case(out, "views", ckpt, shares)


def case_ordered(out: Path):
    torch.manual_seed(SEED + 4)
    m = Mlp()
    ckpt = OrderedDict(
        [
            ("model", m.state_dict()),  # an OrderedDict (with a `_metadata` attribute)
            ("buffers", OrderedDict([("zeta", torch.randn(2)), ("alpha", torch.ones(3).long())])),
            ("layers", [torch.randn(2, 2), {"w": torch.randn(3), "tag": "l1"}, 5]),
            ("by_id", {0: torch.randn(2), 3: {"inner": torch.randn(1)}}),
            ("numbers", [1, 2, 3]),  # terminal list: one value
            ("empty_list", []),
            ("nested_lists", [[1, 2], [3]]),
            ("none", None),
            ("flag", True),
            ("dtype", torch.bfloat16),
            ("shape", torch.Size([2, 3])),
            ("blob", b"\x00\x01\x02"),
            ("pair", ("a", 1, 2.5)),
            ("dotted.key", torch.arange(4, dtype=torch.int16)),
            ("param", nn.Parameter(torch.randn(2, 3))),  # _rebuild_parameter
        ]
    )
    write_case(out, "ordered", ckpt)


# ------------------------------------------------------------------------------- bad inputs


def rewrite_zip(src: Path, dst: Path, edit):
    """Copy the stored zip `src` to `dst`, record by record, through `edit(name, data)`,
    which returns the new data or None to drop the record."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = edit(info.filename, zin.read(info.filename))
            if data is not None:
                zi = zipfile.ZipInfo(info.filename, date_time=(1980, 1, 1, 0, 0, 0))
                zout.writestr(zi, data)


def write_legacy(path: Path, obj):
    """torch.save in the legacy (pre-1.6) format, made byte-stable: its storage keys are
    memory addresses, replaced here by digits of the same length."""
    import pickle

    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=False)
    raw = buf.getvalue()
    f = io.BytesIO(raw)
    for _ in range(3):  # magic number, protocol version, sys info
        pickle.load(f)
    keys = []

    class Keys(pickle.Unpickler):
        def persistent_load(self, pid):
            keys.append(pid[2])

        def find_class(self, module, name):
            return lambda *a, **k: None

    Keys(f).load()
    for i, k in enumerate(sorted(set(keys))):
        raw = raw.replace(k.encode(), str(i + 1).rjust(len(k), "0").encode())
    path.write_bytes(raw)
    back = torch.load(path, weights_only=True)
    assert all(torch.equal(back[k], v) for k, v in obj.items())


def bad_cases(out: Path):
    d = out / "bad"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    torch.manual_seed(SEED + 5)
    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    write_legacy(d / "legacy.pt", {"w": t})
    torch.save(t, d / "bare_tensor.pt")
    torch.save({"a": {"pair": (t, 1)}}, d / "tensor_in_tuple.pt")
    torch.save([t], d / "top_list.pt")
    good = d / "good.tmp"
    torch.save({"w": t}, good)
    rewrite_zip(good, d / "missing_record.pt", lambda n, b: None if n.endswith("/data/0") else b)
    rewrite_zip(good, d / "short_record.pt", lambda n, b: b[:20] if n.endswith("/data/0") else b)
    good.unlink()
    for f in sorted(d.iterdir()):
        print(f"bad/{f.name}: {f.stat().st_size} bytes")


# ------------------------------------------------------------------------------- compare


def same(a, b, path="", loose_keys=False) -> list[str]:
    """Differences between two loaded state dicts. Dict keys must be equal with their types
    (an int key is not the str of it), unless `loose_keys` (DCP names keys by str())."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"]
        ab = a.contiguous().reshape(-1).view(torch.uint8) if a.numel() else a
        bb = b.contiguous().reshape(-1).view(torch.uint8) if b.numel() else b
        return [] if torch.equal(ab, bb) else [f"{path}: tensor values differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        norm = (lambda k: str(k)) if loose_keys else (lambda k: (type(k).__name__, k))
        ka = {norm(k): v for k, v in a.items()}
        kb = {norm(k): v for k, v in b.items()}
        if set(ka) != set(kb):
            return [f"{path}: keys {sorted(map(str, ka))} vs {sorted(map(str, kb))}"]
        return [d for k in ka
                for d in same(ka[k], kb[k], f"{path}.{k}" if path else str(k), loose_keys)]
    for kind in (list, tuple):
        if isinstance(a, kind) or isinstance(b, kind):
            if not (isinstance(a, kind) and isinstance(b, kind)) or len(a) != len(b):
                return [f"{path}: {a!r} vs {b!r}"]
            return [d for i, (x, y) in enumerate(zip(a, b))
                    for d in same(x, y, f"{path}.{i}", loose_keys)]
    if type(a) is not type(b) or a != b:
        return [f"{path}: {a!r} vs {b!r}"]
    return []


def compare(a: str, b: str, loose_keys: bool = False) -> int:
    x = torch.load(a, weights_only=True)
    y = torch.load(b, weights_only=True)
    diffs = same(x, y, loose_keys=loose_keys)
    for d in diffs[:20]:
        print(d, file=sys.stderr)
    return 1 if diffs else 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "compare":
        p = argparse.ArgumentParser(prog="gen_pt_fixtures.py compare")
        p.add_argument("a")
        p.add_argument("b")
        p.add_argument("--loose-keys", action="store_true",
                       help="compare dict keys as str() (after a trip through DCP)")
        args = p.parse_args(sys.argv[2:])
        return compare(args.a, args.b, args.loose_keys)
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=str(REPO / "tests/fixtures/pt"))
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    case_flat(out)
    case_training(out)
    case_tied(out)
    case_views(out)
    case_ordered(out)
    bad_cases(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
