"""DeepSpeed Universal Checkpoints written by reshard, with DeepSpeed itself as the judge
(DeepSpeed 0.19.8 on CPU, gloo, under torchrun; ``scripts/setup_venv.sh --deepspeed``):

- a ZeRO fixture written as a universal checkpoint by reshard is loaded by DeepSpeed's engine
  with ``"checkpoint": {"load_universal": true}`` at another data-parallel degree and ZeRO
  stage; the engine's full state right after loading (fp32 master weights, Adam moments,
  step) equals the state saved at the source byte for byte, and two more training steps give
  exactly the losses of the same load from ``ds_to_universal``'s own universal checkpoint of
  that source (tests/fixtures/deepspeed_universal), or, where DeepSpeed cannot load that one
  (a stage 3 source into a stage 2 job: it keeps no ``mp_rank_00_model_states.pt``), the
  source's own resumed losses up to the order of the reductions."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

import reshard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import _quiet, same  # noqa: E402,F401  (_quiet: an autouse fixture)
from test_deepspeed import FIX, GEN, assert_losses, assert_state, needs_deepspeed  # noqa: E402

UCP = FIX.parent / "deepspeed_universal"


def resume_universal(ckpt: Path, case: str, dp: int, stage: int, work: Path, name: str) -> tuple:
    """DeepSpeed's engine at ``dp`` ranks and ZeRO ``stage`` (else configured as fixture
    ``case``) loads universal checkpoint ``ckpt`` and trains two steps: (the engine's state
    right after loading, the two losses)."""
    out, dump = work / f"resume-{name}.json", work / f"state-{name}.safetensors"
    r = subprocess.run(
        [sys.executable, str(GEN), "--resume", str(ckpt), "--case", case, "--dp", str(dp),
         "--stage", str(stage), "--universal", "--json", str(out), "--dump", str(dump)],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return load_file(str(dump)), json.loads(out.read_text())["losses"]


@needs_deepspeed
def test_deepspeed_loads_reshards_ucp_as_it_loads_ds_to_universals(tmp_path):
    # ZeRO-2 at 2 ranks -> a universal checkpoint -> ZeRO-1 at 3 ranks
    case = "zero2_dp2_f32_g1"
    out = tmp_path / "ucp"
    summary = reshard.convert(FIX / case / "checkpoint", out, world_size=3, format="ucp", zero_stage=1)
    assert summary["format"] == "deepspeed-universal"
    state, losses = resume_universal(out, case, 3, 1, tmp_path, "reshard")
    assert_state(state, load_file(str(FIX / case / "oracle" / "engine.safetensors")), f"{case} as a UCP")
    theirs_state, theirs = resume_universal(UCP / case, case, 3, 1, tmp_path, "ds_to_universal")
    assert_state(state, theirs_state, "reshard's UCP against ds_to_universal's")
    assert losses == theirs


@needs_deepspeed
def test_deepspeed_loads_a_stage3_source_as_a_stage2_ucp(tmp_path):
    # ZeRO-3 at 2 ranks (sub-groups) -> a universal checkpoint for stage 2 -> ZeRO-2 at 2 ranks
    case = "zero3_dp2_f32_g2_sub"
    out = tmp_path / "ucp"
    reshard.convert(FIX / case / "checkpoint", out, world_size=2, format="ucp", zero_stage=2)
    state, losses = resume_universal(out, case, 2, 2, tmp_path, "reshard")
    assert_state(state, load_file(str(FIX / case / "oracle" / "engine.safetensors")), f"{case} as a UCP")
    want = json.loads((FIX / case / "oracle" / "resume.json").read_text())["losses"]
    assert_losses(losses, want, f"{case} at stage 2", False)
