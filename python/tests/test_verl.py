"""verl's per-rank FSDP2 checkpoints (``tests/fixtures/verl``, written by verl's own
``FSDPCheckpointManager`` on CPU: ``scripts/gen_verl.py``), judged by the model and by verl:

- consolidated into a Hugging Face folder, ``from_pretrained`` gives the source model's logits
  and verl's ``huggingface/`` config (FSDP2 DTensor shards, and FSDP1 ShardedTensors);
- ``reshard.torch.load`` into a plain model (world 1) gives the source model's state dict
  byte for byte;
- every weight equals verl's own model merger's output (bf16) after the same cast.

verl is installed by ``scripts/setup_venv.sh --verl`` (CI passes it); under ``CI=true`` a
missing verl is a failure.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import reshard
import reshard.torch as rt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import _quiet  # noqa: E402,F401  (_quiet: an autouse fixture)

FIX = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "verl"
CASES = ["fsdp2_w2", "fsdp2_w3"]
MISSING = [m for m in ("verl", "transformers") if importlib.util.find_spec(m) is None]
if MISSING and os.environ.get("CI") == "true":
    raise RuntimeError(f"CI=true: {', '.join(MISSING)} missing (scripts/setup_venv.sh --verl)")
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"{MISSING} not installed (scripts/setup_venv.sh --verl)")


def same_bytes(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, a.shape, b.dtype, b.shape)
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), what


@pytest.mark.parametrize("case", CASES + ["fsdp1_w2"])
def test_consolidated_folder_has_the_models_logits(case, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "hf"
    reshard.convert(FIX / case / "checkpoint", out, world_size=1, format="hf",
                    exclude=["optim.*", "extra_state.*"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == json.loads((FIX / case / "checkpoint" / "huggingface" / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    want = load_file(str(FIX / case / "oracle" / "model.safetensors"))
    for k, v in model.state_dict().items():
        same_bytes(v, want[k], k)
    data = json.loads((FIX / case / "oracle" / "input.json").read_text())
    with torch.no_grad():
        logits = model(torch.tensor(data["input_ids"])).logits
    assert torch.equal(logits, torch.tensor(data["logits"], dtype=logits.dtype))


@pytest.mark.parametrize("case", CASES)
def test_torch_load_fills_a_plain_model_and_equals_verls_merger(case):
    want = load_file(str(FIX / case / "oracle" / "model.safetensors"))
    sd = {k: torch.full_like(v, float("nan")) for k, v in want.items()}
    res = rt.load(sd, FIX / case / "checkpoint", strict=False)
    assert res.missing_keys == []
    for k in want:
        same_bytes(sd[k], want[k], k)
    merged = load_file(str(FIX / case / "oracle" / "merged.safetensors"))
    assert sorted(merged) == sorted(want)
    for k, v in merged.items():
        same_bytes(sd[k].to(v.dtype), v, f"verl merger: {k}")
