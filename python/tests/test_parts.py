"""A conversion split over workers: ``reshard.convert(..., part=(k, n))`` and ``part="env"``, the
``reshard`` command under real torchrun jobs (one agent with several processes, and two agents
as two "nodes" meeting at a c10d rendezvous on 127.0.0.1) and under a real one-node Slurm
cluster when one can be started here. Every output is byte-identical to the one-process
conversion, and what torch loads from it equals the state dict torch saved."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import reshard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import _quiet, same  # noqa: E402,F401

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import _torchrun  # noqa: E402

BIN = Path(sys.executable).parent / "reshard"


def files(p: Path) -> dict:
    """Every file of an output (a file or a folder) with its bytes."""
    if p.is_file():
        return {"": p.read_bytes()}
    return {str(f.relative_to(p)): f.read_bytes() for f in sorted(p.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A DCP checkpoint torch saved (about 6 MB: several tensors, uneven shapes, two dtypes)
    and the state dict it holds."""
    d = tmp_path_factory.mktemp("src")
    g = torch.Generator().manual_seed(5)
    sd = {
        "emb.weight": torch.randn(1000, 257, generator=g),
        "layers.0.w": torch.randn(513, 700, generator=g),
        "layers.1.w": torch.randn(300, 301, generator=g).to(torch.bfloat16),
        "head.bias": torch.randn(77, generator=g),
        "step": torch.tensor(12, dtype=torch.int64),
    }
    dcp.save(sd, checkpoint_id=str(d / "ckpt"), no_dist=True)
    return d / "ckpt", sd


def whole(src: Path, tmp: Path, name: str, **kw) -> Path:
    out = tmp / f"whole-{name}"
    reshard.convert(src, out, **kw)
    return out


def test_parts_from_python_equal_one_process_and_load_in_torch(source, tmp_path):
    src, sd = source
    want = whole(src, tmp_path, "m.pt", world_size=1)
    dst = tmp_path / "m.pt"
    n = 4
    for k in [3, 1, 0]:
        r = reshard.convert(src, dst, world_size=1, part=(k, n))
        assert r["parts"]["part"] == [k, n]
        assert r["parts"]["committed"] is None
        assert not dst.exists()
    with pytest.raises(reshard.RequestError, match=r"1 of 4 part\(s\) not written: 2/4"):
        reshard.commit(dst)
    r = reshard.convert(src, dst, world_size=1, part=(2, n))
    assert r["parts"]["committed"] == "published" and r["parts"]["missing"] == []
    assert dst.read_bytes() == want.read_bytes()
    got = torch.load(dst, weights_only=True)
    assert set(got) == set(sd) and all(same(got[k], sd[k]) for k in sd)


def test_part_argument_is_checked(source, tmp_path):
    src, _ = source
    for bad in [(4, 4), "1/2", (0, 0), 3]:
        with pytest.raises(reshard.RequestError):
            reshard.convert(src, tmp_path / "x.pt", world_size=1, part=bad)
    assert not any(tmp_path.iterdir())


WORKER = r'''
import json, os, subprocess, sys
import reshard
src, dst, how = sys.argv[1:4]
if how == "api":
    r = reshard.convert(src, dst, world_size=3, format="dcp", part="env")
    # one file per worker: the workers' stdout lines interleave in torchrun's log
    with open(os.path.join(sys.argv[4], "result-" + os.environ["RANK"] + ".json"), "w") as f:
        json.dump(r["parts"], f)
else:
    # the command finds its part in torchrun's RANK and WORLD_SIZE
    subprocess.run(["reshard", "convert", src, dst, "--to", "3", "--format", "dcp"], check=True)
'''


def dcp_state(path: Path, sd: dict) -> dict:
    """What torch's own DCP loader reads from ``path`` into tensors shaped as ``sd``'s."""
    got = {k: torch.empty_like(v) for k, v in sd.items()}
    dcp.load(got, checkpoint_id=str(path), no_dist=True)
    return got


@pytest.mark.parametrize("how", ["api", "cli"])
def test_torchrun_workers_write_one_output(source, tmp_path, how):
    src, sd = source
    want = whole(src, tmp_path, "d", world_size=3, format="dcp")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    dst = tmp_path / "d"
    out = tmp_path / "results"
    out.mkdir()
    rc, log = _torchrun.run(script, 4, [str(src), str(dst), how, str(out)], timeout=300)
    assert rc == 0, log
    assert files(dst) == files(want)
    if how == "api":
        results = [json.loads(f.read_text()) for f in sorted(out.glob("result-*.json"))]
        assert sorted(r["part"][0] for r in results) == [0, 1, 2, 3]
        assert all(r["from"] == "torchrun" for r in results)
        assert sum(r["committed"] == "published" for r in results) <= 1
    got = dcp_state(dst, sd)
    assert all(same(got[k], sd[k]) for k in sd)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_two_torchrun_agents_as_two_nodes(source, tmp_path):
    """Two torchrun agents (two "nodes" of two processes) meet at a c10d rendezvous on
    127.0.0.1: four workers, parts 0..3, one output."""
    src, sd = source
    want = whole(src, tmp_path, "d", world_size=3, format="dcp")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    dst = tmp_path / "d"
    port = _torchrun.free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "reshard-parts",
           str(script), str(src), str(dst), "cli"]
    agents = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True) for _ in range(2)]
    outs = []
    try:
        for a in agents:
            out, _ = a.communicate(timeout=300)
            outs.append((a.returncode, out))
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, 9)
    for rc, out in outs:
        assert rc == 0, out
    text = "".join(o for _, o in outs)
    for k in range(4):
        assert f"part {k}/4 (from torchrun's environment)" in text, text
    assert files(dst) == files(want)
    got = dcp_state(dst, sd)
    assert all(same(got[k], sd[k]) for k in sd)


SLURM = REPO / "scripts" / "slurm_local.sh"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A real one-node Slurm cluster (Debian's slurm-wlm, scripts/slurm_local.sh), started for
    these tests and stopped after; skipped, saying why, where it cannot be installed or started."""
    inst = subprocess.run(["bash", str(SLURM), "install"], capture_output=True, text=True, timeout=600)
    if inst.returncode != 0:
        pytest.skip(f"Slurm cannot be installed here: {inst.stderr.strip()[-300:]}")
    d = Path(tmp_path_factory.mktemp("slurm"))
    st = subprocess.run(["bash", str(SLURM), "start", str(d)], capture_output=True, text=True, timeout=120)
    if st.returncode != 0:
        pytest.skip(f"a Slurm cluster cannot be started here: {st.stderr.strip()[-300:]}")
    env = dict(os.environ, SLURM_CONF=str(d / "slurm.conf"),
               PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    for k in ("RANK", "WORLD_SIZE", "SLURM_JOB_ID"):
        env.pop(k, None)
    try:
        yield env
    finally:
        subprocess.run(["bash", str(SLURM), "stop", str(d)], capture_output=True, timeout=120)


def test_slurm_tasks_and_array_jobs_write_one_output(source, tmp_path, slurm):
    src, sd = source
    want = whole(src, tmp_path, "d", world_size=3, format="dcp")
    # srun: three tasks, each its SLURM_PROCID of SLURM_NTASKS
    dst = tmp_path / "tasks"
    r = subprocess.run(["srun", "-n", "3", "--mpi=none", str(BIN), "convert", str(src), str(dst), "--to", "3",
                        "--format", "dcp"], env=slurm, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    for k in range(3):
        assert f"part {k}/3 (from Slurm tasks's environment)" in r.stdout, r.stdout
    assert files(dst) == files(want)
    # an array job of four tasks: SLURM_ARRAY_TASK_ID with its MIN and COUNT
    dst = tmp_path / "array"
    r = subprocess.run(["sbatch", "--wait", "--array=0-3", "-o", str(tmp_path / "array-%a.out"), "--wrap",
                        f"{BIN} convert {src} {dst} --to 3 --format dcp"],
                       env=slurm, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    logs = "".join((tmp_path / f"array-{k}.out").read_text() for k in range(4))
    for k in range(4):
        assert f"part {k}/4 (from Slurm array job's environment)" in logs, logs
    assert files(dst) == files(want)
    got = dcp_state(dst, sd)
    assert all(same(got[k], sd[k]) for k in sd)
