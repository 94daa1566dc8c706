"""reshard.lightning.load against Lightning Fabric itself (real Lightning, torch, gloo on CPU).

Jobs run this file as a script (``python test_lightning.py <mode> ...``), one process per
rank with torchrun's environment variables, so every job is a real multi-process Fabric run.
Oracles: the fixtures' ``oracle/full.safetensors`` (gathered in the job that saved them) and
what ``fabric.load`` itself returns at the world size the checkpoint was saved at (4).
"""

import functools
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
FIXTURES = REPO / "tests" / "fixtures"
CASES = ["fabric_fsdp1_w4_f32", "fabric_fsdp1_w4_f32_torch21"]
PY = sys.executable
sys.path.insert(0, str(REPO / "scripts"))
import gen_fixtures as g  # noqa: E402  (the fixtures' model)

# ------------------------------------------------------------------------------------------
# the fixtures' model (scripts/gen_fixtures.py build_model, scale 1), an optimizer with other
# hyperparameters than the fixtures' (loading must overwrite them too)


def build_model() -> Any:
    """gen_fixtures' model at scale 1, every parameter and buffer overwritten with seed-99
    values: deliberately not the fixture's, so loading must overwrite everything."""
    import torch

    model = g.build_model(1, torch.float32)
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.copy_(torch.randn(t.shape, generator=gen))
    return model


def make_optim(model: Any) -> Any:
    import torch

    return torch.optim.AdamW(model.parameters(), lr=0.5, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.3, foreach=False)


# ------------------------------------------------------------------------------------------
# jobs (run as scripts)


def _fsdp_strategy() -> Any:
    """FSDPStrategy as the fixtures were saved with it (scripts/gen_fixtures.py job_fabric):
    device_id=cpu, since Lightning passes None, which FSDP1 rejects on CPU."""
    import torch
    from lightning.fabric.strategies import FSDPStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    class CPUFSDPStrategy(FSDPStrategy):
        def setup_module(self, module: Any) -> Any:
            from lightning.fabric.strategies.fsdp import _move_torchmetrics_to_device, _setup_activation_checkpointing

            module = FSDP(module=module, cpu_offload=self.cpu_offload, mixed_precision=self.mixed_precision_config,
                          sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"), **self._fsdp_kwargs)
            _move_torchmetrics_to_device(module, self.root_device)
            _setup_activation_checkpointing(module, self._activation_checkpointing_kwargs)
            return module

    # each build_model() defines its own Block class, so match blocks by name, not by type
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: type(m).__name__ == "Block")
    return CPUFSDPStrategy(state_dict_type="sharded", auto_wrap_policy=policy,
                           process_group_backend="gloo")


def _mp_strategy(world: int) -> Any:
    from lightning.fabric.strategies import ModelParallelStrategy

    def parallelize(model: Any, mesh: Any) -> Any:
        from torch.distributed.fsdp import fully_shard

        dp = mesh["data_parallel"]
        for b in model.blocks:
            fully_shard(b, mesh=dp)
        fully_shard(model, mesh=dp)
        return model

    return ModelParallelStrategy(parallelize, data_parallel_size=world, tensor_parallel_size=1)


def _fabric(strategy: str, world: int) -> Any:
    from lightning.fabric import Fabric

    if strategy == "single":
        return Fabric(accelerator="cpu", devices=1, precision="32-true")
    st = _fsdp_strategy() if strategy == "fsdp" else _mp_strategy(world)
    fabric = Fabric(accelerator="cpu", devices=world, num_nodes=1, strategy=st, precision="32-true")
    fabric.launch()
    return fabric


_WRAPPERS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def _clean(name: str) -> str:
    return ".".join(p for p in name.split(".") if p not in _WRAPPERS)


def _fsdp1_optimizer_state(model: Any, opt: Any) -> Dict[str, Any]:
    """FSDP1 (use_orig_params): every rank's optimizer state pieces, each at its place in the
    flattened parameter, assembled into full tensors on rank 0 (collective).

    Not get_optimizer_state_dict(full_state_dict=True): with use_orig_params, FSDP1 builds
    it from the keys of rank 0's own optimizer state, and a freshly loaded optimizer holds
    no state for parameters with no elements on its rank (fabric.load's result as well as
    reshard's), so those would be missing from the gathered dict."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    by_param = {id(p): _clean(n) for n, p in model.named_parameters()}
    pieces = []
    for mod_name, m in model.named_modules():
        if not isinstance(m, FSDP) or m._handle is None:
            continue
        fp = m._handle.flat_param
        for fqn, info, p in zip(fp._fqns, fp._shard_param_infos, fp._params):
            st = opt.state.get(p)
            if not st or not info.in_shard:
                continue
            name = _clean(mod_name + "." + fqn if mod_name else fqn)
            assert by_param[id(p)] == name, (by_param[id(p)], name)
            shape = tuple(fp._shapes[fp._fqns.index(fqn)])
            for leaf, v in st.items():
                if v.dim() == 0:
                    pieces.append((name, leaf, shape, None, None, v.clone()))
                else:
                    pieces.append((name, leaf, shape, info.intra_param_start_idx, info.intra_param_end_idx, v.clone()))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, pieces)
    out: Dict[str, Any] = {}
    filled: Dict[str, Any] = {}
    for rank_pieces in everyone:
        for name, leaf, shape, start, end, v in rank_pieces:
            key = f"optimizer.state.{name}.{leaf}"
            if start is None:
                assert key not in out or torch.equal(out[key], v), f"{key} differs between ranks"
                out[key] = v
                continue
            numel = 1
            for d in shape:
                numel *= d
            if key not in out:
                out[key] = torch.empty(numel, dtype=v.dtype)
                filled[key] = torch.zeros(numel, dtype=torch.bool)
            out[key][start:end + 1] = v.reshape(-1)
            filled[key][start:end + 1] = True
            out[key + "#shape"] = shape
    for key, f in filled.items():
        assert bool(f.all()), f"{key}: elements no rank holds"
        out[key] = out[key].reshape(out.pop(key + "#shape"))
    return out


def _full_state(model: Any, opt: Any) -> Dict[str, Any]:
    """The model's and optimizer's full state by the fixtures' flat names (collective)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    o = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=o)
    osd = get_optimizer_state_dict(model, opt, options=o)
    out: Dict[str, Any] = {f"model.{k}": v.clone() for k, v in msd.items()}
    if dist.is_initialized() and dist.get_world_size() > 1 and isinstance(model, FSDP):
        out.update(_fsdp1_optimizer_state(model, opt))
    else:
        for fqn, st in osd.get("state", {}).items():
            for leaf, v in st.items():
                out[f"optimizer.state.{fqn}.{leaf}"] = v.clone()
    groups = [{k: v for k, v in g.items()} for g in osd.get("param_groups", [])]
    return {"tensors": out, "param_groups": groups}


def job_load(strategy: str, world: int, out: str) -> None:
    """Every fixture loaded with reshard.lightning.load under ``strategy`` at ``world``."""
    import torch
    import torch.distributed as dist

    import reshard.lightning

    fabric = _fabric(strategy, world)
    results = {}
    for case in CASES:
        model = fabric.setup_module(build_model())
        opt = fabric.setup_optimizers(make_optim(model))
        state = {"model": model, "optimizer": opt, "step": -1}
        t0 = time.time()
        rem = reshard.lightning.load(fabric, FIXTURES / case / "checkpoint", state)
        took = time.time() - t0
        assert state["model"] is model and state["optimizer"] is opt
        results[case] = dict(_full_state(model._forward_module, opt.optimizer), remainder=rem, step=state["step"], took=took)
    if fabric.global_rank == 0:
        with open(out, "wb") as f:
            pickle.dump(results, f)
    if dist.is_initialized():
        dist.barrier()


def job_oracle_busy(world: int, out: str, stop: str, beat: str) -> None:
    """fabric.load at world 4 with the fixtures' own strategy (the oracle), then all_reduce
    in a loop until ``stop`` exists (every rank leaves on the same iteration)."""
    import torch
    import torch.distributed as dist

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    fabric = _fabric("fsdp", world)
    results = {}
    for case in CASES:
        model = fabric.setup_module(build_model())
        assert len(FSDP.fsdp_modules(model)) == 2, "the root and its block wrapped, as the fixtures were"
        opt = fabric.setup_optimizers(make_optim(model))
        state = {"model": model, "optimizer": opt}
        try:
            rem = fabric.load(FIXTURES / case / "checkpoint", state)
            results[case] = dict(_full_state(model._forward_module, opt.optimizer), remainder=rem)
        except Exception as e:  # recorded; the test says which oracle it used
            results[case] = dict(error=f"{type(e).__name__}: {e}")
            dist.barrier()
    if fabric.global_rank == 0:
        tmp = out + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump(results, f)
        os.replace(tmp, out)
    n = 0
    flag = torch.zeros(1)
    while True:
        flag.zero_()
        if fabric.global_rank == 0 and os.path.exists(stop):
            flag += 1
        x = torch.ones(64)
        dist.all_reduce(x)
        assert float(x[0]) == world
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        n += 1
        if fabric.global_rank == 0 and n % 20 == 0:
            # Written whole and renamed, so the test never reads a half-written count.
            Path(beat + ".tmp").write_text(str(n))
            os.replace(beat + ".tmp", beat)
        if float(flag[0]) > 0:
            break
        time.sleep(0.005)
    dist.destroy_process_group()


def job_single(out: str) -> None:
    """One process, no process group: reshard.lightning.load on one device and
    reshard.torch.load into plain tensors, for every fixture."""
    import torch
    import torch.distributed as dist

    import reshard
    import reshard.lightning
    import reshard.torch

    fabric = _fabric("single", 1)
    results = {}
    for case in CASES:
        path = FIXTURES / case / "checkpoint"
        model = fabric.setup_module(build_model())
        opt = fabric.setup_optimizers(make_optim(model))
        state = {"model": model, "optimizer": opt, "step": -1}
        rem = reshard.lightning.load(fabric, path, state)
        res = dict(_full_state(model._forward_module, opt.optimizer), remainder=rem, step=state["step"])
        ck = reshard.open(path)
        plain = {"model": {t.name[len("model."):]: torch.full(t.shape, -7.0) for t in ck.tensors()
                           if t.name.startswith("model.")}}
        r = reshard.torch.load(plain, path)
        res["plain"] = {f"model.{k}": v for k, v in plain["model"].items()}
        res["plain_result"] = tuple(r)
        results[case] = res
    results["process_group"] = dist.is_initialized()
    with open(out, "wb") as f:
        pickle.dump(results, f)


def _main(argv: List[str]) -> None:
    import torch

    torch.set_num_threads(1)
    mode = argv[0]
    if mode == "load":
        job_load(argv[1], int(argv[2]), argv[3])
    elif mode == "oracle_busy":
        job_oracle_busy(int(argv[1]), argv[2], argv[3], argv[4])
    elif mode == "single":
        job_single(argv[1])
    else:
        raise SystemExit(f"unknown mode {mode}")
    # No interpreter teardown once the work is done: torch 2.15's gloo worker thread can free
    # a finished collective's tensors during Py_Finalize, fail to take the GIL and abort
    # ("terminate called without an active exception"), as test_storage_reader's workers do.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ------------------------------------------------------------------------------------------
# spawning


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: Optional[int] = None, world: Optional[int] = None, port: Optional[int] = None) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
                        "MASTER_PORT", "GROUP_RANK")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONUNBUFFERED="1")
    if rank is not None:
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   NODE_RANK="0", GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


def _start(args: List[str], world: int, logdir: Path) -> List[subprocess.Popen]:
    port = _free_port()
    procs = []
    for r in range(world):
        log = open(logdir / f"{args[0]}_{world}_{r}.log", "wb")
        procs.append(subprocess.Popen([PY, str(HERE)] + args, env=_env(r, world, port), stdout=log,
                                      stderr=subprocess.STDOUT, cwd=str(logdir)))
    return procs


def _wait(procs: List[subprocess.Popen], timeout: float, logdir: Path, what: str) -> None:
    deadline = time.time() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        raise AssertionError(f"{what}: timed out after {timeout} s\n" + _logs(logdir))
    bad = [p.returncode for p in procs if p.returncode != 0]
    assert not bad, f"{what}: exit codes {[p.returncode for p in procs]}\n" + _logs(logdir)


def _logs(logdir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(logdir.glob("*.log")))


def _run(args: List[str], world: int, logdir: Path, timeout: float = 150) -> None:
    _wait(_start(args, world, logdir), timeout, logdir, " ".join(args))


# ------------------------------------------------------------------------------------------
# comparisons


def _bytes_equal(a: Any, b: Any) -> bool:
    import torch

    return (a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def _oracle(case: str) -> Dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(FIXTURES / case / "oracle" / "full.safetensors"))


def _check_tensors(got: Dict[str, Any], case: str, what: str) -> None:
    want = _oracle(case)
    assert sorted(got) == sorted(want), f"{what}: names differ: {sorted(set(got) ^ set(want))}"
    bad = [k for k in want if not _bytes_equal(got[k], want[k])]
    assert not bad, f"{what}: {len(bad)} tensor(s) differ from the oracle: {bad[:5]}"


def _check_groups(groups: List[Dict[str, Any]], what: str) -> None:
    # the fixtures' make_optim (lr 0.01, betas (0.9, 0.95), ...), not this file's (lr 0.5, ...)
    assert len(groups) == 1, what
    g = groups[0]
    assert (g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"], g["initial_lr"]) == (
        0.01, (0.9, 0.95), 1e-08, 0.1, 0.01), f"{what}: param_groups {g}"


# ------------------------------------------------------------------------------------------
# tests

lightning = pytest.importorskip("lightning")


@pytest.fixture(scope="module")
def world4(tmp_path_factory: Any) -> Any:
    """The 4-process job: fabric.load at world 4 (the oracle), then busy with all_reduce."""
    d = tmp_path_factory.mktemp("world4")
    out, stop, beat = d / "oracle.pkl", d / "stop", d / "beat"
    procs = _start(["oracle_busy", "4", str(out), str(stop), str(beat)], 4, d)
    job = dict(procs=procs, dir=d, out=out, stop=stop, beat=beat)
    deadline = time.time() + 120
    while not out.exists():
        if any(p.poll() is not None for p in procs) or time.time() > deadline:
            stop.touch()
            _wait(procs, 30, d, "oracle_busy")
            raise AssertionError("oracle job ended before writing its oracle\n" + _logs(d))
        time.sleep(0.2)
    with open(out, "rb") as f:
        job["oracle"] = pickle.load(f)
    yield job
    stop.touch()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _fabric_oracle(world4: Any, case: str) -> Dict[str, Any]:
    o = world4["oracle"][case]
    assert "error" not in o, f"fabric.load at world 4 failed on {case}: {o['error']}"
    return o


def _check_result(r: Dict[str, Any], world4: Any, case: str, what: str) -> None:
    """One job's load of ``case``: tensors byte-equal to the oracle, the checkpoint's
    param_groups, and the remainder fabric.load returns at 4."""
    _check_tensors(r["tensors"], case, what)
    _check_groups(r["param_groups"], what)
    # "step" was asked for (in state): fabric.load at 4 was not asked, so returned it
    assert r["step"] == 1, what
    assert {**r["remainder"], "step": r["step"]} == _fabric_oracle(world4, case)["remainder"], what


def test_fabric_load_oracle_matches_fixture(world4: Any) -> None:
    """The oracle itself: fabric.load at world 4 gives the fixture's full tensors."""
    for case in CASES:
        o = _fabric_oracle(world4, case)
        _check_tensors(o["tensors"], case, f"fabric.load at 4, {case}")
        _check_groups(o["param_groups"], case)
        assert o["remainder"] == {"step": 1}


@pytest.mark.parametrize("strategy", ["fsdp", "model_parallel"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_load_at_any_world(world4: Any, tmp_path: Path, strategy: str, world: int) -> None:
    """Fabric at ``world`` devices (FSDP1 as the fixture was saved, and ModelParallel/FSDP2)
    loads the 4-rank checkpoints: full params and optimizer state byte-equal the oracle,
    param_groups are the checkpoint's, the remainder is what fabric.load returns at 4."""
    out = tmp_path / "res.pkl"
    _run(["load", "fsdp" if strategy == "fsdp" else "mp", str(world), str(out)], world, tmp_path)
    with open(out, "rb") as f:
        res = pickle.load(f)
    for case in CASES:
        _check_result(res[case], world4, case, f"{strategy} at {world}, {case}")


def test_single_process_while_job_is_busy(world4: Any, tmp_path: Path) -> None:
    """The user's scenario: a 4-process job keeps its process group busy; a separate process
    with no process group loads the same checkpoints (reshard.lightning.load on one device,
    reshard.torch.load into plain tensors) within a timeout and gets the oracle. Then the
    busy job is stopped and exits cleanly."""
    beat = world4["beat"]
    deadline = time.time() + 60
    while not beat.exists() and time.time() < deadline:
        time.sleep(0.1)
    before = int(beat.read_text())
    out = tmp_path / "single.pkl"
    log = open(tmp_path / "single.log", "wb")
    t0 = time.time()
    p = subprocess.Popen([PY, str(HERE), "single", str(out)], env=_env(), stdout=log, stderr=subprocess.STDOUT,
                         cwd=str(tmp_path))
    try:
        p.wait(timeout=90)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        raise AssertionError("single-process load timed out\n" + _logs(tmp_path))
    took = time.time() - t0
    assert p.returncode == 0, _logs(tmp_path)
    after = int(beat.read_text())
    assert after > before, "the busy job's all_reduce loop did not run while the single process loaded"
    assert all(q.poll() is None for q in world4["procs"]), "the busy job ended early\n" + _logs(world4["dir"])
    with open(out, "rb") as f:
        res = pickle.load(f)
    assert res["process_group"] is False
    for case in CASES:
        r = res[case]
        _check_result(r, world4, case, f"single process, {case}")
        want = {k: v for k, v in _oracle(case).items() if k.startswith("model.")}
        assert sorted(r["plain"]) == sorted(want)
        assert all(_bytes_equal(r["plain"][k], want[k]) for k in want)
        assert r["plain_result"] == ([], [])
    print(f"single-process load of {len(CASES)} checkpoints: {took:.1f} s while the job ran {after - before} beats")
    world4["stop"].touch()
    _wait(world4["procs"], 30, world4["dir"], "busy job after stop")


def test_single_device_file_roundtrip(tmp_path: Path) -> None:
    """A single-device Fabric checkpoint (torch.save of the whole dict, optimizer state keyed
    by index): reshard.lightning.load fills a fresh model and optimizer exactly as
    fabric.load does, with the same remainder and requested values; strict semantics too."""
    import torch

    import reshard.lightning

    fabric = _fabric("single", 1)
    src = fabric.setup_module(build_model())
    opt = fabric.setup_optimizers(make_optim(src))
    for _ in range(2):
        loss = src(torch.randint(0, 10, (4, 5))).float().pow(2).mean()
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
    path = tmp_path / "ckpt.pt"
    extra = {"tokens": torch.arange(5), "note": "x", 3: [1, 2]}
    fabric.save(path, {"model": src, "optimizer": opt, "step": 7, "epoch": 2, "extra": extra})

    def fresh() -> Any:
        m = fabric.setup_module(build_model())
        with torch.no_grad():
            for p in m.parameters():
                p.fill_(-1)
        return m, fabric.setup_optimizers(make_optim(m))

    ma, oa = fresh()
    sa = {"model": ma, "optimizer": oa, "step": 0}
    rem_a = fabric.load(path, sa)
    mb, ob = fresh()
    sb = {"model": mb, "optimizer": ob, "step": 0}
    rem_b = reshard.lightning.load(fabric, path, sb)
    assert sb["step"] == sa["step"] == 7
    assert sorted(rem_b) == sorted(rem_a) == ["epoch", "extra"]
    assert rem_b["epoch"] == 2 and rem_b["extra"]["note"] == "x" and rem_b["extra"][3] == [1, 2]
    assert _bytes_equal(rem_b["extra"]["tokens"], rem_a["extra"]["tokens"])
    for (na, ta), (nb, tb) in zip(ma.state_dict().items(), mb.state_dict().items()):
        assert na == nb and _bytes_equal(ta, tb), na
    osa, osb = oa.state_dict(), ob.state_dict()
    assert sorted(osa["state"]) == sorted(osb["state"]) and len(osa["state"]) == 16
    for i in osa["state"]:
        for k in osa["state"][i]:
            assert _bytes_equal(osa["state"][i][k], osb["state"][i][k]), (i, k)
    assert osa["param_groups"] == osb["param_groups"]
    assert osb["param_groups"][0]["lr"] == 0.5 and ob.param_groups[0]["betas"] == (0.8, 0.9)

    # strict: a requested key the checkpoint lacks is a KeyError, as in fabric.load
    mc, oc = fresh()
    with pytest.raises(KeyError):
        fabric.load(path, {"model": mc, "optimizer": oc, "missing": 1})
    with pytest.raises(KeyError, match="missing"):
        reshard.lightning.load(fabric, path, {"model": mc, "optimizer": oc, "missing": 1})
    st = {"model": mc, "missing": 1}
    rem = reshard.lightning.load(fabric, path, st, strict=False)
    assert st["missing"] == 1 and sorted(rem) == ["epoch", "extra", "optimizer", "step"]
    assert all(_bytes_equal(a, b) for a, b in zip(mc.state_dict().values(), ma.state_dict().values()))


def test_sharded_strict_and_remainder() -> None:
    """A sharded folder on one device: requested meta.pt keys move into ``state``, a
    requested key meta.pt lacks is a KeyError unless strict=False, and a state without a
    model is refused under a distributed strategy as Fabric refuses it."""
    import reshard.lightning

    fabric = _fabric("single", 1)
    path = FIXTURES / CASES[0] / "checkpoint"
    m = fabric.setup_module(build_model())
    o = fabric.setup_optimizers(make_optim(m))
    with pytest.raises(KeyError, match="nope"):
        reshard.lightning.load(fabric, path, {"model": m, "optimizer": o, "nope": 0})
    st = {"model": m, "nope": 0}
    assert reshard.lightning.load(fabric, path, st, strict=False) == {"step": 1}
    assert st["nope"] == 0
    st = {"model": m, "step": 0}
    assert reshard.lightning.load(fabric, path, st) == {}
    assert st["step"] == 1
    _check_tensors({**{f"model.{k}": v for k, v in m.module.state_dict().items()},
                    **{k: v for k, v in _oracle(CASES[0]).items() if k.startswith("optimizer.")}},
                   CASES[0], "model only")


if __name__ == "__main__":
    _main(sys.argv[1:])
