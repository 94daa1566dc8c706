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
  dcp-load --world M DIR EXPECTED.safetensors [--nontensor EXPECTED.json] [DIR2 EXPECTED2 [--nontensor J2] ...]
      DIR is a DCP checkpoint (.metadata + __R_0.distcp). M ranks are started once (gloo, CPU,
      127.0.0.1, torch.multiprocessing; fork on Linux, TORCH_INTEROP_START_METHOD=spawn for fresh
      interpreters) and load every DIR in turn with the real collective torch dcp.load at world M,
      into a NESTED state dict built from the checkpoint's own .metadata planner_data: DTensors on a
      1-D mesh of M ranks, Shard(0) (Replicate for 0-d; torch < 2.2 also replicates tensors with
      fewer rows than M, which it cannot shard), with EXPECTED's global shapes and dtypes, pre-filled
      with a byte no expected element consists of (elements dcp.load leaves unwritten are reported),
      plus placeholders for the non-tensor items. Then every tensor is gathered (full_tensor(); a
      byte-level gather for dtypes gloo cannot gather, e.g. float8/uint16) and compared with
      EXPECTED on rank 0 (keys, dtypes, shapes, bytes); non-tensor items are compared, JSON-ified,
      with --nontensor (which applies to the pair before it). One line per pair when several are
      given; exit 1 if any is rejected. TORCH_INTEROP_TIMEOUT (s, default 180) bounds each collective.
  dcp-to-torch-save DIR EXPECTED.safetensors [--nontensor EXPECTED.json]
      torch's own dcp_to_torch_save(DIR, tmp.pt), torch.load, then compared as pt-load does.
  pt-load FILE.pt EXPECTED.safetensors [--nontensor EXPECTED.json] [--flat]
      torch.load(FILE, weights_only=True), and again with mmap=True: each must be a dict; nested
      dicts/lists are flattened to '.'-joined keys (lists only when they hold tensors or dicts; a
      --nontensor key names a whole subtree, e.g. optimizer.param_groups) and tensors compared with
      EXPECTED (dtype, shape, bytes), the other leaves with the JSON. Extra or missing keys are
      errors (non-tensor leaves are only listed when no --nontensor is given). --flat: FILE must
      be a flat {name: tensor} dict (non-tensor values only where the JSON names them).

Non-tensor values are compared strictly after JSON-ifying them as scripts/gen_fixtures.py does
(tuples -> lists, None -> null): 1, 1.0 and true differ. A failure caused by a module this
environment lacks (e.g. zstandard for compressed checkpoints) is exit 3, not 1.
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
    except AttributeError as e:  # e.g. torch 2.1 has no torch.uint16
        raise Unsupported(f"{p}: this torch cannot hold its tensors: {e}") from None
    except Exception as e:  # noqa: BLE001
        raise Fail(f"{p}: safetensors cannot load it: {type(e).__name__}: {e}") from None


def _summarise(errors: list[str], what: str) -> str:
    head = "; ".join(errors[:4])
    more = f" (+{len(errors) - 4} more)" if len(errors) > 4 else ""
    return f"{what}: {len(errors)} problem(s): {head}{more}"


def compare_dicts(got: dict, want: dict, what: str, skip: set | None = None):
    skip = skip or set()
    got = {k: v for k, v in got.items() if k not in skip}
    want = {k: v for k, v in want.items() if k not in skip}
    errors = _tensor_errors(got, want)
    if errors:
        raise Fail(_summarise(errors, what))
    return len(set(got) & set(want))


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


# --------------------------------------------------------------------------------- shared: trees

class _Unfilled:
    """Placeholder for a non-tensor item: dcp.load must replace it."""

    def __repr__(self):
        return "<not filled by dcp.load>"


_UNFILLED = _Unfilled()


def jsonify(v):
    """A non-tensor value as JSON, the way the fixtures' oracles (``oracle/nontensor.json``,
    written by scripts/gen_fixtures.py) hold it: tuples as lists, keys as str, tensors and
    dtypes described, anything else by its repr."""
    if isinstance(v, (list, tuple)):
        return [jsonify(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonify(x) for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    try:
        import torch
        if isinstance(v, torch.Tensor):
            return {"__tensor__": str(v.dtype), "shape": list(v.shape)}
        if isinstance(v, torch.dtype):
            return str(v)
    except ImportError:
        pass
    return {"__repr__": repr(v)}


def _canon(v) -> str:
    # strict: 1 != 1.0 != true (Python's == would equate them)
    return json.dumps(v, sort_keys=True, allow_nan=True)


def _short(v, n=70) -> str:
    s = _canon(v)
    return s if len(s) <= n else s[: n - 3] + "..."


def _load_json(path):
    p = Path(path)
    if not p.is_file():
        raise Fail(f"{p}: no such file")
    try:
        v = json.loads(p.read_text())
    except Exception as e:  # noqa: BLE001
        raise Fail(f"{p}: not JSON: {e}") from None
    if not isinstance(v, dict):
        raise Fail(f"{p}: not a JSON object {{flat key: value}}")
    return v


def _exc_line(e) -> str:
    """One informative line for an exception (torch's are often multi-line)."""
    failures = getattr(e, "failures", None)  # dcp CheckpointException: {rank: (exc, trace)}
    if isinstance(failures, dict) and failures:
        rank = sorted(failures)[0]
        inner = failures[rank]
        inner = inner[0] if isinstance(inner, tuple) else inner
        return f"CheckpointException (ranks {sorted(failures)}), rank {rank}: {_exc_line(inner)}"
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    for ln in lines:  # torch.load(weights_only=True) buries the cause
        if "WeightsUnpickler error" in ln:
            return f"{type(e).__name__}: {ln}"
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:400]


def _tensor_errors(got: dict, want: dict, fills: dict | None = None) -> list[str]:
    errors = []
    if set(want) - set(got):
        errors.append(f"missing {sorted(set(want) - set(got))[:5]}")
    if set(got) - set(want):
        errors.append(f"unexpected {sorted(set(got) - set(want))[:5]}")
    for k in sorted(set(got) & set(want)):
        e = tensor_error(k, got[k], want[k], (fills or {}).get(k))
        if e:
            errors.append(e)
    return errors


def tensor_error(key: str, got, want, fill=None) -> str | None:
    """How tensor ``got`` differs from ``want`` (dtype, shape, then bytes), or None when they
    are equal byte for byte. ``fill``: the byte value unwritten elements would hold."""
    if got.dtype != want.dtype:
        return f"{key}: dtype {got.dtype} != expected {want.dtype}"
    if tuple(got.shape) != tuple(want.shape):
        return f"{key}: shape {tuple(got.shape)} != expected {tuple(want.shape)}"
    gb, wb = _bytes(got), _bytes(want)
    if gb != wb:
        return f"{key}: bytes differ ({_diff_detail(gb, wb, want.element_size(), fill)})"
    return None


def _diff_detail(gb: bytes, wb: bytes, es: int, fill) -> str:
    import numpy as np
    g = np.frombuffer(gb, dtype=np.uint8).reshape(-1, es)
    w = np.frombuffer(wb, dtype=np.uint8).reshape(-1, es)
    bad = (g != w).any(axis=1)
    msg = f"{int(bad.sum())} of {len(bad)} elements, first at flat index {int(np.argmax(bad))}"
    if fill is not None:
        unwritten = int((bad & (g == fill).all(axis=1)).sum())
        if unwritten:
            msg += f"; {unwritten} still hold the 0x{fill:02X} fill, i.e. were never written"
    return msg


def _nontensor_errors(got: dict, want: dict) -> list[str]:
    errors = []
    if set(want) - set(got):
        errors.append(f"missing non-tensor items {sorted(set(want) - set(got))[:5]}")
    if set(got) - set(want):
        errors.append(f"unexpected non-tensor items {sorted(set(got) - set(want))[:5]}")
    for k in sorted(set(got) & set(want)):
        if got[k] is _UNFILLED:
            errors.append(f"{k}: non-tensor item not filled by dcp.load")
            continue
        g = jsonify(got[k])
        if _canon(g) != _canon(want[k]):
            errors.append(f"{k}: {_short(g)} != expected {_short(want[k])}")
    return errors


def _descend_list(v) -> bool:
    """Lists/tuples are walked into only if they hold tensors or dicts (somewhere); a list of
    plain values is one leaf (as DCP treats it)."""
    import torch
    for x in v:
        if isinstance(x, (torch.Tensor, dict)):
            return True
        if isinstance(x, (list, tuple)) and _descend_list(x):
            return True
    return False


def flatten_tree(obj: dict, subtree_keys=()) -> tuple[dict, dict, list[str]]:
    """Nested dicts/lists -> ({'.'-joined key: tensor}, {key: other leaf or named subtree}, errors).
    A key in `subtree_keys` stops the descent: the whole subtree is one non-tensor value."""
    import torch
    tensors, others, errors = {}, {}, []
    subtree_keys = set(subtree_keys)

    def put(dst, key, v):
        if key in tensors or key in others:
            errors.append(f"{key}: two items flatten to this key")
        dst[key] = v

    def rec(parts, v):
        key = ".".join(parts)
        if key in subtree_keys:
            put(others, key, v)
        elif isinstance(v, torch.Tensor):
            put(tensors, key, v)
        elif isinstance(v, dict) and v:
            for k, x in v.items():
                rec(parts + [str(k)], x)
        elif isinstance(v, (list, tuple)) and _descend_list(v):
            for i, x in enumerate(v):
                rec(parts + [str(i)], x)
        else:
            put(others, key, v)

    for k, x in obj.items():
        rec([str(k)], x)
    return tensors, others, errors


def compare_tree(obj, expected: dict, nontensor: dict | None, what: str, flat: bool = False) -> str:
    """Compare a loaded object (must be a dict) with EXPECTED tensors and the non-tensor JSON."""
    import torch
    if not isinstance(obj, dict):
        raise Fail(f"{what}: top level is {type(obj).__name__}, not a dict")
    if flat:
        errors = []
        tensors, others = {}, {}
        for k, v in obj.items():
            if not isinstance(k, str):
                errors.append(f"key {k!r} is {type(k).__name__}, not str")
            elif isinstance(v, torch.Tensor):
                tensors[k] = v
            elif nontensor is not None and k in nontensor:
                others[k] = v
            else:
                kind = "nested " + type(v).__name__ if isinstance(v, (dict, list, tuple)) else type(v).__name__
                errors.append(f"{k!r} holds a {kind}, not a tensor (--flat)")
    else:
        tensors, others, errors = flatten_tree(obj, nontensor or ())
    errors += _tensor_errors(tensors, expected)
    if nontensor is not None:
        errors += _nontensor_errors(others, nontensor)
    if errors:
        raise Fail(_summarise(errors, what))
    msg = f"{len(tensors)} tensors equal"
    if nontensor is not None:
        msg += f", {len(others)} non-tensor items equal"
    elif others:
        msg += f" ({len(others)} non-tensor items not checked: no --nontensor)"
    return msg


# --------------------------------------------------------------------------------- pt-load

def cmd_pt_load(path, expected_path, nontensor_path=None, flat=False):
    import torch
    p = Path(path)
    if not p.is_file():
        raise Fail(f"{p}: no such file")
    expected = _load(expected_path)
    nontensor = _load_json(nontensor_path) if nontensor_path else None
    msgs = []
    for label, kw in (("torch.load(weights_only=True)", {}),
                      ("torch.load(weights_only=True, mmap=True)", {"mmap": True})):
        try:
            obj = torch.load(str(p), weights_only=True, **kw)
        except Exception as e:  # noqa: BLE001
            raise Fail(f"{label} failed: {_exc_line(e)}") from None
        msgs.append(compare_tree(obj, expected, nontensor, label, flat=flat))
        del obj
    return f"{msgs[0]} (plain and mmap loads)"


# --------------------------------------------------------------------------------- dcp-to-torch-save

def cmd_dcp_to_torch_save(d, expected_path, nontensor_path=None):
    import shutil
    import torch
    try:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    except ImportError:
        raise Unsupported("this torch has no torch.distributed.checkpoint.format_utils.dcp_to_torch_save") from None
    d = Path(d)
    if not (d / ".metadata").is_file():
        raise Fail(f"{d}: no .metadata")
    expected = _load(expected_path)
    nontensor = _load_json(nontensor_path) if nontensor_path else None
    tmp = Path(tempfile.mkdtemp(prefix="torch_interop."))
    try:
        out = tmp / "consolidated.pt"
        try:
            dcp_to_torch_save(str(d), str(out))
        except BaseException as e:  # noqa: BLE001  (CheckpointException is a BaseException)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            why = f"torch dcp_to_torch_save failed: {_exc_line(e)}"
            raise (Unsupported if _missing_dependency(why) else Fail)(why) from None
        try:
            obj = torch.load(str(out), weights_only=False)
        except Exception as e:  # noqa: BLE001
            raise Fail(f"torch.load of dcp_to_torch_save's output failed: {_exc_line(e)}") from None
        return compare_tree(obj, expected, nontensor, "dcp_to_torch_save vs expected")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------------- dcp-load

_GLOO_GATHER_DTYPES = ("float32", "float64", "float16", "bfloat16", "uint8", "int32",  # gloo: int16 etc. fail
                       "int64", "bool")


def _set_element(root: dict, path, value):
    """Like torch's set_element (which dcp.load uses to put loaded non-tensor items back)."""
    cur = root
    for i in range(1, len(path)):
        prev, key = path[i - 1], path[i]
        new = {} if type(key) is str else []
        if isinstance(cur, dict):
            cur = cur.setdefault(prev, new)
        else:
            while len(cur) <= prev:
                cur.append(None)
            if cur[prev] is None:
                cur[prev] = new
            cur = cur[prev]
    key = path[-1]
    if type(key) is int:
        while len(cur) <= key:
            cur.append(None)
    cur[key] = value


def _get_element(root: dict, path):
    cur = root
    for part in path:
        if type(part) is int:
            if not isinstance(cur, list) or part >= len(cur):
                return _UNFILLED
        elif not isinstance(cur, dict) or part not in cur:
            return _UNFILLED
        cur = cur[part]
    return cur


def _fill_byte(w) -> int:
    """A byte b such that no element of EXPECTED is all-b: any element dcp.load does not write
    then still reads b..b and cannot equal the expected value."""
    import numpy as np
    if w.numel() == 0:
        return 0xAB
    a = np.frombuffer(_bytes(w), dtype=np.uint8).reshape(-1, w.element_size())
    present = set(np.unique(a[(a == a[:, :1]).all(axis=1), 0]).tolist())
    for b in (0xAB, 0xA5, 0x5A, 0xFF, 0x00, *range(256)):
        if b not in present:
            return b
    return 0xAB  # a uint8/bool tensor holding every byte value: coverage check is best effort


class _DTensorAPI:
    """DTensor construction / gathering across torch versions (2.1 .. 2.15)."""

    def __init__(self):
        try:
            from torch.distributed.tensor import DTensor, Replicate, Shard
        except ImportError:
            try:
                from torch.distributed._tensor import DTensor, Replicate, Shard
            except ImportError:
                raise Unsupported("this torch has no DTensor") from None
        self.DTensor, self.Replicate, self.Shard = DTensor, Replicate, Shard
        try:
            from torch.distributed.device_mesh import init_device_mesh
        except ImportError:
            try:
                from torch.distributed._tensor.device_mesh import init_device_mesh
            except ImportError:
                raise Unsupported("this torch has no init_device_mesh") from None
        self.init_device_mesh = init_device_mesh
        import torch
        major, minor = (int(x) for x in torch.__version__.split(".")[:2])
        # torch < 2.2 cannot shard a dim smaller than the mesh ("Size to be sharded on dim 0 must be at
        # least as large as the number of devices"): such tensors are Replicate there
        self.shards_small_dims = (major, minor) >= (2, 2)

    def mesh(self, world):
        return self.init_device_mesh("cpu", (world,))

    @staticmethod
    def _local_shape(shape, mesh, placements, world, rank):
        if len(shape) == 0 or placements[0].is_replicate():
            return shape
        for mod in ("torch.distributed.tensor._utils", "torch.distributed._tensor._utils"):
            try:
                fn = getattr(__import__(mod, fromlist=["x"]), "compute_local_shape_and_global_offset")
                return tuple(fn(shape, mesh, placements)[0])
            except (ImportError, AttributeError):
                continue
        n = shape[0]  # torch.chunk rule: ceil(n / world) rows per rank, trailing ranks short/empty
        step = -(-n // world)
        rows = max(0, min(n, (rank + 1) * step) - min(n, rank * step))
        return (rows, *shape[1:])

    def make(self, shape, dtype, fill, mesh, world, rank):
        import torch
        shape = tuple(shape)
        shard = len(shape) > 0 and (self.shards_small_dims or shape[0] >= world)
        placements = [self.Shard(0)] if shard else [self.Replicate()]
        local = torch.empty(self._local_shape(shape, mesh, placements, world, rank), dtype=dtype)
        if local.numel():
            local.reshape(-1).view(torch.uint8).fill_(fill)
        stride = torch.empty(shape, dtype=dtype, device="meta").stride()
        try:
            return self.DTensor.from_local(local, mesh, placements, run_check=False,
                                           shape=torch.Size(shape), stride=stride)
        except TypeError:  # torch 2.1: from_local has no shape/stride
            return self.DTensor(local, mesh, tuple(placements), shape=torch.Size(shape), dtype=dtype,
                                requires_grad=False, stride=stride)

    def full(self, t, world):
        """Collective: the global tensor (on every rank)."""
        import torch
        import torch.distributed as dist
        if not isinstance(t, self.DTensor):
            return t
        if all(p.is_replicate() for p in t.placements):
            return t.to_local()
        if hasattr(t, "full_tensor") and str(t.dtype).replace("torch.", "") in _GLOO_GATHER_DTYPES:
            return t.full_tensor()
        # gloo cannot gather this dtype (float8, uint16, ...) or torch has no full_tensor (2.1):
        # gather the local shards' bytes and stack them along dim 0 in rank order (Shard(0) on 1-D mesh)
        loc = t.to_local().detach().contiguous()
        parts = [None] * world
        dist.all_gather_object(parts, (tuple(loc.shape), _bytes(loc) if loc.numel() else b""))
        full = torch.empty(tuple(t.shape), dtype=t.dtype)
        buf = b"".join(p[1] for p in parts)
        if full.numel():
            full.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(buf), dtype=torch.uint8))
        return full


def _dcp_load_call(sd, d):
    import inspect
    import torch.distributed.checkpoint as dcp
    if hasattr(dcp, "load"):
        params = inspect.signature(dcp.load).parameters
        if "checkpoint_id" in params:
            return dcp.load(sd, checkpoint_id=str(d))
        return dcp.load(sd, storage_reader=dcp.FileSystemReader(str(d)))
    return dcp.load_state_dict(sd, storage_reader=dcp.FileSystemReader(str(d)))


def _dcp_load_one(rank, world, mesh, api, d, expected_path, nontensor_path) -> str:
    """Runs on every rank in lockstep; raises Fail on rank 0 only for comparison failures
    (setup failures are deterministic, so every rank raises the same Fail before any collective)."""
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    d = Path(d)
    if not (d / ".metadata").is_file():
        raise Fail("no .metadata")
    try:
        md = FileSystemReader(str(d)).read_metadata()
    except Exception as e:  # noqa: BLE001
        raise Fail(f"torch FileSystemReader.read_metadata failed: {_exc_line(e)}") from None
    expected = _load(expected_path)
    want_nt = _load_json(nontensor_path) if nontensor_path else None
    sdm, pdata = md.state_dict_metadata, (md.planner_data or {})
    b_keys = {k for k, v in sdm.items() if isinstance(v, BytesStorageMetadata)}
    t_keys = set(sdm) - b_keys
    errors = []
    if set(expected) - set(sdm):
        errors.append(f"missing in checkpoint {sorted(set(expected) - set(sdm))[:5]}")
    if set(expected) & b_keys:
        errors.append(f"non-tensor (bytes) items in checkpoint, tensors expected {sorted(set(expected) & b_keys)[:5]}")
    if t_keys - set(expected):
        errors.append(f"unexpected tensors in checkpoint {sorted(t_keys - set(expected))[:5]}")

    def path_of(k):
        p = pdata.get(k)
        return tuple(p) if p else (k,)

    # the NESTED state dict, shaped by the checkpoint's own planner_data (as dcp_to_torch_save does)
    sd, compared, fills = {}, [], {}
    try:
        for k in sorted(sdm):
            m = sdm[k]
            if k in b_keys:
                _set_element(sd, path_of(k), _UNFILLED)
                continue
            size, dtype = tuple(m.size), m.properties.dtype
            w = expected.get(k)
            if w is None:  # unexpected tensor: still give dcp.load a (plain) home for it
                _set_element(sd, path_of(k), torch.empty(size, dtype=dtype))
                continue
            if size != tuple(w.shape):
                errors.append(f"{k}: checkpoint global shape {size} != expected {tuple(w.shape)}")
                _set_element(sd, path_of(k), torch.empty(size, dtype=dtype))
                continue
            if dtype != w.dtype:  # dcp.load would silently cast into the expected dtype
                errors.append(f"{k}: checkpoint dtype {dtype} != expected {w.dtype}")
                _set_element(sd, path_of(k), torch.empty(size, dtype=dtype))
                continue
            fills[k] = _fill_byte(w)
            _set_element(sd, path_of(k), api.make(size, dtype, fills[k], mesh, world, rank))
            compared.append(k)
    except Fail:
        raise
    except Exception as e:  # noqa: BLE001
        raise Fail(f"cannot build the nested state dict from planner_data: {_exc_line(e)}") from None

    _debug(f"rank {rank}: state dict built")
    try:
        _dcp_load_call(sd, d)
    except BaseException as e:  # noqa: BLE001  (CheckpointException is a BaseException)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise Fail(f"torch dcp.load at world {world} failed: {_exc_line(e)}") from None

    _debug(f"rank {rank}: dcp.load done")
    got = {}
    for k in compared:  # collective, same order on every rank
        full = api.full(_get_element(sd, path_of(k)), world)
        if rank == 0:
            got[k] = full
    _debug(f"rank {rank}: gathered")
    if rank != 0:
        return ""
    errors += _tensor_errors(got, {k: expected[k] for k in compared}, fills)
    got_nt = {k: _get_element(sd, path_of(k)) for k in b_keys}
    if want_nt is not None:
        errors += _nontensor_errors(got_nt, want_nt)
    else:
        errors += [f"{k}: non-tensor item not filled by dcp.load" for k in sorted(got_nt) if got_nt[k] is _UNFILLED]
    if errors:
        raise Fail(_summarise(errors, "dcp.load vs expected"))
    msg = f"{len(got)} tensors"
    msg += f" and {len(got_nt)} non-tensor items equal" if want_nt is not None else \
        f" equal ({len(got_nt)} non-tensor items loaded, not compared: no --nontensor)"
    return msg


def _debug(msg):
    if os.environ.get("TORCH_INTEROP_DEBUG"):
        import time
        print(f"torch_interop[{os.getpid()} {time.time():.2f}]: {msg}", file=sys.stderr, flush=True)


def _dcp_worker(rank, world, port, jobs, out_path, timeout_s):
    """One rank. Ends with os._exit: no destroy_process_group and no interpreter teardown (torch 2.1's
    gloo has hung in destroy_process_group, and 2.15's has aborted at exit with "terminate called
    without an active exception", both after all the work was done)."""
    code = 1
    try:
        _dcp_rank(rank, world, port, jobs, out_path, timeout_s)
        code = 0
    except BaseException as e:  # noqa: BLE001
        print(f"torch_interop: rank {rank}: {_exc_line(e)}", file=sys.stderr)
    finally:
        _debug(f"rank {rank} exiting with {code}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _dcp_rank(rank, world, port, jobs, out_path, timeout_s):
    import datetime
    import time
    import warnings
    warnings.filterwarnings("ignore")
    _debug(f"rank {rank} started")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    _debug(f"rank {rank} imported torch")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    _debug(f"rank {rank} joined the process group")
    api = _DTensorAPI()
    mesh = api.mesh(world)
    _debug(f"rank {rank} has the mesh")
    results = []
    for job in jobs:
        t0 = time.monotonic()
        try:
            res = {"ok": True, "msg": _dcp_load_one(rank, world, mesh, api, *job)}
        except Fail as e:
            res = {"ok": False, "msg": str(e).splitlines()[0] if str(e) else "rejected"}
            res["unsupported"] = _missing_dependency(res["msg"])
        except Exception as e:  # noqa: BLE001
            res = {"ok": False, "msg": f"internal error: {_exc_line(e)}"}
        # every rank's verdict reaches rank 0 (a rank-local failure must not pass silently)
        verdicts = [None] * world
        dist.all_gather_object(verdicts, res)
        if rank == 0:
            bad = [(r, v) for r, v in enumerate(verdicts) if not v["ok"]]
            if bad and res["ok"]:
                res = {"ok": False, "msg": f"rank {bad[0][0]}: {bad[0][1]['msg']}"}
            res["seconds"] = round(time.monotonic() - t0, 3)
            results.append(res)
            Path(out_path).write_text(json.dumps(results))
    dist.barrier()


def _missing_dependency(msg: str) -> bool:
    """torch failed for want of an optional module (e.g. zstandard for compressed checkpoints):
    that is 'this torch cannot', not 'the checkpoint is wrong'."""
    return "no module named" in msg.lower()


def _free_port() -> int:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_dcp_load(world: int, jobs: list) -> list:
    """Spawn `world` gloo ranks once and dcp.load every (DIR, EXPECTED, NONTENSOR|None) job in turn.
    Returns [{"ok", "msg", "seconds"}] per job."""
    import shutil
    import time
    import torch.multiprocessing as mp
    _DTensorAPI()  # Unsupported (exit 3) here, before spawning
    try:
        import torch.distributed.checkpoint  # noqa: F401
    except ImportError:
        raise Unsupported("this torch has no torch.distributed.checkpoint") from None
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout_s = int(os.environ.get("TORCH_INTEROP_TIMEOUT", "180"))
    # fork (Linux default): the ranks inherit this process's imported torch instead of importing it
    # again each (several seconds per rank); TORCH_INTEROP_START_METHOD=spawn for fresh interpreters
    method = os.environ.get("TORCH_INTEROP_START_METHOD", "fork" if sys.platform == "linux" else "spawn")
    if method == "fork":
        import numpy  # noqa: F401
        import safetensors.torch  # noqa: F401
        import torch.distributed.checkpoint.filesystem  # noqa: F401
        import torch.distributed.checkpoint.metadata  # noqa: F401
        try:  # DTensor.from_local imports dynamo on first use: ~1.5 s of CPU per rank otherwise
            import torch._dynamo  # noqa: F401
        except Exception:  # noqa: BLE001
            pass
    tmp = Path(tempfile.mkdtemp(prefix="torch_interop."))
    out = tmp / "results.json"
    try:
        t0 = time.monotonic()
        try:
            _debug(f"parent: starting {world} ranks ({method})")
            mp.start_processes(_dcp_worker, args=(world, _free_port(), jobs, str(out), timeout_s), nprocs=world,
                               join=True, start_method=method)
        except Exception as e:  # noqa: BLE001
            done = json.loads(out.read_text()) if out.is_file() else []
            lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
            why = lines[-1].strip() if lines else type(e).__name__
            if len(done) == len(jobs):  # every rank had delivered its verdict on every checkpoint
                note(f"a rank died after all verdicts were in (ignored): {why}")
                return done
            raise Fail(f"spawned ranks died after {len(done)} of {len(jobs)} checkpoint(s) "
                       f"({time.monotonic() - t0:.1f}s): {why}"[:500]) from None
        return json.loads(out.read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cmd_dcp_load(world: int, jobs: list):
    import time
    t0 = time.monotonic()
    results = run_dcp_load(world, jobs)
    total = time.monotonic() - t0
    if len(jobs) == 1:
        r, d = results[0], jobs[0][0]
        if not r["ok"]:
            raise (Unsupported if r.get("unsupported") else Fail)(f"{d}: {r['msg']}")
        return f"{d} at world {world}: {r['msg']} ({total:.1f}s)"
    nbad = nunsup = 0
    for (d, _e, _n), r in zip(jobs, results):
        if r["ok"]:
            print(f"OK dcp-load --world {world} {d}: {r['msg']} ({r['seconds']:.2f}s)", flush=True)
        elif r.get("unsupported"):
            nunsup += 1
            print(f"UNSUPPORTED dcp-load --world {world} {d}: {r['msg']}", file=sys.stderr, flush=True)
        else:
            nbad += 1
            print(f"FAIL dcp-load --world {world} {d}: {r['msg']}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    if nbad:
        raise Fail(f"{nbad} of {len(jobs)} checkpoints rejected at world {world} ({total:.1f}s)")
    if nunsup:
        raise Unsupported(f"{nunsup} of {len(jobs)} checkpoints need a module this environment lacks; "
                          f"the other {len(jobs) - nunsup} equal at world {world}")
    return f"all {len(jobs)} checkpoints equal at world {world} ({total:.1f}s incl. spawning {world} ranks)"


# --------------------------------------------------------------------------------- argument parsing

class Usage(Exception):
    pass


def _opts(argv, flags=(), valued=()):
    """-> (positional, {option: value or True}); --opt=value and --opt value both accepted."""
    pos, opts = [], {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            name, eq, val = a.partition("=")
            if name in flags and not eq:
                opts[name] = True
            elif name in valued:
                if not eq:
                    i += 1
                    if i >= len(argv):
                        raise Usage(f"{name} needs a value")
                    val = argv[i]
                opts[name] = val
            else:
                raise Usage(f"unknown option {a}")
        else:
            pos.append(a)
        i += 1
    return pos, opts


def parse_dcp_load(argv):
    """dcp-load [--world M] DIR EXP [--nontensor J] [DIR EXP [--nontensor J] ...]
    (--nontensor applies to the pair just before it; --world may be anywhere)."""
    world, jobs, pending = None, [], []
    i = 0
    while i < len(argv):
        a = argv[i]
        name, eq, val = a.partition("=")
        if name in ("--world", "--nontensor"):
            if not eq:
                i += 1
                if i >= len(argv):
                    raise Usage(f"{name} needs a value")
                val = argv[i]
            if name == "--world":
                try:
                    world = int(val)
                except ValueError:
                    raise Usage(f"--world {val!r} is not an integer") from None
            else:
                if pending or not jobs or jobs[-1][2] is not None:
                    raise Usage("--nontensor must follow a DIR EXPECTED pair (once per pair)")
                jobs[-1][2] = val
        elif a.startswith("--"):
            raise Usage(f"unknown option {a}")
        else:
            pending.append(a)
            if len(pending) == 2:
                jobs.append([pending[0], pending[1], None])
                pending = []
        i += 1
    if pending or not jobs:
        raise Usage("needs DIR EXPECTED.safetensors pairs")
    if world is None or world < 1:
        raise Usage("needs --world M (M >= 1)")
    return [world, [tuple(j) for j in jobs]]


def _parse_fixed(n, flags=(), valued=(), names=None):
    def parse(argv):
        pos, opts = _opts(argv, flags, valued)
        if len(pos) != n:
            raise Usage(f"takes {n} positional arguments, got {len(pos)}")
        return pos + [opts.get(o, False if o in flags else None) for o in (names or [*valued, *flags])]
    return parse


COMMANDS = {
    "hf-storage-load": (cmd_hf_storage_load, _parse_fixed(2)),
    "safetensors-equal": (cmd_safetensors_equal, _parse_fixed(2)),
    "hf-load": (cmd_hf_load, _parse_fixed(2)),
    "dcp-load": (cmd_dcp_load, parse_dcp_load),
    "dcp-to-torch-save": (cmd_dcp_to_torch_save, _parse_fixed(2, valued=("--nontensor",))),
    "pt-load": (cmd_pt_load, _parse_fixed(2, flags=("--flat",), valued=("--nontensor",))),
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    fn, parse = COMMANDS[argv[0]]
    try:
        args = parse(argv[1:])
    except Usage as e:
        print(f"torch_interop: {argv[0]}: {e} (see --help)", file=sys.stderr)
        return 2
    try:
        msg = fn(*args)
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
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")  # torch 2.1 torch.load
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
