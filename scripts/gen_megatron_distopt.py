#!/usr/bin/env python3
"""Generate a Megatron-LM legacy checkpoint WITH the distributed optimizer's state
(``--use-distributed-optimizer``, ``distrib_optim.pt``) and, as the oracle, the same state saved
by megatron-core as ``torch_dist`` in the reshardable optimizer format (``fully_reshardable``).

A tiny Llama-style megatron-core GPTModel (local layer spec, the model of
``scripts/gen_frameworks.py``: its ``build_model`` / ``seed_parameters`` / ``megatron_lm_args`` are
imported, not copied) is trained two steps with Adam by megatron-core's own
DistributedDataParallel and DistributedOptimizer at TP 2 x DP 2 on gloo (4 CPU processes), then
saved the two ways Megatron-LM's ``save_checkpoint`` saves it:

  legacy/        ``--ckpt-format torch``: latest_checkpointed_iteration.txt ("7") and
                 iter_0000007/mp_rank_TT/model_optim_rng.pt (written by DP rank 0: args with
                 use_distributed_optimizer, the module's state_dict_for_save_checkpoint(),
                 ``optimizer``: DistributedOptimizer.state_dict(), opt_param_scheduler, rng_state)
                 and iter_0000007/mp_rank_TT/distrib_optim.pt, DistributedOptimizer.
                 save_parameter_state (get_parameter_state_dp_zero: the DP ranks' shards gathered
                 on DP rank 0)
  torch_dist/    iter_0000007/: dist_checkpointing.save of {model: sharded_state_dict, optimizer:
                 optimizer.sharded_state_dict(model_sd, metadata={distrib_optim_sharding_type:
                 fully_reshardable, distrib_optim_fully_reshardable_mem_efficient: True})} with
                 the same args / iteration entries
  tied_pp2/      a second run: TP 1 x PP 2 x DP 2, tied embeddings, --overlap-grad-reduce with
                 500-element buckets (several buckets per buffer, each pipeline end's embedding
                 copy in one of its own), each parameter's exp_avg / exp_avg_sq set from a seed
                 through DistributedOptimizer's own setter (no training: the pipeline schedule
                 wants CUDA); legacy/ as above and, as the oracle, expected_stage{0,1}.safetensors:
                 the state under the legacy reader's global names, from the seeds (megatron-core
                 0.16.1's fully_reshardable save misplaces the state after a bucket's end padding,
                 so it is no oracle here)
  moe_ep2/       a third run: 4 SequentialMLP experts (top 2) at TP 1 x EP 2 on 4 processes
                 (the dense part DP 4, the experts expert-data-parallel 2), trained two Adam
                 steps; megatron-core chains two optimizers (dense, experts), each with its own
                 buffer: legacy/ (mp_rank_00_00E, model_optim_rng.pt by expert-data-parallel
                 rank 0, distrib_optim.pt a list of both optimizers' states, None where that
                 optimizer's data-parallel rank 0 is elsewhere) and torch_dist/ as above
                 (``--only-moe`` regenerates this one alone)
  gg_ep2/        moe_ep2's model with GroupedMLP experts (moe_grouped_gemm; vocabulary 32, expert
  gg_tp2_ep2/    FFN 12) at TP 1 x EP 2 and TP 2 x EP 2 (the experts split over the tensor ranks)
                 on 4 processes; no training (GroupedMLP runs only on CUDA): built with the
                 grouped_gemm package's availability check stubbed, the state set from seeds as
                 tied_pp2's; legacy/ and torch_dist/ as moe_ep2's, the torch_dist save checked
                 here against the seeds (``--only-gg`` regenerates these alone)
  case.json      the models, the splits, the optimizer's settings

Usage: .venv/bin/python scripts/gen_megatron_distopt.py [--out tests/fixtures/megatron_distopt]
       [--megatron-lm DIR]   (Megatron-LM's training sources, as scripts/gen_frameworks.py)

What it took on CPU, beyond gen_frameworks.py's patches: DistributedDataParallel with
``overlap_grad_reduce=False`` (one bucket per buffer), the optimizer's main parameters kept fp32.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPTS))

import gen_frameworks as gf  # noqa: E402
from _torchrun import job  # noqa: E402

ITERATION = 7
TP, DP = 2, 2
# tiny Llama-like (GQA, SwiGLU, RMSNorm, untied): 2 layers, hidden 16, vocabulary 96
# (make_vocab_size_divisible_by 8 x TP 2 divides it: no padding rows)
MODEL = dict(gf.BASE, num_layers=2, ffn_hidden_size=24, make_vocab_size_divisible_by=8)
MODEL["padded_vocab_size"] = -(-MODEL["vocab_size"] // (8 * TP)) * (8 * TP)
LR = 1e-2
STEPS = 2


def batch(dp_rank: int, step: int):
    import torch

    g = torch.Generator().manual_seed(100 * step + dp_rank)
    ids = torch.randint(0, MODEL["vocab_size"], (2, 8), generator=g)
    labels = torch.randint(0, MODEL["vocab_size"], (2, 8), generator=g)
    return ids, labels


def _cuda_to_cpu(torch):
    """Tensor factories asked for device 'cuda' (the optimizer's overflow buffer, ...) make CPU
    tensors."""
    import functools

    def wrap(f):
        @functools.wraps(f)
        def g(*a, **k):
            d = k.get("device")
            if d is not None and str(d).startswith("cuda"):
                k["device"] = "cpu"
            return f(*a, **k)
        return g

    orig_type = torch.Tensor.type

    def type_(self, *a, **k):  # the optimizer asks for torch.cuda.FloatTensor parameters
        if a or k:
            return orig_type(self, *a, **k)
        t = orig_type(self)
        return t.replace("torch.", "torch.cuda.", 1) if ".cuda." not in t else t

    torch.Tensor.type = type_
    for n in ("tensor", "zeros", "ones", "empty", "full", "zeros_like", "empty_like", "arange"):
        setattr(torch, n, wrap(getattr(torch, n)))


def worker(args):
    torch, dist = gf._init()
    _cuda_to_cpu(torch)

    ps, model, ddp, opt = build_trainer(torch, TP)
    train(torch, ps, ddp, opt)
    save_both(torch, dist, Path(args.dir), model, opt, MODEL, TP, 1, DP, Path(args.megatron_lm),
              dict(overlap_grad_reduce=False))
    dist.barrier()
    dist.destroy_process_group()


# the mixture-of-experts case: 4 SequentialMLP experts (top 2) in each of 2 layers, EP 2 x TP 1
# on 4 processes: the dense part data-parallel over 4, the experts over 2 (expert-data-parallel
# groups {0, 2}, {1, 3}); two optimizers chained (dense, experts), each with a buffer of its own
MOE = dict(MODEL, num_experts=4, moe_ffn_hidden_size=24, ffn_hidden_size=24, hf="mixtral")
MOE["padded_vocab_size"] = -(-MOE["vocab_size"] // 8) * 8
MOE_EP, MOE_WORLD = 2, 4


def worker_moe(args):
    torch, dist = gf._init()
    _cuda_to_cpu(torch)

    ps, model, ddp, opt = build_trainer(torch, 1, MOE, MOE_EP)
    assert len(opt.chained_optimizers) == 2, len(opt.chained_optimizers)
    train(torch, ps, ddp, opt)
    save_both(torch, dist, Path(args.dir), model, opt, MOE, 1, 1, MOE_WORLD, Path(args.megatron_lm),
              dict(overlap_grad_reduce=False), ep=MOE_EP)
    dist.barrier()
    dist.destroy_process_group()


def train(torch, ps, ddp, opt):
    """STEPS Adam steps on each data-parallel rank's batches."""
    dp_rank = ps.get_data_parallel_rank()
    for step in range(STEPS):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ids, labels = batch(dp_rank, step)
        b, s = ids.shape
        pos = torch.arange(s).unsqueeze(0).expand(b, s)
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s).expand(b, 1, s, s)
        loss = ddp(ids, pos, mask, labels=labels).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        ok, _, _ = opt.step()
        assert ok


def save_both(torch, dist, out: Path, model, opt, m: dict, tp: int, pp: int, dp: int, mlm: Path,
              ddp_args: dict, torch_dist: bool = True, ep: int = 1) -> None:
    """Save the model and its DistributedOptimizer as Megatron-LM does, both ways: legacy
    (``model_optim_rng.pt`` by DP rank 0 of each (TP, PP) rank, ``distrib_optim.pt`` by
    save_parameter_state) and torch_dist (fully_reshardable). ``ddp_args``: the arguments the
    DDP was built with, set in the saved ``args``."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    dp_rank, rank = ps.get_data_parallel_rank(), dist.get_rank()
    ep_rank, edp_rank = ps.get_expert_model_parallel_rank(), ps.get_expert_data_parallel_rank()
    it = f"iter_{ITERATION:07d}"
    flops = 123456789
    sched = {"max_lr": LR, "min_lr": 0.0, "num_steps": STEPS, "decay_style": "constant"}

    def margs(fmt):
        a = gf.megatron_lm_args(m, tp, pp, ep, fmt, mlm)
        a.use_distributed_optimizer = True
        for k, v in ddp_args.items():
            setattr(a, k, v)
        a.data_parallel_size = dp
        a.world_size = tp * pp * dp
        if ep > 1:
            a.expert_model_parallel_size = ep
        return a

    # --- legacy: what Megatron-LM's save_checkpoint writes with --ckpt-format torch
    largs = margs("torch")
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "") + (f"_{ep_rank:03d}" if ep > 1 else "")
    folder = out / "legacy" / it / name
    # (Megatron-LM: the rank file by expert-data-parallel rank 0 of each (TP, PP, EP) rank; the
    # chained optimizers' distrib_optim.pt by each optimizer's data-parallel rank 0, a list with
    # None for an optimizer whose rank 0 is elsewhere)
    if edp_rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({"args": largs, "checkpoint_version": 3.0, "iteration": ITERATION,
                    "model": model.state_dict_for_save_checkpoint(), "optimizer": opt.state_dict(),
                    "opt_param_scheduler": sched, "num_floating_point_operations_so_far": flops},
                   str(folder / "model_optim_rng.pt"))
    dist.barrier()
    opt.save_parameter_state(str(folder / "distrib_optim.pt"))  # every DP rank takes part
    dist.barrier()
    if rank == 0:
        (out / "legacy" / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))

    if not torch_dist:
        return
    # --- torch_dist, the optimizer in the fully reshardable format (--dist-ckpt-optim-fully-reshardable)
    dargs = margs("torch_dist")
    dargs.dist_ckpt_optim_fully_reshardable = True
    dargs.distrib_optim_fully_reshardable_mem_efficient = True
    model_sd = model.sharded_state_dict(metadata=META)
    sd = {"args": dargs, "checkpoint_version": 3.0, "iteration": ITERATION, "model": model_sd,
          "optimizer": opt.sharded_state_dict(model_sd, metadata=META), "opt_param_scheduler": sched,
          "num_floating_point_operations_so_far": flops}
    td = out / "torch_dist"
    if rank == 0:
        (td / it).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sd, str(td / it), content_metadata=META)
    dist.barrier()
    if rank == 0:
        (td / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


# the tied, pipelined case: TP 1 x PP 2 x DP 2, tied embeddings (each pipeline end's copy in a
# bucket of its own), --overlap-grad-reduce with 500-element buckets (several per buffer); no
# training (the pipeline schedule wants CUDA): each parameter's exp_avg / exp_avg_sq set from a
# seed (the tied copies alike) through the optimizer's own setter, its fp32 main param the weight
TIED = dict(MODEL, tied=True)
TIED_BUCKET = 500


def worker_tied(args):
    torch, dist = gf._init()
    _cuda_to_cpu(torch)
    import zlib

    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ps = gf._parallel(1, 2, 1)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    torch.manual_seed(1234)
    model = gf.build_model(TIED, 1, 2, 1, pp_rank)
    gf.seed_parameters(model, 0, pp_rank, 0)
    model.train()
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                               bucket_size=TIED_BUCKET, grad_reduce_in_fp32=True)
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    # (no weight decay: the dummy step that creates the states leaves the weights as they are)
    opt_config = OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0, use_distributed_optimizer=True,
                                 params_dtype=torch.float32, clip_grad=0.0)
    opt = get_megatron_optimizer(opt_config, [ddp])
    inner = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    assert len(ddp.buffers[0].buckets) >= 2, len(ddp.buffers[0].buckets)
    inner._init_optimizer_states_with_dummy_values()
    for name, p in model.named_parameters():
        if p not in inner.model_param_group_index_map:
            continue  # no element of it on this data-parallel rank
        r = inner._get_model_param_range_map(p)["param"]
        seed_name = "embedding.word_embeddings.weight" if name == "output_layer.weight" else name
        states = dict(inner._get_main_param_and_optimizer_states(p))
        for k in ("exp_avg", "exp_avg_sq"):
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed_name}|{pp_rank if seed_name == name else 'tied'}|{k}".encode()))
            states[k] = torch.rand(p.numel(), generator=g)[r.start:r.end]
        with torch.no_grad():
            inner._set_main_param_and_optimizer_states(p, states)
    # megatron-core 0.16.1's fully_reshardable save misplaces the state of every parameter after
    # a bucket's end padding (it indexes the gathered, unpadded state with the padded buffer's
    # offsets: its own "issue #504" warning), so the oracle here is the seeds: each stage's
    # global tensors under the legacy reader's names (the tied output layer's copy left out)
    out = Path(args.dir)
    save_both(torch, dist, out, model, opt, TIED, 1, 2, 2, Path(args.megatron_lm),
              dict(overlap_grad_reduce=True, ddp_bucket_size=TIED_BUCKET), torch_dist=False)
    if ps.get_data_parallel_rank() == 0:
        from safetensors.torch import save_file

        want = {}
        for name, p in model.named_parameters():
            if name == "output_layer.weight":
                continue
            g = name
            for local, td in (("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
                              ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")):
                g = g.replace(local, td)
            if g.startswith("decoder.layers."):
                i, rest = g[len("decoder.layers."):].split(".", 1)
                g = f"decoder.layers.{int(i) + pp_rank}.{rest}"  # one layer per stage
            want[f"optimizer.state.param.{g}"] = p.detach().clone()
            for k in ("exp_avg", "exp_avg_sq"):
                seed = zlib.crc32(f"{name}|{pp_rank}|{k}".encode())
                want[f"optimizer.state.{k}.{g}"] = torch.rand(p.numel(), generator=torch.Generator().manual_seed(seed)).reshape(p.shape)
        save_file(want, str(out / f"expected_stage{pp_rank}.safetensors"))
    dist.barrier()
    dist.destroy_process_group()


# the grouped-GEMM cases: moe_ep2's model with megatron-core's GroupedMLP experts
# (moe_grouped_gemm: each layer's local experts in two parameters, mlp.experts.weight1 [H,
# E_local*2F/TP] and weight2 [E_local*F/TP, H]) on 4 processes, at TP 1 x EP 2 (dense DP 4, expert
# DP 2) and at TP 2 x EP 2 (the experts split over the tensor ranks too; dense DP 2, expert DP 1).
# GroupedMLP runs only on CUDA in bf16, so no training: built with the grouped_gemm package's
# availability check stubbed, each parameter's exp_avg / exp_avg_sq set from a seed through
# DistributedOptimizer's own setter (as tied_pp2), its fp32 main param the weight
# (smaller than moe_ep2's: a vocabulary of 32, experts' FFN size 12, the fixture's bytes mostly
# the dense part's state and megatron's per-tensor framing)
GG = dict(MOE, moe_grouped_gemm=True, vocab_size=32, padded_vocab_size=32, moe_ffn_hidden_size=12)
GG_CASES = {"gg_ep2": 1, "gg_tp2_ep2": 2}  # name -> TP (EP 2, 4 processes)
GG_WORLD = 4


def _stub_grouped_gemm():
    from megatron.core.transformer.moe import grouped_gemm_util

    grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None


def _gg_split(name: str, p) -> bool:
    """Whether this rank's parameter ``name`` is its tensor rank's own (split over TP): the
    experts' always (megatron-core splits GroupedMLP's weights over the expert tensor ranks)."""
    return bool(getattr(p, "tensor_model_parallel", False)) or ".mlp.experts." in name


def _gg_seed(name: str, p, tp_rank: int, ep_rank: int, what: str) -> int:
    """The seed of this rank's ``what`` (weight, exp_avg, exp_avg_sq) of parameter ``name``: equal
    wherever the parameter is the same (its data-parallel replicas, a replicated one's TP ranks)."""
    import zlib

    tp = tp_rank if _gg_split(name, p) else "-"
    ep = ep_rank if ".mlp.experts." in name else "-"
    return zlib.crc32(f"{name}|tp{tp}|ep{ep}|{what}".encode())


def worker_gg(args):
    torch, dist = gf._init()
    _cuda_to_cpu(torch)
    _stub_grouped_gemm()
    tp = GG_CASES[Path(args.dir).name]
    ps, model, ddp, opt = build_trainer(torch, tp, GG, MOE_EP, weight_decay=0.0)
    tp_rank, ep_rank = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    with torch.no_grad():  # (the weights: seeds of their own, the experts' per tensor rank)
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(_gg_seed(name, p, tp_rank, ep_rank, "weight"))
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if "norm" in name else 0.0))
    inners = list(opt.chained_optimizers)
    assert len(inners) == 2, len(inners)
    for inner in inners:
        inner._init_optimizer_states_with_dummy_values()  # (no weight decay: the weights stay)
        for name, p in model.named_parameters():
            if p not in inner.model_param_group_index_map:
                continue
            r = inner._get_model_param_range_map(p)["param"]
            states = dict(inner._get_main_param_and_optimizer_states(p))
            for k in ("exp_avg", "exp_avg_sq"):
                g = torch.Generator().manual_seed(_gg_seed(name, p, tp_rank, ep_rank, k))
                states[k] = torch.rand(p.numel(), generator=g)[r.start:r.end]
            with torch.no_grad():
                inner._set_main_param_and_optimizer_states(p, states)
    out = Path(args.dir)
    save_both(torch, dist, out, model, opt, GG, tp, 1, GG_WORLD // tp, Path(args.megatron_lm),
              dict(overlap_grad_reduce=False), ep=MOE_EP)
    check_gg_oracle(torch, dist, out, model, tp, tp_rank, ep_rank)
    dist.barrier()
    dist.destroy_process_group()


def check_gg_oracle(torch, dist, out: Path, model, tp: int, tp_rank: int, ep_rank: int) -> None:
    """megatron-core's own fully_reshardable save of the grouped experts' state is the seeds':
    each rank's local weight1 / weight2 state, unflattened as GroupedMLP holds it ([E_local, H,
    2F/TP] / [E_local, F/TP, H]), is its experts' stretch of the global [L, E, 2F, H] / [L, E, H,
    F] tensors (transposed; at TP > 1 weight1's gate and up halves at rows t*F/TP and F + t*F/TP,
    weight2's columns t*F/TP), read by torch's DCP reader."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(out / "torch_dist" / f"iter_{ITERATION:07d}"))
    md = reader.read_metadata()
    keys = [f"optimizer.state.{k}.decoder.layers.mlp.experts.experts.linear_fc{i}.weight"
            for k in ("exp_avg", "exp_avg_sq") for i in (1, 2)]
    sd = {k: torch.empty(tuple(md.state_dict_metadata[k].size)) for k in keys}
    dcp.load(sd, storage_reader=reader, no_dist=True)
    per = GG["num_experts"] // MOE_EP
    f = GG["moe_ffn_hidden_size"] // tp
    checked = 0
    for name, p in model.named_parameters():
        if ".mlp.experts.weight" not in name:
            continue
        layer = int(name.split(".")[2])
        which = 1 if name.endswith("weight1") else 2
        for k in ("exp_avg", "exp_avg_sq"):
            g = torch.Generator().manual_seed(_gg_seed(name, p, tp_rank, ep_rank, k))
            local = torch.rand(p.numel(), generator=g)
            full = sd[f"optimizer.state.{k}.decoder.layers.mlp.experts.experts.linear_fc{which}.weight"]
            for j in range(per):
                e = ep_rank * per + j
                if which == 1:
                    mine = local.view(per, GG["hidden_size"], 2 * f)[j].t()  # [2F/TP, H]: [gate_t; up_t]
                    F = GG["moe_ffn_hidden_size"]
                    want = torch.cat([full[layer, e, tp_rank * f:(tp_rank + 1) * f],
                                      full[layer, e, F + tp_rank * f:F + (tp_rank + 1) * f]])
                else:
                    mine = local.view(per, f, GG["hidden_size"])[j].t()  # [H, F/TP]
                    want = full[layer, e, :, tp_rank * f:(tp_rank + 1) * f]
                assert torch.equal(mine, want), (name, k, j)
                checked += 1
    assert checked == 2 * 2 * 2 * per, checked


def build_trainer(torch, tp: int, m: dict = MODEL, ep: int = 1, weight_decay: float = 0.01):
    """This rank's GPTModel ``m`` (seeded), wrapped in DistributedDataParallel, and its
    DistributedOptimizer (chained: the dense and the expert parameters' with experts), at TP
    ``tp`` and EP ``ep`` (the rest data-parallel)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ps = gf._parallel(tp, 1, ep)
    torch.manual_seed(1234)
    model = gf.build_model(m, tp, 1, ep, 0)
    if tp == 1:
        # (the loss of unsplit logits: gather_from_tensor_model_parallel_region at TP 1 hands
        # the cross entropy, which works in place, a view autograd refuses: the logits stay
        # the output layer's own)
        model.parallel_output, model.output_layer.gather_output = True, False
    gf.seed_parameters(model, ps.get_tensor_model_parallel_rank(), 0, ps.get_expert_model_parallel_rank())
    model.train()
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=False,
                                               grad_reduce_in_fp32=True)
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(optimizer="adam", lr=LR, weight_decay=weight_decay, adam_beta1=0.9, adam_beta2=0.95,
                                 adam_eps=1e-8, use_distributed_optimizer=True, params_dtype=torch.float32,
                                 clip_grad=0.0)
    return ps, model, ddp, get_megatron_optimizer(opt_config, [ddp])


# the content metadata Megatron-LM saves and loads with --dist-ckpt-optim-fully-reshardable
META = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True,
        "distrib_optim_sharding_type": "fully_reshardable",
        "distrib_optim_fully_reshardable_mem_efficient": True}


def worker_load(args):
    """Load the torch_dist checkpoint ``args.ckpt`` into a GPTModel and its DistributedOptimizer
    at TP ``args.tp`` as Megatron-LM's load_checkpoint does (dist_checkpointing.load of the
    model's and the optimizer's sharded state dicts, then load_state_dict of each), and write
    what each rank holds to ``args.out``.<rank>: the weights, each parameter's optimizer state
    (``<key>.<parameter name>``) and the param_groups (JSON). Without ``args.moe`` one process
    per tensor rank: every parameter whole. With it, ``MOE`` at TP ``args.tp`` x EP 2 (megatron-
    core chains a dense and an expert optimizer only when the experts are split), the dense
    part data-parallel over 2: a dense parameter's state is the rank's flat shard of it (none
    where the rank holds none of it); the param_groups a list of both optimizers'. With
    ``args.gg`` the same with the grouped-GEMM cases' model (GroupedMLP experts, ``GG``)."""
    torch, dist = gf._init()
    _cuda_to_cpu(torch)
    from megatron.core import dist_checkpointing
    from safetensors.torch import save_file

    experts = args.moe or args.gg
    ep = MOE_EP if experts else 1
    assert dist.get_world_size() == args.tp * ep, "one process per tensor (and expert) rank"
    if args.gg:
        _stub_grouped_gemm()
    ps, model, ddp, opt = build_trainer(torch, args.tp, GG if args.gg else MOE if args.moe else MODEL, ep)
    inners = list(opt.chained_optimizers) if hasattr(opt, "chained_optimizers") else [opt]
    assert len(inners) == (2 if experts else 1), len(inners)
    # torch's Adam (no apex / TransformerEngine here) has no state before its first step, and
    # DistributedOptimizer.state_dict wants each state's step: megatron-core's own dummy step
    for inner in inners:
        inner._init_optimizer_states_with_dummy_values()
    # ... whose per-parameter "step" the fully_reshardable load does not carry (the step is the
    # param_groups'): DistributedOptimizer._set_main_param_and_optimizer_states would look it up
    set_states = type(inners[0])._set_main_param_and_optimizer_states

    def keep_step(self, model_param, tensors):
        if "step" not in tensors:
            gi, go = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[gi]["params"][go]]
            if "step" in state:
                tensors = dict(tensors, step=state["step"])
        return set_states(self, model_param, tensors)

    type(inners[0])._set_main_param_and_optimizer_states = keep_step
    model_sd = model.sharded_state_dict(metadata=META)
    sd = {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading=True, metadata=META)}
    loaded = dist_checkpointing.load(sd, args.ckpt)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])
    out = {}
    for name, p in model.named_parameters():
        out[f"weight.{name}"] = p.detach().clone()
        for owner in [o for o in inners if p in o.model_param_group_index_map]:
            for k, v in owner._get_main_param_and_optimizer_states(p).items():
                if k != "step":
                    v = v.detach()
                    out[f"{k}.{name}"] = (v.reshape(p.shape) if v.numel() == p.numel() else v.flatten()).clone()
    rank = dist.get_rank()
    save_file(out, f"{args.out}.{rank}.safetensors")
    osd = opt.state_dict()
    groups = ([o["optimizer"]["param_groups"] for o in osd] if isinstance(osd, list)
              else osd["optimizer"]["param_groups"])
    Path(f"{args.out}.{rank}.json").write_text(json.dumps(groups, default=str))
    dist.barrier()
    dist.destroy_process_group()


def generate_gg(out: Path, megatron_lm: Path) -> dict:
    """The grouped-GEMM cases (GG_CASES), each under out/<name>; their case.json entries."""
    cases = {}
    for name, tp in GG_CASES.items():
        shutil.rmtree(out / name, ignore_errors=True)
        secs = job(f"gen_megatron_distopt {name}", Path(__file__), GG_WORLD,
                   ["--worker-gg", "--dir", str(out / name), "--megatron-lm", str(megatron_lm)],
                   env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
        cases[name] = {"tp": tp, "ep": MOE_EP, "dp": GG_WORLD // tp, "expert_dp": GG_WORLD // (tp * MOE_EP),
                       "expert_tp": tp, "model": GG, "overlap_grad_reduce": False, "weight_decay": 0.0,
                       "optimizers": "chained: dense, experts",
                       "state": "seeded exp_avg / exp_avg_sq, no training (GroupedMLP runs on CUDA only)",
                       "seconds": secs}
    return cases


def generate(out: Path, megatron_lm: Path, only_moe: bool = False, only_gg: bool = False) -> None:
    # (hostile/ and README.md are kept)
    out.mkdir(parents=True, exist_ok=True)
    if only_gg:
        case = json.loads((out / "case.json").read_text())
        case.update(generate_gg(out, megatron_lm))
        (out / "case.json").write_text(json.dumps(case, indent=1) + "\n")
        return
    shutil.rmtree(out / "moe_ep2", ignore_errors=True)
    moe_secs = job("gen_megatron_distopt moe_ep2", Path(__file__), MOE_WORLD,
                   ["--worker-moe", "--dir", str(out / "moe_ep2"), "--megatron-lm", str(megatron_lm)],
                   env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    case = json.loads((out / "case.json").read_text()) if (out / "case.json").is_file() else {}
    case["moe_ep2"] = {"tp": 1, "ep": MOE_EP, "dp": MOE_WORLD, "expert_dp": MOE_WORLD // MOE_EP,
                       "model": MOE, "overlap_grad_reduce": False, "steps": STEPS,
                       "optimizers": "chained: dense, experts", "seconds": moe_secs}
    if only_moe:
        (out / "case.json").write_text(json.dumps(case, indent=1) + "\n")
        return
    gg = generate_gg(out, megatron_lm)
    for sub in ("legacy", "torch_dist", "tied_pp2"):
        shutil.rmtree(out / sub, ignore_errors=True)
    secs = job("gen_megatron_distopt", Path(__file__), TP * DP,
               ["--worker", "--dir", str(out), "--megatron-lm", str(megatron_lm)],
               env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    secs += job("gen_megatron_distopt tied_pp2", Path(__file__), 4,
                ["--worker-tied", "--dir", str(out / "tied_pp2"), "--megatron-lm", str(megatron_lm)],
                env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    (out / "case.json").write_text(json.dumps({
        "tp": TP, "dp": DP, "iteration": ITERATION, "model": MODEL, "optimizer": {
            "optimizer": "adam", "lr": LR, "weight_decay": 0.01, "betas": [0.9, 0.95], "eps": 1e-8,
            "steps": STEPS, "use_distributed_optimizer": True, "overlap_grad_reduce": False},
        "torch_dist_optimizer_format": "fully_reshardable",
        "tied_pp2": {"tp": 1, "pp": 2, "dp": 2, "tied": True, "overlap_grad_reduce": True,
                     "ddp_bucket_size": TIED_BUCKET, "weight_decay": 0.0,
                     "state": "seeded exp_avg / exp_avg_sq, no training"},
        "seconds": secs, "moe_ep2": case["moe_ep2"], **gg}, indent=1) + "\n")
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{out}: {total} bytes, {secs} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=gf.REPO / "tests" / "fixtures" / "megatron_distopt")
    ap.add_argument("--megatron-lm", type=Path, default=gf.default_megatron_lm())
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--worker-tied", action="store_true")
    ap.add_argument("--worker-moe", action="store_true")
    ap.add_argument("--worker-gg", action="store_true")
    ap.add_argument("--only-moe", action="store_true", help="regenerate moe_ep2/ only")
    ap.add_argument("--only-gg", action="store_true", help="regenerate the grouped-GEMM cases only")
    ap.add_argument("--dir")
    ap.add_argument("--load", action="store_true", help="(worker) load --ckpt at --tp, write --out.*")
    ap.add_argument("--ckpt")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--moe", action="store_true", help="(worker) the model of moe_ep2/")
    ap.add_argument("--gg", action="store_true", help="(worker) the model of the grouped-GEMM cases")
    ap.add_argument("--out-prefix", dest="out")
    a = ap.parse_args()
    if a.load:
        worker_load(a)
    elif a.worker_gg:
        worker_gg(a)
    elif a.worker_moe:
        worker_moe(a)
    elif a.worker_tied:
        worker_tied(a)
    elif a.worker:
        worker(a)
    else:
        generate(a.out, a.megatron_lm, a.only_moe, a.only_gg)


if __name__ == "__main__":
    main()
