"""megatron-core loads reshard's megatron outputs at other tensor- and data-parallel splits.

The fixtures (tests/fixtures/megatron, saved by megatron-core 0.16.1 and 0.15.3 under torchrun by
scripts/gen_megatron.py) are converted with ``reshard.convert(..., format="megatron")`` to
another number of ranks, and megatron-core's own ``dist_checkpointing.load`` then reads them in
a job of another split: the generator's ``--worker reload`` asks, on every rank, for that rank's
shards of the model (TP-split along either axis, layer-stacked tensors with prepend_axis_num=1,
replicated tensors) and checks every loaded piece against the values the checkpoint was made
from. The 0.15 checkpoint's flattened distributed-optimizer tensors come out of reshard in their
real shapes, which megatron-core >= 0.16 (no flattened ranges) asks for as regular tensors.

Needs megatron-core in the venv (``scripts/setup_venv.sh --megatron``; CI installs it).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import reshard

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "megatron"
GEN = REPO / "scripts" / "gen_megatron.py"
sys.path.insert(0, str(REPO / "scripts"))
import _torchrun  # noqa: E402  (the generator's way of running its jobs)

try:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
        import megatron.core  # noqa: F401  (importable: the tests can run)

    HAVE_MCORE = True
except Exception:  # noqa: BLE001 (any import failure means: not usable here)
    HAVE_MCORE = False

# under CI (which installs it) a missing megatron-core fails the tests instead of skipping them
pytestmark = pytest.mark.skipif(
    not HAVE_MCORE and os.environ.get("CI") != "true", reason="megatron-core is not installed (scripts/setup_venv.sh --megatron)"
)


def megatron_reload(ckpt: Path, case: str, tp: int, nproc: int, unflattened: bool, tmp: Path) -> dict:
    """megatron-core's dist_checkpointing.load of `ckpt` by `nproc` processes at TP=`tp`."""
    out = tmp / f"reload_tp{tp}.json"
    argv = ["--worker", "reload", "--case", case, "--dir", str(ckpt), "--tp", str(tp), "--json", str(out)]
    if unflattened:
        argv.append("--unflattened")
    rc, log = _torchrun.run(GEN, nproc, argv, env={"PYTHONWARNINGS": "ignore"}, cwd=tmp)
    assert rc == 0, log[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize(
    "case,ranks,tp,nproc",
    [
        # TP4 -> TP1 (NVIDIA/Megatron-LM#1490's direction), written for one rank, loaded by two DP ranks
        ("mcore016_tp4_dp1", 1, 1, 2),
        # TP2 x DP2 -> TP4, written for 4 ranks
        ("mcore016_tp2_dp2", 4, 4, 4),
        # 0.15 flattened optimizer state -> real shapes at 3 ranks, loaded by 0.16 at TP1 x DP2
        ("mcore015_tp2_dp2_flat", 3, 1, 2),
    ],
)
def test_megatron_core_loads_the_output_at_another_split(case, ranks, tp, nproc, tmp_path):
    src = FIXTURES / case / "checkpoint"
    out = tmp_path / "out"
    reshard.convert(src, out, world_size=ranks, format="megatron", per_rank_state="keep")
    ck = reshard.open(out)
    assert ck.format == "megatron"
    flat = json.loads((FIXTURES / case / "case.json").read_text())["flat"]
    r = megatron_reload(out, case, tp, nproc, flat, tmp_path)
    assert r["ok"], r
    assert r["values_equal"], r
    assert (r["tp"], r["processes"]) == (tp, nproc)


def test_common_state_reaches_megatron_core(tmp_path):
    """common.pt written by reshard is what megatron-core's load_common_state_dict reads."""
    from megatron.core import dist_checkpointing

    import argparse
    import shutil

    # the fixture with Megatron-LM's `args` (an argparse.Namespace) in its common.pt
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "mcore016_tp2_dp1" / "checkpoint", src)
    shutil.copy(FIXTURES / "common_with_args.pt", src / "common.pt")
    out = tmp_path / "out"
    reshard.convert(src, out, world_size=3, format="megatron", per_rank_state="keep")
    want = dist_checkpointing.load_common_state_dict(str(src))
    got = dist_checkpointing.load_common_state_dict(str(out))
    assert got == want
    assert got["iteration"] == 7
    assert isinstance(got["args"], argparse.Namespace) and got["args"].params_dtype == torch.bfloat16
