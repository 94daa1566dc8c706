"""A DCP checkpoint with more than 100,000 chunks (a Llama-shaped FSDP2 + AdamW state of 80
layers on 48 ranks, written by torch's own planner and writer: scripts/gen_scale_dcp.py),
consolidated and resharded by reshard, against torch's own consolidation (``dcp_to_torch_save``).

    scripts/test.sh --python -- -k scale        # this test alone (about 1.5 minutes)

- N → 1: reshard's ``.pt`` equals torch's consolidated file, tensor for tensor, byte for byte;
- N → M (M = 8): torch's ``dcp_to_torch_save`` of reshard's DCP output equals its
  consolidation of the source (torch reads what reshard wrote, and finds the same state).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import Metadata

import reshard

REPO = Path(__file__).resolve().parents[2]
LAYERS, RANKS = 80, 48  # 3 x (9 L + 3) x N = 104,112 chunks


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert list(got) == list(want), what
    for k, w in want.items():
        g = got[k]
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor), f"{what}: {k}"
            assert (g.dtype, g.shape) == (w.dtype, w.shape), f"{what}: {k}"
            assert g.contiguous().view(torch.uint8).equal(w.contiguous().view(torch.uint8)), f"{what}: {k}"
        elif isinstance(w, dict):
            _assert_same(g, w, f"{what}: {k}")
        else:
            assert g == w, f"{what}: {k}"


def _leaves(d: dict) -> int:
    return sum(_leaves(v) if isinstance(v, dict) else 1 for v in d.values())


@pytest.fixture(scope="module")
def scale_ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("scale") / "ckpt"
    subprocess.run([sys.executable, str(REPO / "scripts" / "gen_scale_dcp.py"), str(out),
                    "--layers", str(LAYERS), "--ranks", str(RANKS), "--jobs", "2"],
                   check=True, stdout=subprocess.DEVNULL)
    return out


def _chunks(ckpt: Path) -> int:
    import pickle

    with open(ckpt / ".metadata", "rb") as f:
        md: Metadata = pickle.load(f)
    return sum(len(v.chunks) for v in md.state_dict_metadata.values() if hasattr(v, "chunks"))


def test_scale_checkpoint_to_1_and_to_m_equals_torch(scale_ckpt, tmp_path):
    assert _chunks(scale_ckpt) >= 100_000
    want_pt = tmp_path / "torch.pt"
    dcp_to_torch_save(scale_ckpt, want_pt)
    want = torch.load(want_pt, weights_only=True)
    assert _leaves(want) == 3 * (9 * LAYERS + 3)

    # N -> 1
    out = tmp_path / "reshard.pt"
    reshard.convert(scale_ckpt, out, world_size=1)
    _assert_same(torch.load(out, weights_only=True), want, "N -> 1")

    # N -> M, read back by torch
    m = 8
    dcp_out = tmp_path / "dcp8"
    reshard.convert(scale_ckpt, dcp_out, world_size=m, format="dcp")
    assert sorted(p.name for p in dcp_out.iterdir()) == sorted([".metadata"] + [f"__{r}_0.distcp" for r in range(m)])
    assert _chunks(dcp_out) == 3 * (9 * LAYERS + 3) * m
    back = tmp_path / "back.pt"
    dcp_to_torch_save(dcp_out, back)
    _assert_same(torch.load(back, weights_only=True), want, f"N -> {m} -> torch")
