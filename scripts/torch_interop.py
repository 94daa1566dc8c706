#!/usr/bin/env python3
"""Let real torch judge reshard's outputs (used by the Rust integration tests).

Subcommands (exit 0 = accepted and equal; exit 1 with a one-line reason on stderr otherwise;
exit 2 = usage error, exit 3 = this torch lacks the needed API):

  hf-storage-load DIR EXPECTED.safetensors
      DIR is a HuggingFace-storage DCP checkpoint (shard-*.safetensors with DCP_SHARDING_INFO,
      as HuggingFaceStorageWriter(save_distributed=True) writes it). It is read with torch's own
      reader, dcp.load(sd, storage_reader=HuggingFaceStorageReader(DIR), no_dist=True), into
      tensors with EXPECTED's names/shapes/dtypes (twice, pre-filled with two different byte
      patterns, so any element the checkpoint does not cover is caught), and every tensor's bytes
      are compared with EXPECTED. Torch's metadata (names, dtypes, global shapes, chunk tiling)
      must match too. Then torch's consolidate_safetensors_files (if this torch has it) must
      reproduce EXPECTED, except for tensors hit by known torch bugs (0-d tensors are written as
      zeros; non-float dtypes crash in torch.finfo): those are skipped with a note on stderr.
  safetensors-equal A B
      both load with safetensors.torch.load_file; same names, dtypes, shapes and bytes.
  hf-load DIR EXPECTED.safetensors
      DIR is a Hugging Face sharded checkpoint (model.safetensors.index.json + files): every file
      loads with safetensors, the index's weight_map points every tensor at the file that holds it
      (and only at existing tensors), metadata.total_size equals the sum of tensor bytes, no
      tensor is in two files, no .safetensors file is left out, and the union equals EXPECTED.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path


class Fail(Exception):
    """Rejected: the message is the one-line reason."""


class Unsupported(Exception):
    pass


def note(msg: str):
    print(f"torch_interop: {msg}", file=sys.stderr)


def _bytes(t) -> bytes:
    import torch
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes()


def _load(path) -> dict:
    from safetensors.torch import load_file
    p = Path(path)
    if not p.is_file():
        raise Fail(f"{p}: no such file")
    try:
        return load_file(str(p))
    except Exception as e:  # noqa: BLE001
        raise Fail(f"{p}: safetensors cannot load it: {type(e).__name__}: {e}") from None


def _summarise(errors: list[str], what: str) -> str:
    head = "; ".join(errors[:4])
    more = f" (+{len(errors) - 4} more)" if len(errors) > 4 else ""
    return f"{what}: {len(errors)} problem(s): {head}{more}"


def compare_dicts(got: dict, want: dict, what: str, skip: set | None = None):
    skip = skip or set()
    errors = []
    gk, wk = set(got) - skip, set(want) - skip
    if gk != wk:
        if wk - gk:
            errors.append(f"missing {sorted(wk - gk)[:5]}")
        if gk - wk:
            errors.append(f"unexpected {sorted(gk - wk)[:5]}")
    for k in sorted(gk & wk):
        g, w = got[k], want[k]
        if g.dtype != w.dtype:
            errors.append(f"{k}: dtype {g.dtype} != expected {w.dtype}")
        elif tuple(g.shape) != tuple(w.shape):
            errors.append(f"{k}: shape {tuple(g.shape)} != expected {tuple(w.shape)}")
        elif _bytes(g) != _bytes(w):
            errors.append(f"{k}: bytes differ")
    if errors:
        raise Fail(_summarise(errors, what))
    return len(gk & wk)


# --------------------------------------------------------------------------------- hf-storage

def _hf_reader_class():
    try:
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
        return HuggingFaceStorageReader
    except ImportError:
        pass
    try:  # torch 2.7/2.8 naming
        from torch.distributed.checkpoint._hf_storage import _HuggingFaceStorageReader
        return _HuggingFaceStorageReader
    except ImportError:
        raise Unsupported("this torch has no HuggingFaceStorageReader") from None


def _check_hf_storage_files(d: Path):
    """Every .safetensors file must carry DCP_SHARDING_INFO with an entry per tensor
    (torch's consolidation needs it; without it torch's reader silently assumes offset 0)."""
    import struct
    files = sorted(p for p in d.iterdir() if p.name.endswith(".safetensors"))
    if not files:
        raise Fail(f"{d}: no .safetensors files")
    for p in files:
        with open(p, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        meta = header.get("__metadata__") or {}
        if "DCP_SHARDING_INFO" not in meta:
            raise Fail(f"{p.name}: no DCP_SHARDING_INFO in __metadata__")
        info = json.loads(meta["DCP_SHARDING_INFO"])
        for k, v in header.items():
            if k == "__metadata__":
                continue
            if k not in info or "saved_offsets" not in info[k]:
                raise Fail(f"{p.name}: tensor {k} has no DCP_SHARDING_INFO saved_offsets")
            if len(info[k]["saved_offsets"]) != len(v["shape"]):
                raise Fail(f"{p.name}: tensor {k} saved_offsets rank {len(info[k]['saved_offsets'])} "
                           f"!= shape rank {len(v['shape'])}")
    return files


def check_hf_storage_dcp_load(d, expected_path) -> int:
    import torch
    import torch.distributed.checkpoint as dcp
    d, expected = Path(d), _load(expected_path)
    if not d.is_dir():
        raise Fail(f"{d}: not a directory")
    _check_hf_storage_files(d)
    Reader = _hf_reader_class()

    # 1. torch's view of the checkpoint: names, dtypes, global shapes, chunk tiling
    try:
        md = Reader(str(d)).read_metadata()
    except Exception as e:  # noqa: BLE001
        raise Fail(f"torch HuggingFaceStorageReader.read_metadata failed: {type(e).__name__}: {e}") from None
    errors = []
    sdm = md.state_dict_metadata
    if set(sdm) != set(expected):
        if set(expected) - set(sdm):
            errors.append(f"missing in checkpoint {sorted(set(expected) - set(sdm))[:5]}")
        if set(sdm) - set(expected):
            errors.append(f"unexpected in checkpoint {sorted(set(sdm) - set(expected))[:5]}")
    for k in sorted(set(sdm) & set(expected)):
        m, w = sdm[k], expected[k]
        if m.properties.dtype != w.dtype:
            errors.append(f"{k}: dtype {m.properties.dtype} != expected {w.dtype}")
        if tuple(m.size) != tuple(w.shape):
            errors.append(f"{k}: global shape {tuple(m.size)} != expected {tuple(w.shape)}")
            continue
        vol = 0
        for c in m.chunks:
            if any(o < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, m.size)):
                errors.append(f"{k}: chunk offsets {tuple(c.offsets)} sizes {tuple(c.sizes)} outside {tuple(m.size)}")
            n = 1
            for s in c.sizes:
                n *= s
            vol += n
        if vol != w.numel():
            errors.append(f"{k}: chunks hold {vol} elements, tensor has {w.numel()} (gap or overlap)")
    if errors:
        raise Fail(_summarise(errors, "HF storage metadata"))

    # 2. dcp.load twice, pre-filled with different patterns: uncovered elements would show
    for fill in (0x00, 0xA5):
        sd = {}
        for k, w in expected.items():
            t = torch.empty(w.shape, dtype=w.dtype)
            t.reshape(-1).view(torch.uint8).fill_(fill) if t.numel() else None
            sd[k] = t
        try:
            dcp.load(sd, storage_reader=Reader(str(d)), no_dist=True)
        except Exception as e:  # noqa: BLE001
            msg = str(e).strip().splitlines()
            raise Fail(f"torch dcp.load(HuggingFaceStorageReader) failed: {type(e).__name__}: "
                       f"{msg[-1] if msg else ''}") from None
        n = compare_dicts(sd, expected, f"dcp.load(HuggingFaceStorageReader) vs expected (fill 0x{fill:02X})")
    return n


def check_hf_storage_consolidate(d, expected_path, workdir=None) -> list[str]:
    """torch's own consolidation; returns the skipped tensor names (known torch bugs)."""
    try:
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files
    except ImportError:
        note("this torch has no _consolidate_hf_safetensors; consolidation check skipped")
        return []
    expected = _load(expected_path)
    skipped = sorted(k for k, v in expected.items() if v.dim() == 0 or not v.is_floating_point())
    for k in skipped:
        why = "0-d tensor (torch writes zeros)" if expected[k].dim() == 0 else f"{expected[k].dtype} (torch.finfo crash)"
        note(f"consolidate_safetensors_files: skipping {k}: known torch bug: {why}")
    mapping = {k: 1 for k in expected if k not in skipped}
    if not mapping:
        return skipped
    own = workdir is None
    out = Path(tempfile.mkdtemp(prefix="torch_interop.")) if own else Path(workdir)
    out.mkdir(parents=True, exist_ok=True)
    try:
        try:
            consolidate_safetensors_files(input_dir=str(d), output_dir=str(out), fqn_to_index_mapping=mapping)
        except Exception as e:  # noqa: BLE001
            raise Fail(f"torch consolidate_safetensors_files failed: {type(e).__name__}: {e}") from None
        files = sorted(out.glob("*.safetensors"))
        if len(files) != 1:
            raise Fail(f"torch consolidation wrote {len(files)} files, expected 1")
        got = _load(files[0])
        want = {k: v for k, v in expected.items() if k in mapping}
        compare_dicts(got, want, "torch consolidate_safetensors_files vs expected")
    finally:
        if own:
            import shutil
            shutil.rmtree(out, ignore_errors=True)
    return skipped


def cmd_hf_storage_load(d, expected):
    n = check_hf_storage_dcp_load(d, expected)
    skipped = check_hf_storage_consolidate(d, expected)
    return f"{n} tensors equal via torch dcp.load(HuggingFaceStorageReader)" + (
        f"; consolidation equal ({len(skipped)} skipped: known torch bugs)" if skipped else "; consolidation equal")


# --------------------------------------------------------------------------------- others

def cmd_safetensors_equal(a, b):
    n = compare_dicts(_load(b), _load(a), f"{b} vs {a}")
    return f"{n} tensors equal"


def cmd_hf_load(d, expected_path):
    d = Path(d)
    idx_path = d / "model.safetensors.index.json"
    if not idx_path.is_file():
        raise Fail(f"{idx_path}: missing")
    try:
        idx = json.loads(idx_path.read_text())
    except Exception as e:  # noqa: BLE001
        raise Fail(f"{idx_path}: not JSON: {e}") from None
    wm = idx.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        raise Fail(f"{idx_path}: no weight_map")
    total = (idx.get("metadata") or {}).get("total_size")
    if not isinstance(total, int):
        raise Fail(f"{idx_path}: metadata.total_size missing or not an integer")
    errors = []
    files = sorted(set(wm.values()))
    for f in files:
        if "/" in f or f in (".", ".."):
            errors.append(f"weight_map file {f!r} is not a plain file name")
    if errors:
        raise Fail(_summarise(errors, "index"))
    on_disk = sorted(p.name for p in d.glob("*.safetensors"))
    extra = sorted(set(on_disk) - set(files))
    if extra:
        errors.append(f"files not referenced by weight_map: {extra[:5]}")
    got, nbytes = {}, 0
    for f in files:
        tensors = _load(d / f)
        for k, t in tensors.items():
            if k in got:
                errors.append(f"{k} stored in two files")
            got[k] = t
            nbytes += t.numel() * t.element_size()
            if wm.get(k) != f:
                errors.append(f"{k} is in {f} but weight_map says {wm.get(k)!r}")
        for k, v in wm.items():
            if v == f and k not in tensors:
                errors.append(f"weight_map puts {k} in {f}, which does not hold it")
    if nbytes != total:
        errors.append(f"metadata.total_size {total} != sum of tensor bytes {nbytes}")
    if errors:
        raise Fail(_summarise(errors, "HF sharded checkpoint"))
    n = compare_dicts(got, _load(expected_path), "HF checkpoint vs expected")
    return f"{n} tensors in {len(files)} files equal; index consistent"


COMMANDS = {
    "hf-storage-load": (cmd_hf_storage_load, 2),
    "safetensors-equal": (cmd_safetensors_equal, 2),
    "hf-load": (cmd_hf_load, 2),
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    fn, nargs = COMMANDS[argv[0]]
    if len(argv) - 1 != nargs:
        print(f"torch_interop: {argv[0]} takes {nargs} arguments", file=sys.stderr)
        return 2
    try:
        msg = fn(*argv[1:])
    except Fail as e:
        print(f"FAIL {argv[0]}: {str(e).splitlines()[0] if str(e) else 'rejected'}", file=sys.stderr)
        return 1
    except Unsupported as e:
        print(f"UNSUPPORTED {argv[0]}: {e}", file=sys.stderr)
        return 3
    print(f"OK {argv[0]}: {msg}")
    return 0


if __name__ == "__main__":
    import warnings
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
