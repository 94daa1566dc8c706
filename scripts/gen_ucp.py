#!/usr/bin/env python3
"""Generate REAL DeepSpeed Universal Checkpoints (UCP) for reshard's tests.

Each case is DeepSpeed's own conversion of one ZeRO fixture (tests/fixtures/deepspeed/<case>,
written by scripts/gen_deepspeed.py) with

  python -m deepspeed.checkpoint.ds_to_universal --input_folder <case>/checkpoint/global_step2 \
      --output_folder <out>/<case>/global_step2_universal --inject_missing_state \
      --num_extract_workers 1 --num_merge_workers 1

Output, per case, under <out>/<case>/:

  latest_universal                 written by ds_to_universal (the tag folder's name)
  global_step2_universal/          exactly what ds_to_universal wrote:
    zero/<param>/fp32.pt ...       per parameter: fp32 master weights and Adam state
    zero/optimizer_state.pt        the ZeRO wrapper's state (param groups, loss scaler, ...)
    *model_states.pt               the source's model states file(s), copied
  case.json                        versions, the source case, the command

and malformed/bad_cat_dim.pt: a torch.save of {cat_dim: 5, param: zeros(7)} for the error tests.

The oracles are the source case's: oracle/fp32.safetensors (zero_to_fp32) and
oracle/engine.safetensors (the engine's full state) under tests/fixtures/deepspeed/<case>.

Usage:
  python scripts/gen_ucp.py [--out tests/fixtures/deepspeed_universal] [--only NAME ...]
Needs: deepspeed in the venv (scripts/setup_venv.sh --deepspeed). Runs on CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCES = REPO / "tests/fixtures/deepspeed"
TAG = "global_step2"
# stage 1 two groups + frozen + dp 3; stage 2 tied; stage 2 bf16 two groups; stage 3 sub-groups;
# stage 3 frozen at dp 3
CASES = ["zero1_dp3_f32_g2", "zero2_dp2_f32_g1", "zero2_dp2_bf16_g2", "zero3_dp2_f32_g2_sub", "zero3_dp3_f32_g2"]


def convert(src: Path, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(src),
           "--output_folder", str(out), "--inject_missing_state", "--num_extract_workers", "1",
           "--num_merge_workers", "1"]
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return cmd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=REPO / "tests/fixtures/deepspeed_universal")
    ap.add_argument("--only", nargs="*")
    args = ap.parse_args()
    import deepspeed
    import torch

    for case in args.only or CASES:
        dst = args.out / case
        if dst.exists():
            shutil.rmtree(dst)
        dst.mkdir(parents=True)
        src = SOURCES / case / "checkpoint" / TAG
        cmd = convert(src, dst / f"{TAG}_universal")
        files = {str(p.relative_to(dst)): p.stat().st_size for p in sorted(dst.rglob("*")) if p.is_file()}
        info = json.loads((SOURCES / case / "case.json").read_text())
        info.update(source=f"deepspeed/{case}", deepspeed=deepspeed.__version__, torch=torch.__version__,
                    command="python -m deepspeed.checkpoint.ds_to_universal --input_folder <source>/checkpoint/"
                            f"{TAG} --output_folder {TAG}_universal --inject_missing_state",
                    files=files)
        (dst / "case.json").write_text(json.dumps(info, indent=1) + "\n")
        print(case, sum(files.values()), "bytes")
    # a malformed state file for the error tests: `cat_dim` beyond the tensor's dimensions
    bad = args.out / "malformed"
    bad.mkdir(exist_ok=True)
    torch.save({"cat_dim": 5, "param": torch.zeros(7)}, bad / "bad_cat_dim.pt")


if __name__ == "__main__":
    main()
