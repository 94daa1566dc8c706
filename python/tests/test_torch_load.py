"""reshard.torch.load / load_model / load_optimizer with real torch: every DCP fixture into
FSDP2 (and FSDP1, and a 2-D dp x tp) models at other world sizes in gloo processes, equal to
the live job's gather byte for byte; training resumed at another world size continues as
the uninterrupted run; plain tensors with no process group (DCP, .pt, safetensors, strided
and cast targets); errors that leave the state dict untouched; and no collectives."""

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard
import reshard.torch as rt

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dist  # noqa: E402
from _util import _quiet, same  # noqa: E402,F401  (_quiet: an autouse fixture)

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures"
SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(SCRIPTS))
import gen_fixtures as g  # noqa: E402  (the model, optimizer and data the fixtures were made with)


# --- helpers (used in the test process and in the gloo processes) ----------------------------
def oracle(case: str) -> dict:
    return load_file(str(FIX / case / "oracle" / "full.safetensors"))


def nontensor(case: str) -> dict:
    return json.loads((FIX / case / "oracle" / "nontensor.json").read_text())


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor"


def _is_sharded(t) -> bool:
    return type(t).__name__ == "ShardedTensor"


def scribble(t: torch.Tensor) -> None:
    """Overwrite a tensor's memory (a DTensor's local shard, a ShardedTensor's local shards)
    with 0xA5 bytes, a value no checkpoint holds."""
    if _is_dtensor(t):
        return scribble(t._local_tensor)
    if _is_sharded(t):
        for s in t.local_shards():
            scribble(s.tensor)
        return
    x = t.detach()
    junk = torch.empty(x.shape, dtype=x.dtype)
    junk.reshape(-1).view(torch.uint8).fill_(0x01 if x.dtype == torch.bool else 0xA5)
    with torch.no_grad():
        x.copy_(junk)


def scribble_all(model, opt=None) -> None:
    for t in list(model.parameters()) + list(model.buffers()):
        scribble(t)
    if opt is not None:
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    scribble(v)


def full(t) -> torch.Tensor:
    if _is_dtensor(t):
        return t.full_tensor()  # collective
    if _is_sharded(t):
        return g.gather_sharded_tensor(t)  # collective
    return t


def expected_param_groups(case: str) -> list:
    """The checkpoint's optimizer param_groups, from the oracle's non-tensor values (one item,
    or one per leaf)."""
    nt = nontensor(case)
    if "optimizer.param_groups" in nt:
        return nt["optimizer.param_groups"]
    groups: dict = {}
    for k, v in nt.items():
        if k.startswith("optimizer.param_groups."):
            i, key = k[len("optimizer.param_groups."):].split(".", 1)
            groups.setdefault(int(i), {})[key] = v
    return [groups[i] for i in sorted(groups)]


def check_against_oracle(case: str, model, opt, fsdp1: bool = False) -> int:
    """Every parameter, buffer and optimizer state of ``model``/``opt`` gathered whole equals
    the oracle byte for byte, every oracle model/optimizer tensor was checked, and the
    param_groups hold the checkpoint's values. Collective. Returns the tensors checked."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True) if fsdp1 else None
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, opt, options=opts)
    want = oracle(case)
    seen = set()
    for k, v in msd.items():
        name = "model." + k
        got = full(v)
        assert same(got, want[name]), f"{case}: {name}: {got.dtype}{tuple(got.shape)} differs from the oracle"
        seen.add(name)
    for fqn, st in osd["state"].items():
        for n, v in st.items():
            name = f"optimizer.state.{fqn}.{n}"
            got = full(v)
            assert same(got, want[name]), f"{case}: {name} differs from the oracle"
            seen.add(name)
    expected = {k for k in want if k.startswith(("model.", "optimizer."))}
    assert seen == expected, f"{case}: not compared {sorted(expected - seen)}, not in oracle {sorted(seen - expected)}"
    groups = osd["param_groups"]
    for i, grp in enumerate(expected_param_groups(case)):
        for key, val in grp.items():
            have = g.jsonify(groups[i][key])
            if key == "params":  # FQNs, in the optimizer's own order
                have, val = sorted(have), sorted(val)
            assert have == val, f"{case}: param_groups[{i}][{key!r}] = {have!r}, checkpoint {val!r}"
    return len(seen)


def case_model_args(case: str):
    """(dtype, hidden, tied) of the model the fixture was saved from, read off its oracle."""
    want = oracle(case)
    return (want["model.embed.weight"].dtype, want["model.blocks.0.fc1.bias"].shape[0],
            "model.lm_head.weight" in want)


def build_fsdp2(world: int, dtype=torch.float32, hidden: int = 13, tied: bool = False):
    """The fixtures' model, FSDP2-sharded (fully_shard per block, then the root) over a 1-D
    mesh of ``world`` ranks, with its AdamW and StepLR (as scripts/gen_fixtures.py builds
    them)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = g.build_model(1, dtype, hidden=hidden, tied=tied)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt, sched = g.make_optim(model)
    return model, opt, sched


def build_fsdp1(dtype=torch.float32, hidden: int = 13):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = g.build_model(1, dtype, hidden=hidden)
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({type(model.blocks[0])}), device_id=torch.device("cpu"))
    opt, _sched = g.make_optim(model)
    return model, opt


def build_2d(world: int):
    """gen_fixtures' dtensor2d model: TP (qkv/fc1 colwise, proj/fc2 rowwise) on tp, then
    FSDP2 on dp, over a (dp=2, tp=world/2) mesh; hidden width 14."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    model = g.parallelize_2d(g.build_model(1, torch.float32, hidden=14), mesh)
    opt, _sched = g.make_optim(model)
    return mesh, model, opt


def _init_optimizer_state(model, opt) -> None:
    """AdamW makes its state at the first step: make it now (as get_optimizer_state_dict
    does), so that it can be scribbled over before the load."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    get_optimizer_state_dict(model, opt)


def _no_step(*args, **kwargs):
    raise AssertionError("the optimizer stepped: load_optimizer was to make a fresh optimizer's state without a step")


def prepare(model, opt, fresh: bool) -> None:
    """Scribble over the model. ``fresh``: leave the optimizer without state and forbid it
    to step (load_optimizer makes the state itself, reading into it); otherwise make its
    state now and scribble over that too."""
    if fresh:
        assert not opt.state
        opt.step = _no_step
    else:
        _init_optimizer_state(model, opt)
    scribble_all(model, None if fresh else opt)


def load_and_check(case: str, world: int, kind: str, fresh: bool) -> str:
    """Load fixture ``case`` into a fresh model of ``kind`` (fsdp2, fsdp1) at ``world`` ranks
    through load_model + load_optimizer (its optimizer without state when ``fresh``), and
    compare with the oracle."""
    dtype, hidden, tied = case_model_args(case)
    if kind == "fsdp2":
        model, opt, _ = build_fsdp2(world, dtype, hidden, tied)
    else:
        model, opt = build_fsdp1(dtype, hidden)
    if any("initial_lr" not in grp for grp in expected_param_groups(case)):
        # saved without a scheduler: the target's StepLR entry has no value to get
        for grp in opt.param_groups:
            grp.pop("initial_lr", None)
    prepare(model, opt, fresh)
    ck = FIX / case / "checkpoint"
    r1 = rt.load_model(model, ck)
    r2 = rt.load_optimizer(model, opt, ck)
    assert r1 == ([], []) and r2 == ([], []), (r1, r2)
    if kind == "fsdp2":
        assert _is_dtensor(model.embed.weight)
    n = check_against_oracle(case, model, opt, fsdp1=(kind == "fsdp1"))
    return f"{case}:{kind}{':fresh' if fresh else ''}:{n}"


def load_2d_and_check(case: str, world: int) -> str:
    """dtensor2d_w4 into the dp x tp model (placements with _StridedShard) and its manual
    2-D DTensors into fresh DTensors of the same placements."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh, model, opt = build_2d(world)
    strided = [n for n, p in model.named_parameters() if any(type(x).__name__ == "_StridedShard" for x in p.placements)]
    assert strided, "the 2-D model has no _StridedShard parameter"
    prepare(model, opt, fresh=True)
    ck = FIX / case / "checkpoint"
    assert rt.load_model(model, ck) == ([], [])
    assert rt.load_optimizer(model, opt, ck) == ([], [])
    n = check_against_oracle(case, model, opt)

    want = oracle(case)
    S0, S1, R = Shard(0), Shard(1), Replicate()
    placements = {"s0_s1": [S0, S1], "s1_s0": [S1, S0], "s0_r": [S0, R], "r_s1": [R, S1], "r_r": [R, R],
                  "int_s0_r": [S0, R]}
    tensors = {k: distribute_tensor(torch.zeros_like(want["tensors." + k]), mesh, p) for k, p in placements.items()}
    for t in tensors.values():
        scribble(t)
    assert rt.load({"tensors": tensors}, ck) == ([], [])
    for k, t in tensors.items():
        assert same(t.full_tensor(), want["tensors." + k]), k
    return f"{case}:2d:{n + len(tensors)} strided={len(strided)}"


def load_sharded_tensors_and_check(case: str, world: int) -> str:
    """torch21_shardedtensor_w3 (plain ShardedTensors, no model) into ShardedTensors chunked
    over ``world`` ranks (some ranks hold no shard), plain tensors and a value, by load."""
    import torch.distributed as dist
    from torch.distributed._shard.sharded_tensor import empty as sharded_empty
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec

    want = oracle(case)
    ranks = [f"rank:{r}/cpu" for r in range(world)]
    sd: dict = {"sharded": {}, "plain": {}, "py": "PLACEHOLDER"}
    for name, t in want.items():
        group, key = name.split(".", 1)
        if group == "sharded":
            dim = int(key.split("_dim", 1)[1][0])
            st = sharded_empty(ChunkShardingSpec(dim=dim, placements=ranks), *t.shape, dtype=t.dtype)
            sd["sharded"][key] = st
        else:
            sd["plain"][key] = torch.empty_like(t)
        scribble(sd[group][key])
    res = rt.load(sd, FIX / case / "checkpoint")
    assert res == ([], []), res
    empty_ranks = sum(1 for st in sd["sharded"].values() if not st.local_shards())
    for name, t in want.items():
        group, key = name.split(".", 1)
        assert same(full(sd[group][key]), t), name
    assert sd["py"] == nontensor(case)["py"]
    counts = [None] * world
    dist.all_gather_object(counts, empty_ranks)
    return f"{case}:sharded:{len(want)} no-shard={sum(counts)}"


def job_fixtures(rank: int, world: int, plan: list) -> list:
    """Run ``plan`` ([(case, kind)]) in every rank of a gloo job."""
    out = []
    for i, (case, kind) in enumerate(plan):
        t0 = time.monotonic()
        if kind in ("fsdp2", "fsdp1"):
            # half the FSDP2 cases into a fresh optimizer, half into one with state (FSDP1
            # makes a fresh optimizer's state by torch's zero-gradient step)
            what = load_and_check(case, world, kind, fresh=kind == "fsdp2" and (world + i) % 2 == 1)
        elif kind == "2d":
            what = load_2d_and_check(case, world)
        elif kind == "sharded":
            what = load_sharded_tensors_and_check(case, world)
        else:
            raise ValueError(kind)
        out.append(f"{what} {time.monotonic() - t0:.2f}s")
    return out


# --- (1) every DCP fixture at M in {1, 2, 3, 4, 5} gloo processes ----------------------------
MATRIX = {
    1: [("fsdp2_w4_f32", "fsdp2"), ("fabric_fsdp1_w4_f32_torch21", "fsdp2"), ("fsdp2_w2_f32_zstd", "fsdp2")],
    2: [("fsdp2_w3_bf16", "fsdp2"), ("fsdp1_w4_f32", "fsdp1"), ("fsdp2_w4_f32_shard1", "fsdp2"),
        ("fsdp2_w2_tied", "fsdp2"), ("fsdp2_w4_f32_threads2", "fsdp2")],
    3: [("fsdp2_w2_f32", "fsdp2"), ("fabric_fsdp1_w4_f32", "fsdp2"), ("fsdp1_w4_f32", "fsdp2"),
        ("fsdp2_w4_f32", "fsdp1"), ("dtensor2d_w4", "fsdp2"), ("fsdp2_w2_f32_nocoll", "fsdp2"),
        ("fmt_fs_safetensors_w2", "fsdp2"), ("fsdp2_w2_perrank", "fsdp2")],
    4: [("dtensor2d_w4", "2d")],
    5: [("fsdp2_w4_f32", "fsdp2"), ("fsdp2_w3_bf16", "fsdp2"), ("fabric_fsdp1_w4_f32_torch21", "fsdp2"),
        ("torch21_shardedtensor_w3", "sharded")],
}


def test_matrix_covers_every_dcp_fixture():
    dcp_cases = {d.name for d in FIX.iterdir()
                 if (d / "checkpoint").is_dir() and any(p.suffix == ".distcp" for p in (d / "checkpoint").iterdir())}
    covered = {case for plan in MATRIX.values() for case, _ in plan}
    assert dcp_cases - covered == set()
    assert {kind for plan in MATRIX.values() for _, kind in plan} == {"fsdp2", "fsdp1", "2d", "sharded"}


@pytest.mark.parametrize("world", sorted(MATRIX))
def test_fixtures_into_models(world):
    """Each fixture of the row into a fresh FSDP2 / FSDP1 / 2-D model at ``world`` gloo
    processes through load_model + load_optimizer (into optimizers with and without state):
    every parameter's and optimizer state's full tensor equals the oracle byte for byte, on
    every rank."""
    results = _dist.run(world, job_fixtures, MATRIX[world], timeout=180)
    assert all(len(r) == len(MATRIX[world]) for r in results)
    print(f"\nworld {world}: " + "; ".join(results[0]))


# --- (2) no collective: one rank loads while the other waits outside any collective ----------
def job_alone(rank: int, world: int, flag_dir: str) -> str:
    """Both ranks build the FSDP2 model; then rank 0 loads (load_model, load_optimizer and a
    DTensor dict through load) while rank 1 waits for a file rank 0 writes when done, and
    only then loads. A collective in rank 0's load would wait for rank 1, which waits for
    rank 0: the job would not finish. Both then check against the oracle (collective)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    case = "fsdp2_w4_f32"
    dtype, hidden, tied = case_model_args(case)
    model, opt, _ = build_fsdp2(world, dtype, hidden, tied)
    _init_optimizer_state(model, opt)
    scribble_all(model, opt)
    want = oracle(case)
    extra = {"tensors": {}}
    extra_names = [k for k in want if k.startswith("model.blocks.0.fc") and k.endswith("weight")]
    for k in extra_names:
        extra["tensors"][k] = distribute_tensor(torch.zeros_like(want[k]), model.embed.weight.device_mesh, [Shard(1)])
        scribble(extra["tensors"][k])
    ck = FIX / case / "checkpoint"
    done = Path(flag_dir) / "rank0-done"
    if rank == 1:
        deadline = time.monotonic() + 60
        while not done.exists():
            assert time.monotonic() < deadline, "rank 0 did not finish loading on its own: it waited on a collective"
            time.sleep(0.05)
    assert rt.load_model(model, ck) == ([], [])
    assert rt.load_optimizer(model, opt, ck) == ([], [])
    assert rt.load(extra, ck, rename=lambda n: "tensors." + n if n in extra_names else None) == ([], [])
    if rank == 0:
        done.write_text("ok")
    n = check_against_oracle(case, model, opt)
    for k, t in extra["tensors"].items():
        assert same(t.full_tensor(), want[k]), k
    return f"rank {rank}: {n} tensors + {len(extra_names)} Shard(1) DTensors"


def test_ranks_load_alone_without_collectives(tmp_path):
    results = _dist.run(2, job_alone, str(tmp_path), timeout=150)
    assert results[1].startswith("rank 1")


# --- (3) training continues at another world size ------------------------------------------
GLOBAL_BATCH = 8


def global_batch(step: int):
    dm = g.dims(1)
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, dm["vocab"], (GLOBAL_BATCH, 5), generator=gen)
    labels = torch.randint(0, dm["classes"], (GLOBAL_BATCH,), generator=gen)
    return tokens, labels


def train_step(model, opt, sched, step: int, rank: int, world: int) -> float:
    """One step on this rank's equal share of the global batch; the global mean loss."""
    import torch.distributed as dist
    import torch.nn.functional as F

    tokens, labels = global_batch(step)
    n = GLOBAL_BATCH // world
    loss = F.cross_entropy(model(tokens[rank * n:(rank + 1) * n]).float(), labels[rank * n:(rank + 1) * n])
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / world


def full_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out = {"model." + k: full(v).detach().clone() for k, v in get_model_state_dict(model).items()}
    for fqn, st in get_optimizer_state_dict(model, opt)["state"].items():
        for n, v in st.items():
            out[f"optimizer.state.{fqn}.{n}"] = full(v).detach().clone()
    return out


def job_train_and_save(rank: int, world: int, ckpt: str, saved: str) -> list:
    """World 4: two steps, dcp.save (model, optimizer, scheduler), the full state written as
    an oracle, then two more steps: their losses are the uninterrupted run's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model, opt, sched = build_fsdp2(world)
    for step in range(2):
        train_step(model, opt, sched, step, rank, world)
    dcp.save({"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt),
              "scheduler": sched.state_dict()}, checkpoint_id=ckpt)
    state = full_state(model, opt)
    if rank == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, saved)
    return [train_step(model, opt, sched, step, rank, world) for step in (2, 3)]


def job_resume(rank: int, world: int, ckpt: str, saved: str) -> list:
    """World ``world``: a fresh model (another seed) resumed through reshard; its state equals
    the saved one byte for byte; then the same two steps."""
    torch.manual_seed(12345)
    model, opt, sched = build_fsdp2(world)
    if world == 2:
        # state made beforehand and scribbled over; at world 1 load_optimizer makes it
        _init_optimizer_state(model, opt)
    scribble_all(model, opt)
    assert bool(opt.state) == (world == 2)
    assert rt.load_model(model, ckpt) == ([], [])
    assert rt.load_optimizer(model, opt, ckpt) == ([], [])
    assert rt.load({"scheduler": sched}, ckpt) == ([], [])  # a Stateful, through its own state dict
    want = load_file(saved)
    got = full_state(model, opt)
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not same(got[k], want[k])]
    assert not bad, f"resumed state differs from the saved one: {bad}"
    assert sched.last_epoch == 2 and opt.param_groups[0]["lr"] == pytest.approx(0.01 * 0.25)
    return [train_step(model, opt, sched, step, rank, world) for step in (2, 3)]


def test_training_continues_at_another_world_size(tmp_path):
    ckpt, saved = str(tmp_path / "ckpt"), str(tmp_path / "saved.safetensors")
    base = _dist.run(4, job_train_and_save, ckpt, saved, timeout=150)[0]
    for world in (2, 1):
        resumed = _dist.run(world, job_resume, ckpt, saved, timeout=150)[0]
        # the same samples and weights: only the order of the gradient reduction differs
        assert resumed == pytest.approx(base, rel=1e-5, abs=1e-6), (world, resumed, base)
        print(f"\nlosses of steps 3, 4: world 4 {base}, resumed at {world} {resumed}")


# --- (4) plain tensors in a process with no process group ------------------------------------
def nested(flat: dict) -> dict:
    out: dict = {}
    for name, t in flat.items():
        node = out
        parts = name.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = t
    return out


def at(tree: dict, name: str):
    for p in name.split("."):
        tree = tree[p]
    return tree


def junk_like(t: torch.Tensor) -> torch.Tensor:
    x = torch.empty_like(t)
    scribble(x)
    return x


def test_plain_tensors_without_a_process_group(tmp_path):
    """Whole tensors from a DCP folder, a .pt, a .safetensors and an HF storage folder into
    flat and nested state dicts: equal to the oracle; no process group is made."""
    import torch.distributed as dist

    want = oracle("fsdp2_w4_f32")
    model_names = [k for k in want if k.startswith("model.")]
    src = FIX / "fsdp2_w4_f32" / "checkpoint"
    pt, st = tmp_path / "m.pt", tmp_path / "m.safetensors"
    reshard.convert(src, pt, world_size=1, include=["model.*"])
    reshard.convert(src, st, world_size=1, include=["model.*"])
    for path in (src, pt, st):
        sd = {k: junk_like(want[k]) for k in model_names}
        assert rt.load(sd, path) == ([], []), path
        assert all(same(sd[k], want[k]) for k in model_names), path
        deep = nested({k: junk_like(want[k]) for k in model_names})
        assert rt.load(deep, path) == ([], []), path
        assert all(same(at(deep, k), want[k]) for k in model_names), path
    hf_want = oracle("hf_storage_w4_f32")
    hf = {k: junk_like(v) for k, v in hf_want.items()}
    assert rt.load(hf, FIX / "hf_storage_w4_f32" / "checkpoint") == ([], [])
    assert all(same(hf[k], hf_want[k]) for k in hf_want)
    assert not dist.is_initialized()


def _small_model(seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def _trained_optimizer(cls, **kw):
    """An optimizer ``cls`` after two steps on a small plain model, and the state to save in
    the trainers' layout ({"model": ..., "optimizer": ...}, names as keys)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = _small_model(5)
    opt = cls(model.parameters(), **kw)
    for _ in range(2):
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt, {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}


def _fresh_like(cls, **kw):
    model = _small_model(6)
    return model, cls(model.parameters(), **kw)


def _opt_state(opt) -> dict:
    return {f"{i}.{k}": v for i, st in enumerate(opt.state.values()) for k, v in st.items()}


@pytest.mark.parametrize("cls,kw,made", [
    (torch.optim.AdamW, dict(lr=0.1, weight_decay=0.3), {"step", "exp_avg", "exp_avg_sq"}),
    (torch.optim.Adam, dict(lr=0.1, amsgrad=True, weight_decay=0.1), {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9), {"momentum_buffer"}),
    (torch.optim.Adafactor, dict(lr=0.1), None),  # row/column factors: not parameter-shaped
])
def test_fresh_optimizer_state(tmp_path, cls, kw, made):
    """load_optimizer into an optimizer without state: made without a step where the state
    is parameter-shaped and scalar tensors (else torch's own way), equal to the saved state
    byte for byte, dtypes included; a failing load leaves it without state; with
    strict=False, state the checkpoint lacks is zero."""
    src_opt, saved = _trained_optimizer(cls, **kw)
    path = tmp_path / "ckpt.pt"
    torch.save(saved, path)
    want = _opt_state(src_opt)

    model, opt = _fresh_like(cls, **kw)
    got = rt._make_optimizer_state(opt)
    if made is None:
        assert got is None and not opt.state
    else:
        assert len(got) == 6 and all(set(st) == made for st in opt.state.values())
        opt.state.clear()
        opt.step = _no_step
    assert rt.load_model(model, path) == ([], [])
    assert rt.load_optimizer(model, opt, path) == ([], [])
    have = _opt_state(opt)
    assert sorted(have) == sorted(want)
    assert all(same(have[k], want[k]) for k in want), [k for k in want if not same(have[k], want[k])]
    assert opt.param_groups[0]["lr"] == 0.1

    if made is None:
        return
    model, opt = _fresh_like(cls, **kw)
    with pytest.raises(reshard.RequestError, match="not in it"):
        rt.load_optimizer(model, opt, path, prefix="optim.")
    assert not opt.state, "a failed load left state in the optimizer"

    key = sorted(made - {"step"})[0]
    state = {n: dict(st) for n, st in saved["optimizer"]["state"].items()}
    del state["0.weight"][key]
    if not state["0.weight"]:
        del state["0.weight"]  # an empty dict would be stored as a value, replacing the state
    part = {"model": saved["model"], "optimizer": {"state": state, "param_groups": saved["optimizer"]["param_groups"]}}
    torch.save(part, tmp_path / "part.pt")
    model, opt = _fresh_like(cls, **kw)
    opt.step = _no_step
    res = rt.load_optimizer(model, opt, tmp_path / "part.pt", strict=False)
    assert res.missing_keys == [f"state.0.weight.{key}"]
    first = opt.state[model[0].weight]
    assert torch.count_nonzero(first[key]) == 0 and first[key].shape == model[0].weight.shape
    have = _opt_state(opt)
    assert all(same(have[k], want[k]) for k in want if k != f"0.{key}")


def test_strided_and_cast_destinations():
    """A non-contiguous destination is filled through a staging buffer and copy_; a bf16
    destination of an f32 tensor gets torch's own rounding; non-tensor values replace."""
    want = oracle("fsdp2_w4_f32")
    w = want["model.blocks.0.qkv.weight"]  # (36, 12)
    t = torch.empty(w.shape[1], w.shape[0]).t()  # strided view
    assert not t.is_contiguous()
    scribble(t)
    b = torch.empty(w.shape, dtype=torch.bfloat16)
    sd = {"model": {"blocks": {"0": {"qkv": {"weight": t}}}}, "bf16": b, "sched": None}
    ptr = t.data_ptr()
    res = rt.load(sd, FIX / "fsdp2_w4_f32" / "checkpoint", strict=False)
    assert res.missing_keys == ["bf16", "sched"]
    assert t.data_ptr() == ptr and same(t.contiguous(), w)
    res = rt.load({"bf16": b}, FIX / "fsdp2_w4_f32" / "checkpoint", strict=False,
                  rename=lambda n: "bf16" if n == "model.blocks.0.qkv.weight" else None)
    assert res == ([], [])
    assert same(b, w.to(torch.bfloat16))
    nt = nontensor("fsdp2_w4_f32")
    vals = {k: None for k in nt if k.count(".") == 0}
    assert vals, "the fixture has top-level values"
    rt.load(vals, FIX / "fsdp2_w4_f32" / "checkpoint", strict=False)
    assert all(g.jsonify(vals[k]) == nt[k] for k in vals)


def test_progress_reports_the_bytes_read(capsys):
    """``progress=``: a callable gets (0, total) first and (total, total) last, never going
    back, total being the bytes of the destinations; ``True`` reports on stderr (or tqdm)."""
    want = oracle("fsdp2_w4_f32")
    sd = {k: torch.empty_like(v) for k, v in want.items() if k.startswith("model.")}
    total = sum(v.numel() * v.element_size() for v in sd.values())
    seen = []
    rt.load(sd, FIX / "fsdp2_w4_f32" / "checkpoint", strict=False, progress=lambda d, t: seen.append((d, t)))
    assert seen[0] == (0, total) and seen[-1] == (total, total), seen
    assert all(a[0] <= b[0] and a[1] == total for a, b in zip(seen, seen[1:]))
    assert all(same(sd[k], want[k]) for k in sd)
    # through a recipe's views too, and the same for load_model's keyword
    seen.clear()
    hf = {"model.norm.weight": torch.zeros(16)}
    rt.load(hf, FIX / "frameworks" / "llama_tp2" / "torch_dist", recipe="llama", strict=False,
            progress=lambda d, t: seen.append((d, t)))
    assert seen[0] == (0, 64) and seen[-1] == (64, 64), seen
    rt.load(sd, FIX / "fsdp2_w4_f32" / "checkpoint", strict=False, progress=True)
    assert "reshard" in capsys.readouterr().err


# --- (5) bad inputs: the right exception, one line, and the state dict untouched -------------
def _model_sd(want: dict) -> dict:
    return {k: junk_like(want[k]) for k in want if k.startswith("model.")}


def _untouched(sd: dict) -> bool:
    return all(same(v, junk_like(v)) for v in sd.values())


def test_bad_inputs(tmp_path):
    want = oracle("fsdp2_w4_f32")
    good = FIX / "fsdp2_w4_f32" / "checkpoint"

    def one_line(e) -> str:
        msg = str(e.value)
        assert "\n" not in msg, msg
        return msg

    # a rank file missing
    ck = tmp_path / "missing-rank"
    shutil.copytree(good, ck)
    os.remove(ck / "__1_0.distcp")
    sd = _model_sd(want)
    with pytest.raises(reshard.CheckpointError) as e:
        rt.load(sd, ck)
    assert "__1_0.distcp" in one_line(e) and _untouched(sd)

    # a truncated item
    ck = tmp_path / "truncated"
    shutil.copytree(good, ck)
    f = ck / "__2_0.distcp"
    f.write_bytes(f.read_bytes()[: f.stat().st_size - 100])
    sd = _model_sd(want)
    with pytest.raises(reshard.CheckpointError) as e:
        rt.load(sd, ck)
    assert "__2_0.distcp" in one_line(e) and _untouched(sd)

    # a wrong shape in the state dict: nothing is read
    sd = _model_sd(want)
    sd["model.embed.weight"] = junk_like(torch.zeros(10, 13))
    with pytest.raises(reshard.RequestError) as e:
        rt.load(sd, good)
    msg = one_line(e)
    assert "model.embed.weight" in msg and "[10, 12]" in msg and "[10, 13]" in msg and _untouched(sd)

    # a key the checkpoint lacks, strict: nothing is read; not strict: the rest is
    sd = _model_sd(want)
    sd["model.nope.weight"] = junk_like(torch.zeros(2))
    with pytest.raises(reshard.RequestError) as e:
        rt.load(sd, good)
    msg = one_line(e)
    assert "`model.nope.weight`" in msg and "strict=False" in msg and str(good) in msg and _untouched(sd)
    res = rt.load(sd, good, strict=False)
    assert res == (["model.nope.weight"], [])
    assert all(same(sd[k], want[k]) for k in sd if k != "model.nope.weight")

    # a checkpoint entry the state dict lacks under its top-level keys, strict
    sd = _model_sd(want)
    del sd["model.head.bias"]
    with pytest.raises(reshard.RequestError, match="model.head.bias"):
        rt.load(sd, good)
    assert rt.load(sd, good, strict=False) == ([], ["model.head.bias"])

    # load_model with the wrong prefix names what it looked for
    model = g.build_model(1, torch.float32)
    with pytest.raises(reshard.RequestError) as e:
        rt.load_model(model, good, prefix="net.")
    msg = one_line(e)
    assert "not in it" in msg and "`embed.weight`" in msg, msg

    # not a state dict; a meta-device target
    with pytest.raises(reshard.RequestError):
        rt.load([1, 2], good)
    with pytest.raises(reshard.RequestError, match="meta device"):
        rt.load({"model.head.bias": torch.empty(5, device="meta")}, good, strict=False)
    assert issubclass(reshard.RequestError, reshard.ReshardError)


def test_state_dict_api_needed(monkeypatch):
    """Without torch.distributed.checkpoint.state_dict (torch 2.1), load_optimizer raises
    RequestError saying what it needs; load, and load_model into a plain module (which reads
    into its parameters without that API), work on."""
    monkeypatch.setitem(sys.modules, "torch.distributed.checkpoint.state_dict", None)
    model = torch.nn.Linear(2, 2)
    ck = FIX / "fsdp2_w4_f32" / "checkpoint"
    with pytest.raises(reshard.RequestError, match=r"needs torch >= 2.2") as e:
        rt.load_optimizer(model, torch.optim.SGD(model.parameters()), ck)
    assert "\n" not in str(e.value)
    # a plain module: its state dict read in place (here nothing matches: all missing)
    assert rt.load_model(model, ck, strict=False).missing_keys == ["weight", "bias"]
    w = {"model.head.bias": torch.empty(5)}
    assert rt.load(w, ck, strict=False).missing_keys == []


class _WithExtra(torch.nn.Module):
    """A module with a tied weight, a buffer and an ``_extra_state`` entry."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(6, 4)
        self.lin = torch.nn.Linear(4, 3)
        self.head = torch.nn.Linear(4, 6, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.ones(3))
        self.extra = {"calls": 0}

    def get_extra_state(self):
        return dict(self.extra)

    def set_extra_state(self, state):
        self.extra = dict(state)


def test_load_model_reads_a_plain_modules_parameters_in_place(tmp_path):
    """A plain module's parameters and buffers get the checkpoint's bytes in their own
    memory (no copy through a state dict); a value entry (``_extra_state``) is set through
    ``load_state_dict``; tied weights stay tied."""
    torch.manual_seed(3)
    src = _WithExtra()
    with torch.no_grad():
        src.scale.mul_(2.5)
    src.extra = {"calls": 7}
    torch.save(src.state_dict(), tmp_path / "m.pt")
    for path in (tmp_path / "m.pt",):
        torch.manual_seed(4)
        model = _WithExtra()
        ptrs = {n: t.data_ptr() for n, t in model.state_dict().items() if torch.is_tensor(t)}
        assert rt.load_model(model, path) == ([], [])
        for n, t in model.state_dict().items():
            if torch.is_tensor(t):
                assert torch.equal(t, src.state_dict()[n]), n
                assert t.data_ptr() == ptrs[n], f"{n}: not read in place"
        assert model.head.weight is model.emb.weight
        assert model.extra == {"calls": 7}
