"""The one abi3 wheel on other CPython versions: the wheel ``scripts/test.sh`` built and
installed here (``$RESHARD_WHEEL``) installed into a fresh venv of every other CPython ≥ 3.10
found on this machine, with numpy only — no torch, which the package imports at run time
and never links. There it opens a DCP fixture, reads every tensor (numpy), converts and
verifies, and its ``reshard`` command runs; the bytes read equal the oracle's here."""

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
CASE = REPO / "tests" / "fixtures" / "fsdp2_w4_f32"

# Run in the other interpreter's venv: tensors' sha256 by name, and what convert/verify say.
PROBE = r"""
import hashlib, json, os, sys
import reshard
assert "torch" not in sys.modules
src, out = sys.argv[1], sys.argv[2]
with reshard.open(src, framework="numpy") as ck:
    sums = {}
    for t in ck.tensors():
        try:
            sums[t.name] = hashlib.sha256(ck.get_tensor(t.name).tobytes()).hexdigest()
        except reshard.RequestError as e:  # bf16 / fp8: no numpy dtype
            assert "has no numpy dtype" in str(e), e
    world = ck.world_size
reshard.convert(src, out, world_size=1, include=["model.*"])
v = reshard.verify(out)
print(json.dumps({"version": list(sys.version_info[:2]), "world": world, "sums": sums,
                  "verified": v["ok"], "torch_imported": "torch" in sys.modules}))
"""


def _interpreters() -> list:
    """Other CPython ≥ 3.10 executables: ``python3.X`` on PATH and pyenv's versions."""
    found = {}
    cands = [shutil.which(f"python3.{m}") for m in range(10, 16)]
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    cands += sorted(glob.glob(os.path.join(root, "versions", "3.*", "bin", "python3")))
    for exe in filter(None, cands):
        try:
            out = subprocess.run([exe, "-c", "import sys, platform; print(sys.version_info[0], sys.version_info[1], platform.python_implementation())"],
                                 capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        parts = out.stdout.split()
        if out.returncode != 0 or len(parts) != 3 or parts[2] != "CPython":
            continue
        ver = (int(parts[0]), int(parts[1]))
        if ver >= (3, 10) and ver != sys.version_info[:2]:
            found.setdefault(ver, exe)
    return [found[v] for v in sorted(found)]


def test_one_wheel_on_other_pythons(tmp_path):
    wheel = os.environ.get("RESHARD_WHEEL")
    if not wheel or not Path(wheel).is_file():
        pytest.skip("RESHARD_WHEEL is not set to a built wheel (scripts/test.sh sets it)")
    assert "abi3" in Path(wheel).name, wheel
    exes = _interpreters()
    if not exes:
        pytest.skip("no other CPython >= 3.10 on this machine")
    # numpy has no bf16 / fp8 dtypes: those tensors are not read there
    want = {k: hashlib.sha256(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in load_file(str(CASE / "oracle" / "full.safetensors")).items()
            if v.dtype != torch.bfloat16 and not str(v.dtype).startswith("torch.float8")}
    assert len(want) > 20
    seen = []
    for i, exe in enumerate(exes):
        venv = tmp_path / f"venv{i}"
        subprocess.run([exe, "-m", "venv", str(venv)], check=True, timeout=120)
        py = venv / "bin" / "python"
        pip = subprocess.run([str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q", "numpy", wheel],
                             capture_output=True, text=True, timeout=600)
        assert pip.returncode == 0, f"{exe}: pip install failed\n{pip.stdout}\n{pip.stderr}"
        out = tmp_path / f"out{i}.safetensors"
        r = subprocess.run([str(py), "-c", PROBE, str(CASE / "checkpoint"), str(out)],
                           capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
        assert r.returncode == 0, f"{exe}\n{r.stdout}\n{r.stderr}"
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got["world"] == 4 and got["verified"] and not got["torch_imported"]
        assert got["sums"] == want, f"{exe}: tensors differ from the oracle"
        # the console script of that venv is the same CLI
        cli = subprocess.run([str(venv / "bin" / "reshard"), "inspect", str(out)], capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0 and "model.embed.weight" in cli.stdout, cli.stdout + cli.stderr
        seen.append(".".join(map(str, got["version"])))
    print(f"\nthe abi3 wheel ran on CPython {', '.join(seen)} (and {sys.version_info[0]}.{sys.version_info[1]} here)")
