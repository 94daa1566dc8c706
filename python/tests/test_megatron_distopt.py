"""The distributed optimizer's state of Megatron-LM checkpoints, judged by megatron-core itself
(``tests/fixtures/megatron_distopt``, written by ``scripts/gen_megatron_distopt.py``: a tiny GPT
trained two Adam steps by megatron-core's DistributedDataParallel + DistributedOptimizer at TP 2
x DP 2, saved as Megatron-LM's legacy files with ``distrib_optim.pt`` and as ``torch_dist`` with
the ``fully_reshardable`` optimizer format).

- legacy -> torch_dist: reshard's output is megatron-core's own ``fully_reshardable`` save of the
  same state byte for byte (layers stacked, ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>``),
  and megatron-core loads it into a GPTModel + DistributedOptimizer with the weights, state and
  param_groups it loads from its own save; its ``common.pt`` holds the optimizer's param_groups
  and sharding type as megatron-core's;
- GroupedMLP experts (``gg_ep2``, ``gg_tp2_ep2``: moe_grouped_gemm at TP 1 and 2 x EP 2, the
  state seeded): megatron-core loads reshard's torch_dist output of the legacy files at another
  TP with the weights, state and param_groups of its own save;
- torch_dist -> torch_dist at another rank count: megatron-core loads reshard's output into a
  GPTModel + DistributedOptimizer at TP 1 x DP 1 (the source was TP 2 x DP 2) with the same
  weights, optimizer state and param_groups, byte for byte, as from its own save.

Needs megatron-core and Megatron-LM's training sources (as ``scripts/gen_frameworks.py``); the
megatron workers run under torchrun on gloo.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import _quiet  # noqa: E402,F401  (_quiet: an autouse fixture)

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "megatron_distopt"
GEN = REPO / "scripts" / "gen_megatron_distopt.py"
sys.path.insert(0, str(REPO / "scripts"))
import _torchrun  # noqa: E402

ITER = "iter_0000007"
MISSING = importlib.util.find_spec("megatron") is None
pytestmark = pytest.mark.skipif(MISSING and os.environ.get("CI") != "true",
                                reason="megatron-core not installed (scripts/setup_venv.sh --frameworks)")
STATES = ("param", "exp_avg", "exp_avg_sq")
# the local spec's norms under their torch_dist names
NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
         "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


def megatron_load(ckpt: Path, tmp: Path, tp: int = 1, moe: bool = False, gg: bool = False) -> tuple[dict, list]:
    """What megatron-core holds after loading the torch_dist folder ``ckpt`` into a GPTModel
    and its DistributedOptimizer at TP ``tp`` (one process per tensor rank, DP 1): rank 0's
    ``{weight|param|exp_avg|exp_avg_sq}.<parameter name>`` tensors, and the param_groups. With
    ``moe``: moe_ep2's model at TP ``tp`` x EP 2 (the dense part data-parallel over 2), every
    rank's tensors as ``<rank>:<name>`` (a dense parameter's state: the rank's flat shard), and
    each chained optimizer's param_groups. With ``gg``: the same with the grouped-GEMM cases'
    model (GroupedMLP experts)."""
    out = tmp / f"loaded_{ckpt.parent.name}_{tp}_{abs(hash(str(ckpt)))}"
    moe = moe or gg
    nproc = tp * (2 if moe else 1)
    _torchrun.job("megatron load", GEN, nproc,
                  ["--load", "--ckpt", str(ckpt), "--tp", str(tp), "--out-prefix", str(out)]
                  + (["--gg"] if gg else ["--moe"] if moe else []),
                  env={"CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONWARNINGS": "ignore"})
    groups = json.loads(Path(f"{out}.0.json").read_text())
    if not moe:
        return load_file(f"{out}.0.safetensors"), groups
    return {f"{r}:{k}": v for r in range(nproc) for k, v in load_file(f"{out}.{r}.safetensors").items()}, groups


def dcp_tensors(folder: Path, prefix: str) -> dict:
    """The tensors of the DCP folder whose names start with ``prefix``, read by torch's own
    DCP reader (not reshard)."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(folder))
    md = reader.read_metadata()
    sd = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
          for k, m in md.state_dict_metadata.items() if k.startswith(prefix) and hasattr(m, "size")}
    dcp.load(sd, storage_reader=reader, no_dist=True)
    return sd


def torch_dist_name(param: str) -> str:
    """A TP 1 GPTModel's parameter name (local spec) under its per-layer torch_dist name."""
    for local, name in NORMS.items():
        if param.endswith(local):
            return param[: -len(local)] + name
    return param


def same_bytes(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), what


def test_legacy_distributed_optimizer_state_is_what_megatron_loads(tmp_path):
    out = tmp_path / "dist"
    reshard.convert(FIX / "legacy", out, world_size=2, format="megatron")
    # a save directory again (the source is one), layers stacked under megatron-core's keys
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "7"
    # megatron-core loads reshard's output into a GPTModel + DistributedOptimizer at TP 1 with
    # the weights, optimizer state and param_groups it loads from its own save of the same run
    want, want_groups = megatron_load(FIX / "torch_dist" / ITER, tmp_path)
    got, got_groups = megatron_load(out / ITER, tmp_path)
    names = [k[len("weight."):] for k in want if k.startswith("weight.")]
    assert sorted(got) == sorted(want) and len(want) == (1 + len(STATES)) * len(names) == 60
    for k in want:
        same_bytes(got[k], want[k], k)
    assert got_groups == want_groups
    # the trained state, not zeros: two Adam steps moved every parameter
    assert all(got[f"exp_avg_sq.{n}"].abs().sum() > 0 for n in names)
    # common.pt: the optimizer's param_groups (with the step) and its sharding type, as megatron's
    mine = torch.load(out / ITER / "common.pt", weights_only=False)
    theirs = torch.load(FIX / "torch_dist" / ITER / "common.pt", weights_only=False)
    assert mine["optimizer"] == theirs["optimizer"]
    assert mine["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert [g["step"] for g in mine["optimizer"]["optimizer"]["param_groups"]] == [2.0, 2.0]
    assert mine["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert mine["opt_param_scheduler"] == theirs["opt_param_scheduler"]


def test_torch_dist_optimizer_state_loads_at_another_split(tmp_path):
    src = FIX / "torch_dist"
    # a save directory read from gives a save directory at the same iteration
    reshard.convert(src, tmp_path / "dist3", world_size=3, format="megatron")
    out = tmp_path / "dist3" / ITER
    want, want_groups = megatron_load(src / ITER, tmp_path)
    got, got_groups = megatron_load(out, tmp_path)
    assert sorted(got) == sorted(want) and len(want) == 60
    for k in want:
        same_bytes(got[k], want[k], k)
    assert got_groups == want_groups
    # and every optimizer tensor of the output is the source's, under the source's name
    a, b = dcp_tensors(out, "optimizer.state."), dcp_tensors(src / ITER, "optimizer.state.")
    assert sorted(a) == sorted(b) and len(a) == 27  # (layers stacked)
    for k in a:
        same_bytes(a[k], b[k], k)


def test_legacy_state_equals_megatrons_torch_dist_save(tmp_path):
    """The legacy files' state, converted, is megatron-core's own torch_dist save of it: the same
    stacked keys, shapes and bytes, read by torch's DCP reader."""
    out = tmp_path / "dist"
    reshard.convert(FIX / "legacy", out, world_size=1, format="megatron")
    got = dcp_tensors(out / ITER, "")
    want = dcp_tensors(FIX / "torch_dist" / ITER, "")
    assert sorted(got) == sorted(want) and len([k for k in want if k.startswith("optimizer.state.")]) == 27
    for k, v in want.items():
        same_bytes(got[k], v, k)


def test_experts_distributed_optimizer_state_is_what_megatron_loads(tmp_path):
    """moe_ep2: 4 experts at EP 2 x DP 4, two chained optimizers (dense, experts). megatron-core
    loads reshard's torch_dist output of the legacy files (at EP 2 x DP 2) with the weights,
    state and each chained optimizer's param_groups it loads from its own save."""
    moe = FIX / "moe_ep2"
    out = tmp_path / "moe"
    reshard.convert(moe / "legacy", out, world_size=2, format="megatron")
    want, want_groups = megatron_load(moe / "torch_dist" / ITER, tmp_path, moe=True)
    got, got_groups = megatron_load(out / ITER, tmp_path, moe=True)
    # each of the 2 ranks: 13 dense parameters and 2 layers x 2 local experts x 2 linears
    names = [k.split(":", 1)[1][len("weight."):] for k in want if k.split(":", 1)[1].startswith("weight.")]
    assert len(names) == 2 * 21 and sum(".mlp.experts.local_experts." in n for n in names) == 2 * 8
    assert sorted(got) == sorted(want)
    # every expert's state whole on its rank; the dense state split over the 2 ranks
    for n in set(names):
        held = [want[f"{r}:exp_avg.{n}"].numel() for r in range(2) if f"{r}:exp_avg.{n}" in want]
        if ".experts." in n:
            assert held == [want[f"0:weight.{n}"].numel()] * 2, n
        else:
            assert sum(held) == want[f"0:weight.{n}"].numel(), n
    for k in want:
        same_bytes(got[k], want[k], k)
    assert got_groups == want_groups and len(got_groups) == 2
    assert [g["is_expert_parallel"] for g in got_groups[1]] == [True]
    # the trained state of the experts, not zeros
    assert all(v.abs().sum() > 0 for k, v in got.items() if k.split(":", 1)[1].startswith("exp_avg_sq.") and ".experts." in k)
    # common.pt: the chained optimizers' param_groups under int keys, as megatron-core's
    mine = torch.load(out / ITER / "common.pt", weights_only=False)
    theirs = torch.load(moe / "torch_dist" / ITER / "common.pt", weights_only=False)
    assert mine["optimizer"] == theirs["optimizer"] and sorted(mine["optimizer"]) == [0, 1]
    # and every tensor of the output is megatron-core's own save, read by torch's DCP reader
    a, b = dcp_tensors(out / ITER, ""), dcp_tensors(moe / "torch_dist" / ITER, "")
    assert sorted(a) == sorted(b) and len([k for k in a if k.startswith("optimizer.state.")]) == 30
    for k in a:
        same_bytes(a[k], b[k], k)


@pytest.mark.parametrize("case,load_tp", [("gg_ep2", 2), ("gg_tp2_ep2", 1)])
def test_grouped_gemm_experts_distributed_optimizer_state_is_what_megatron_loads(tmp_path, case, load_tp):
    """GroupedMLP's experts (moe_grouped_gemm: a layer's local experts in weight1 / weight2), their
    state seeded, at TP 1 x EP 2 and TP 2 x EP 2 (the experts split over the tensor ranks).
    megatron-core loads reshard's torch_dist output of the legacy files into a GPTModel with
    GroupedMLP experts + DistributedOptimizer at another TP (and so another data-parallel size),
    EP 2, with the weights, state and param_groups it loads from its own save."""
    src = FIX / case
    out = tmp_path / case
    reshard.convert(src / "legacy", out, world_size=3, format="megatron")
    want, want_groups = megatron_load(src / "torch_dist" / ITER, tmp_path, tp=load_tp, gg=True)
    got, got_groups = megatron_load(out / ITER, tmp_path, tp=load_tp, gg=True)
    assert sorted(got) == sorted(want)
    nproc = 2 * load_tp
    # each rank: 2 layers' weight1 / weight2, the experts' state whole on the rank that holds them
    # (expert-data-parallel 1 at the loading split)
    for r in range(nproc):
        for n in (f"decoder.layers.{i}.mlp.experts.weight{w}" for i in range(2) for w in (1, 2)):
            for k in ("weight", *STATES):
                assert want[f"{r}:{k}.{n}"].shape == want[f"{r}:weight.{n}"].shape, (r, k, n)
    for k in want:
        same_bytes(got[k], want[k], k)
    assert got_groups == want_groups and len(got_groups) == 2
    # the seeded state of the experts, not zeros
    assert all(v.abs().sum() > 0 for k, v in got.items() if ":exp_avg_sq." in k and ".experts." in k)
    # and every tensor of the output is megatron-core's own save, read by torch's DCP reader
    a, b = dcp_tensors(out / ITER, ""), dcp_tensors(src / "torch_dist" / ITER, "")
    assert sorted(a) == sorted(b) and len([k for k in a if k.startswith("optimizer.state.")]) == 30
    for k in a:
        same_bytes(a[k], b[k], k)
