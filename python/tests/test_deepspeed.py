"""DeepSpeed ZeRO checkpoints with DeepSpeed itself as the judge (DeepSpeed 0.19.8 on CPU,
gloo, under torchrun; ``scripts/setup_venv.sh --deepspeed`` installs it, CI does):

- every fixture resharded by reshard to another data-parallel degree is loaded by DeepSpeed's
  own ``engine.load_checkpoint`` in a job of that many ranks; the engine's full state right
  after loading (fp32 master weights, Adam moments, buffers, frozen parameters, gathered with
  DeepSpeed's ``safe_get_full_*``) equals the state saved at the source's degree byte for
  byte, and two more training steps give the losses of the run that was not moved;
- the same after changing the ZeRO stage;
- ``reshard.torch.load_model`` / ``load_optimizer`` straight from a ZeRO checkpoint into a
  plain module and into FSDP2 at 2 ranks (no DeepSpeed needed)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import reshard
import reshard.torch as rt

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dist  # noqa: E402
from _util import _quiet, same  # noqa: E402,F401  (_quiet: an autouse fixture)

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "deepspeed"
GEN = REPO / "scripts" / "gen_deepspeed.py"
sys.path.insert(0, str(REPO / "scripts"))
import gen_deepspeed as g  # noqa: E402  (the model and parameter groups the fixtures were made with)

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(
    not HAVE_DEEPSPEED and os.environ.get("CI") != "true",
    reason="DeepSpeed is not installed (scripts/setup_venv.sh --deepspeed)",
)


def info(case: str) -> dict:
    return json.loads((FIX / case / "case.json").read_text())


CASES = sorted(p.name for p in FIX.iterdir() if (p / "case.json").is_file())


def resume(ckpt: Path, case: str, dp: int, work: Path) -> tuple:
    """DeepSpeed's engine at ``dp`` ranks (configured as fixture ``case``) loads ``ckpt`` and
    trains two steps: (the engine's state right after loading, the two losses)."""
    out, dump = work / f"resume-{case}-{dp}.json", work / f"state-{case}-{dp}.safetensors"
    r = subprocess.run(
        [sys.executable, str(GEN), "--resume", str(ckpt), "--case", case, "--dp", str(dp),
         "--json", str(out), "--dump", str(dump)],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return load_file(str(dump)), json.loads(out.read_text())["losses"]


def assert_state(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    bad = [k for k in want if not same(got[k], want[k])]
    assert not bad, f"{what}: differ: {bad}"


def assert_losses(got: list, want: list, what: str, bf16: bool) -> None:
    # The same global batches: equal up to the order of the reductions over the ranks (the
    # loss's mean, the gradients' sum), which bf16 weights and gradients round more coarsely.
    assert got == pytest.approx(want, rel=2e-3 if bf16 else 1e-5), what


@needs_deepspeed
@pytest.mark.parametrize("case", CASES)
def test_deepspeed_loads_a_reshard_output_at_another_degree(case, tmp_path):
    spec = info(case)
    m = 3 if spec["dp"] == 2 else 2
    out = tmp_path / "ckpt"
    summary = reshard.convert(FIX / case / "checkpoint", out, world_size=m, format="deepspeed")
    assert summary["format"] == "deepspeed" and summary["world_size"] == m
    state, losses = resume(out, case, m, tmp_path)
    assert_state(state, load_file(str(FIX / case / "oracle" / "engine.safetensors")), f"{case} at dp {m}")
    want = json.loads((FIX / case / "oracle" / "resume.json").read_text())["losses"]
    assert_losses(losses, want, f"{case} at dp {m}", spec["dtype"] == "bfloat16")


# (source case, target stage, the case whose engine config loads it: same model, that stage)
STAGE_MOVES = [
    ("zero2_dp2_f32_g1", 3, "zero3_dp2_f32_g1"),
    ("zero3_dp2_bf16_g2", 1, "zero1_dp2_bf16_g2"),
]


@needs_deepspeed
@pytest.mark.parametrize("case,stage,loader", STAGE_MOVES)
def test_deepspeed_loads_a_reshard_output_at_another_stage(case, stage, loader, tmp_path):
    out = tmp_path / "ckpt"
    reshard.convert(FIX / case / "checkpoint", out, world_size=3, format="deepspeed", zero_stage=stage)
    state, losses = resume(out, loader, 3, tmp_path)
    assert_state(state, load_file(str(FIX / case / "oracle" / "engine.safetensors")), f"{case} as stage {stage}")
    want = json.loads((FIX / case / "oracle" / "resume.json").read_text())["losses"]
    assert_losses(losses, want, f"{case} as stage {stage}", info(case)["dtype"] == "bfloat16")


def _model(case: str):
    model, groups = g.model_and_groups(info(case))
    return model, torch.optim.AdamW(groups, lr=0.01, betas=(0.9, 0.99), eps=1e-8)


def _moments(model, opt) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, st in opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            t = st[k]
            out[f"optimizer.state.{names[id(p)]}.{k}"] = t.full_tensor() if hasattr(t, "full_tensor") else t
    return out


@pytest.mark.parametrize("case", ["zero1_dp2_bf16_g2_fp32acc", "zero3_dp3_f32_g2", "zero2_dp2_f32_g1"])
def test_load_model_and_optimizer_from_zero_into_a_plain_module(case):
    want = load_file(str(FIX / case / "oracle" / "engine.safetensors"))
    if info(case)["tied"]:
        want["head.weight"] = want["emb.weight"]
    model, opt = _model(case)
    ck = reshard.open(FIX / case / "checkpoint")
    assert ck.format == "deepspeed"
    res = rt.load_model(model, ck)  # DeepSpeed names parameters without a prefix
    assert not res.missing_keys and not res.unexpected_keys
    for n, t in model.state_dict().items():
        # an fp32 model: the fp32 master weights as they are, a bf16 frozen one cast up
        assert same(t, want[n].to(t.dtype)), n
    rt.load_optimizer(model, opt, ck)
    got = _moments(model, opt)
    assert sorted(got) == sorted(k for k in want if k.startswith("optimizer."))
    for k, t in got.items():
        assert same(t, want[k]), k
    fresh = _model(case)[1]
    assert [grp["lr"] for grp in opt.param_groups] == [grp["lr"] for grp in fresh.param_groups]
    assert [grp["weight_decay"] for grp in opt.param_groups] == [grp["weight_decay"] for grp in fresh.param_groups]


def job_fsdp2(rank, world, case):
    from torch.distributed.fsdp import fully_shard

    want = load_file(str(FIX / case / "oracle" / "engine.safetensors"))
    model, _ = g.model_and_groups(info(case))
    fully_shard(model)
    opt = torch.optim.AdamW(g.param_groups(model, info(case)), lr=0.01, betas=(0.9, 0.99), eps=1e-8)
    rt.load_model(model, FIX / case / "checkpoint")
    full = {n: t.full_tensor() if hasattr(t, "full_tensor") else t for n, t in model.state_dict().items()}
    bad = [n for n, t in full.items() if not same(t, want[n].to(t.dtype))]
    rt.load_optimizer(model, opt, FIX / case / "checkpoint")
    for k, t in _moments(model, opt).items():
        if not same(t, want[k]):
            bad.append(k)
    return bad


def test_load_model_from_zero_into_fsdp2_at_two_ranks():
    case = "zero3_dp3_f32_g2"
    for bad in _dist.run(2, job_fsdp2, case, timeout=180):
        assert not bad, bad


def test_open_with_tag_and_model_weights():
    case = FIX / "zero2_dp2_bf16_g2" / "checkpoint"
    a = reshard.open(case)
    b = reshard.open(case, tag="global_step2")
    assert a.keys() == b.keys()
    m = reshard.open(case, weights="model")
    assert m.info("lin.weight").dtype == "BF16" and a.info("lin.weight").dtype == "F32"
    module = load_file(str(FIX / "zero2_dp2_bf16_g2" / "oracle" / "module.safetensors"))
    assert same(m.get_tensor("lin.weight"), module["lin.weight"])
    with pytest.raises(reshard.CheckpointError, match="keeps no model-dtype copy"):
        reshard.open(FIX / "zero3_dp2_f32_g1" / "checkpoint", weights="model")
    with pytest.raises(reshard.RequestError, match="expected master or model"):
        reshard.open(case, weights="half")
    with pytest.raises(reshard.CheckpointError, match="has no checkpoint tagged `nope`"):
        reshard.open(case, tag="nope")


def test_consolidated_for_inference_in_bf16_and_as_hf_folder(tmp_path):
    case = "zero3_dp2_bf16_g2"
    want = load_file(str(FIX / case / "oracle" / "engine.safetensors"))
    out = tmp_path / "model.safetensors"
    reshard.convert(FIX / case / "checkpoint", out, world_size=1, exclude=["optimizer.*"], dtype="bf16")
    got = load_file(str(out))
    params = {k: v for k, v in want.items() if not k.startswith("optimizer.")}
    assert sorted(got) == sorted(params)
    for k, v in params.items():
        # torch's own rounding of the fp32 master weights
        assert same(got[k], v.to(torch.bfloat16)), k
    hf = tmp_path / "hf"
    reshard.convert(FIX / case / "checkpoint", hf, world_size=1, format="hf", exclude=["optimizer.*"],
                    max_shard_size=300)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    for k, v in params.items():
        assert same(load_file(str(hf / index["weight_map"][k]))[k], v), k


def job_fsdp2_from_dcp(rank, world, case, dcp_dir):
    """The DCP output of a ZeRO checkpoint, loaded by torch's own dcp.load into FSDP2's state
    dicts (get_state_dict / set_state_dict): model and optimizer state as DeepSpeed held them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    want = load_file(str(FIX / case / "oracle" / "engine.safetensors"))
    model, _ = g.model_and_groups(info(case))
    fully_shard(model)
    opt = torch.optim.AdamW(g.param_groups(model, info(case)), lr=0.01, betas=(0.9, 0.99), eps=1e-8)
    # a step on zero gradients makes the optimizer's state for get_state_dict to fill
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    msd, osd = get_state_dict(model, opt)
    # DeepSpeed's names: the module's at the top level (as zero_to_fp32 gives them), the
    # optimizer's state dict under "optimizer"
    sd = dict(msd, optimizer=osd)
    dcp.load(sd, checkpoint_id=dcp_dir)
    set_state_dict(model, opt, model_state_dict={k: sd[k] for k in msd}, optim_state_dict=sd["optimizer"])
    bad = []
    for n, t in model.state_dict().items():
        t = t.full_tensor() if hasattr(t, "full_tensor") else t
        if not same(t, want[n].to(t.dtype)):
            bad.append(n)
    for k, t in _moments(model, opt).items():
        if not same(t, want[k]):
            bad.append(k)
    lrs = [grp["lr"] for grp in opt.param_groups]
    return bad, lrs


def test_zero_to_fsdp2_through_dcp_with_torchs_own_loader(tmp_path):
    case = "zero2_dp3_f32_g2"
    out = tmp_path / "dcp"
    reshard.convert(FIX / case / "checkpoint", out, world_size=2, format="dcp")
    assert reshard.open(out).world_size == 2
    results = _dist.run(2, job_fsdp2_from_dcp, case, str(out), timeout=180)
    for bad, lrs in results:
        assert not bad, bad
        assert lrs == [0.01, 0.02]


@pytest.mark.parametrize("case", ["zero1_dp3_f32_g2", "zero3_dp2_bf16_g2"])
def test_zero_to_one_pt_file_for_torch_load_weights_only(case, tmp_path):
    """What zero_to_fp32 gives, as one .pt file: torch.load(weights_only=True) opens it."""
    out = tmp_path / "model.pt"
    reshard.convert(FIX / case / "checkpoint", out, world_size=1)
    sd = torch.load(out, weights_only=True)
    want = load_file(str(FIX / case / "oracle" / "engine.safetensors"))
    for k, v in want.items():
        if k.startswith("optimizer.state."):
            name, key = k[len("optimizer.state."):].rsplit(".", 1)
            got = sd["optimizer"]["state"][name][key]
        else:
            got = sd[k]
        assert same(got, v), k
    assert sd["global_steps"] == 2 and sd["epoch"] == 3
    assert sd["optimizer"]["param_groups"][0]["lr"] == 0.01
    assert sd["ds_config"]["train_batch_size"] == 6
