#!/usr/bin/env python3
"""Generate REAL DeepSpeed ZeRO checkpoints (+ DeepSpeed's own consolidation) for reshard.

Every case runs a real DeepSpeed job on CPU (DS_ACCELERATOR=cpu, gloo, under torchrun with
`dp` local processes), trains the tiny model below for two AdamW steps and saves it with
`engine.save_checkpoint`. Output, per case, under <out>/<case>/:

  checkpoint/                 exactly what DeepSpeed wrote (latest, <tag>/...; the scripts
                              zero_to_fp32.py / zero_to_torch.py it copies beside them
                              removed: they are DeepSpeed's code, not data)
  oracle/fp32.safetensors     DeepSpeed's own consolidation:
                              deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint
  oracle/engine.safetensors   the same tensors (and the Adam moments) as the engine holds them
                              after saving, gathered with DeepSpeed's safe_get_full_* API: the
                              oracle where zero_to_fp32 cannot read the checkpoint (BF16_Optimizer)
  oracle/module.safetensors   stages 1 and 2: engine.module.state_dict(), the model-dtype weights
                              (what `--weights model` reads)
  oracle/resume.json          the losses of two more steps after engine.load_checkpoint at the
                              case's own dp (the "without a move" reference of the resume test)
  case.json                   DeepSpeed/torch versions, stage, dtype, dp, groups, what it exercises

The other mode runs the resume check on any DeepSpeed checkpoint (reshard's output):

  python scripts/gen_deepspeed.py --resume CKPT_DIR --case NAME --dp M --json OUT.json

loads CKPT_DIR with engine.load_checkpoint in a job of M ranks configured as case NAME, runs two
steps on the same global batches and writes their losses to OUT.json (and, with --dump FILE, the
engine's full state right after loading, as oracle/engine.safetensors holds it; with --stage N, in a
job at ZeRO stage N; with --universal, CKPT_DIR is a universal checkpoint, loaded with
"checkpoint": {"load_universal": true}). Batches are global (6 samples, split over the ranks), so the steps are
the same at any dp up to reduction order.

Usage:
  python scripts/gen_deepspeed.py [--out tests/fixtures/deepspeed] [--only NAME ...] [--list]
Needs: scripts/setup_venv.sh --deepspeed (deepspeed + ninja in the venv). The first run
JIT-compiles DeepSpeed's shm op (~2.5 min on 2 cores), cached in
${TORCH_EXTENSIONS_DIR:-~/.cache/reshard/torch_extensions}.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import _gen
from _torchrun import job

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
SEED = 1234
GLOBAL_BATCH = 6
TAG = "global_step2"

# name -> spec
CASES: dict[str, dict] = {}
for _stage in (1, 2, 3):
    for _dtype, _dp, _groups in (("float32", 2, 1), ("float32", 3, 2), ("bfloat16", 2, 2), ("bfloat16", 3, 1)):
        _name = f"zero{_stage}_dp{_dp}_{'f32' if _dtype == 'float32' else 'bf16'}_g{_groups}"
        CASES[_name] = dict(stage=_stage, dtype=_dtype, dp=_dp, groups=_groups, tied=_groups == 1, frozen=_dp == 3)
# bf16 with fp32 gradient accumulation at stage 1: DeepSpeed's BF16_Optimizer (its own optim file
# layout: fp32 partitions kept padded, no zero_stage), Megatron-DeepSpeed's usual setting
CASES["zero1_dp2_bf16_g2_fp32acc"] = dict(stage=1, dtype="bfloat16", dp=2, groups=2, tied=False, frozen=True,
                                          grad_accum_fp32=True)
# zero_optimization.parameter_alignment: each parameter but a group's last padded to 16 bytes
# of the model dtype inside the flat buffer (param_alignment_paddings)
CASES["zero2_dp2_bf16_g1_aligned"] = dict(stage=2, dtype="bfloat16", dp=2, groups=1, tied=True, frozen=False,
                                          parameter_alignment=True)
# zero_optimization.round_robin_gradients: a group flattened in an order that depends on dp
CASES["zero2_dp3_f32_g2_roundrobin"] = dict(stage=2, dtype="float32", dp=3, groups=2, tied=False, frozen=True,
                                            round_robin=True)
# stage 3 with a small sub_group_size: each param group split into several flat fp32 sub-groups
CASES["zero3_dp2_f32_g2_sub"] = dict(stage=3, dtype="float32", dp=2, groups=2, tied=False, frozen=False,
                                     sub_group_size=40)


def model_and_groups(spec):
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(11, 6)
            self.lin = nn.Linear(6, 7)
            self.norm = nn.LayerNorm(7)
            self.out = nn.Linear(7, 6)
            self.head = nn.Linear(6, 11, bias=False)
            if spec["tied"]:
                self.head.weight = self.emb.weight
            self.register_buffer("pos", torch.arange(5, dtype=torch.float32) / 4)
            if spec["frozen"]:
                # a mean far from 0: the loss depends on every parameter
                self.frozen = nn.Parameter(torch.linspace(0.5, 1.25, 3), requires_grad=False)

        def forward(self, x, y):
            h = self.emb(x)
            h = torch.relu(self.norm(self.lin(h)))
            h = self.out(h) + self.pos[: h.shape[1]].to(h.dtype).unsqueeze(-1)
            if spec["frozen"]:
                h = h * self.frozen.to(h.dtype).mean()
            logits = self.head(h).float()
            return nn.functional.cross_entropy(logits.reshape(-1, 11), y.reshape(-1))

    torch.manual_seed(SEED)
    model = Net()
    return model, param_groups(model, spec)


def param_groups(model, spec):
    """The optimizer's parameter groups of the case (by parameter names, so that a wrapped
    model, e.g. FSDP2's, gets the same groups)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if spec["groups"] == 2:
        decay = [p for n, p in named if n.endswith("weight") and "norm" not in n]
        rest = [p for n, p in named if not (n.endswith("weight") and "norm" not in n)]
        return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 0.02}]
    return [{"params": [p for _, p in named], "weight_decay": 0.01}]


def batches(n):
    import torch

    g = torch.Generator().manual_seed(SEED + 1)
    return [(torch.randint(0, 11, (GLOBAL_BATCH, 5), generator=g), torch.randint(0, 11, (GLOBAL_BATCH, 5), generator=g)) for _ in range(n)]


def ds_config(spec, dp):
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // dp,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": spec["stage"]},
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }
    if spec["stage"] == 3:
        # tiny params: partition every one (not kept whole below the threshold)
        cfg["zero_optimization"].update(stage3_param_persistence_threshold=0, stage3_max_live_parameters=0,
                                        stage3_prefetch_bucket_size=0)
    if spec.get("round_robin"):
        cfg["zero_optimization"]["round_robin_gradients"] = True
    if spec.get("parameter_alignment"):
        cfg["zero_optimization"]["parameter_alignment"] = True
    if spec.get("sub_group_size"):
        cfg["zero_optimization"]["sub_group_size"] = spec["sub_group_size"]
    if spec["dtype"] == "bfloat16":
        cfg["bf16"] = {"enabled": True}
    if spec.get("grad_accum_fp32"):
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if spec.get("load_universal"):
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def engine_for(spec, dp):
    import deepspeed
    import torch

    model, groups = model_and_groups(spec)
    opt = torch.optim.AdamW(groups, lr=0.01, betas=(0.9, 0.99), eps=1e-8)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(spec, dp))
    return engine


def step(engine, batch, rank, dp):
    x, y = batch
    per = GLOBAL_BATCH // dp
    loss = engine(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
    engine.backward(loss)
    engine.step()
    # the global mean loss, for comparison across dp degrees
    import torch
    import torch.distributed as dist

    t = loss.detach().float().clone()
    dist.all_reduce(t)
    return (t / dp).item()


def full_state(engine):
    """Every tensor a consolidation gives, as DeepSpeed's engine holds it (collectives: call on
    every rank): the fp32 master weights and Adam moments of trainable parameters
    (deepspeed.utils.safe_get_full_fp32_param / safe_get_full_optimizer_state, which gather
    the partitions), frozen parameters and buffers from the module."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    # Stages 1 and 2 link each parameter to its optimizer state at the first step (after a
    # load: not yet). DeepSpeed 0.19.8 links every group after the first group's step, before
    # the other groups have state, and never again: with two groups, safe_get_full_optimizer_state
    # fails for the second. Link again, now that every group has its state.
    lazy = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if lazy is not None:
        if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
            engine.optimizer._hp_optimizer_states_linked = False
        lazy()
    out = {}
    opt = engine.optimizer
    if getattr(opt, "round_robin_gradients", False) and not any(any(p) for p in opt.round_robin_bit16_padding):
        # DeepSpeed 0.19.8 links each parameter to its fp32 fragment at offsets in the group's
        # own order, not in the round-robin order it flattened them in: safe_get_full_* then
        # read other parameters' elements. Gather the flat partitions and cut them at the
        # offsets DeepSpeed flattened at (round_robin_bit16_offsets) instead.
        out.update(_round_robin_state(engine))
    for n, p in engine.module.named_parameters():
        if p.requires_grad:
            if n in out:
                continue
            out[n] = safe_get_full_fp32_param(p)
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"optimizer.state.{n}.{k}"] = safe_get_full_optimizer_state(p, k)
        else:
            import deepspeed

            with deepspeed.zero.GatheredParameters([p], enabled=hasattr(p, "ds_id")):
                out[n] = p.detach().clone()
    for n, b in engine.module.named_buffers():
        out[n] = b.detach().clone()
    return {k: v.detach().cpu().clone().contiguous() for k, v in out.items()}


def _round_robin_state(engine):
    """Stage 1/2 with round_robin_gradients: every trainable parameter's fp32 master weights
    and Adam moments, from the flat partitions of every rank (all_gather) cut at the offsets
    DeepSpeed flattened each parameter at."""
    import torch
    import torch.distributed as dist

    opt = engine.optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    dp = dist.get_world_size()
    out = {}
    for i, params in enumerate(opt.round_robin_bit16_groups):
        size = opt.partition_size[i]
        flat = opt.single_partition_of_fp32_groups[i]
        state = opt.optimizer.state[flat]
        whole = {}
        for key, local in [("param", flat)] + [(k, state[k]) for k in ("exp_avg", "exp_avg_sq")]:
            padded = torch.zeros(size, dtype=local.dtype)
            padded[: local.numel()] = local.detach().reshape(-1)
            parts = [torch.empty_like(padded) for _ in range(dp)]
            dist.all_gather(parts, padded)
            whole[key] = torch.cat(parts)
        for p, at in zip(params, opt.round_robin_bit16_offsets[i]):
            n = names[id(p)]
            cut = lambda t: t[at:at + p.numel()].view(p.shape).clone()  # noqa: E731
            out[n] = cut(whole["param"])
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"optimizer.state.{n}.{k}"] = cut(whole[k])
    return out


def worker(args):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    deepspeed.init_distributed(dist_backend="gloo")
    rank, dp = dist.get_rank(), dist.get_world_size()
    spec = dict(CASES[args.case])
    if getattr(args, "stage", None):
        spec["stage"] = args.stage
    spec["load_universal"] = bool(getattr(args, "universal", False))
    engine = engine_for(spec, dp)
    data = batches(4)
    if args.mode == "save":
        losses = [step(engine, b, rank, dp) for b in data[:2]]
        engine.save_checkpoint(args.dir, tag=TAG, client_state={"epoch": 3, "note": "reshard", "losses": losses})
        held = full_state(engine)
        dist.barrier()
        if rank == 0:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            save_file(held, str(Path(args.oracle).parent / "engine.safetensors"))
            if spec["stage"] < 3:
                # the module's own state dict (model dtype): what --weights model reads
                module = {k: v.detach().cpu().clone().contiguous() for k, v in engine.module.state_dict().items()}
                save_file(module, str(Path(args.oracle).parent / "module.safetensors"))
            try:
                sd = get_fp32_state_dict_from_zero_checkpoint(args.dir)
                save_file({k: v.detach().clone().contiguous() for k, v in sd.items()}, args.oracle)
            except Exception as e:  # a layout zero_to_fp32 cannot read: recorded in case.json
                msg = f"{type(e).__name__}: {e}".replace(str(Path(args.dir).parent), "<case>")
                Path(args.oracle).with_suffix(".error").write_text(msg + "\n")
    else:
        engine.load_checkpoint(args.dir)
        held = full_state(engine)
        losses = [step(engine, b, rank, dp) for b in data[2:]]
        if rank == 0:
            if args.oracle:
                save_file(held, args.oracle)
            Path(args.json).write_text(json.dumps({"losses": losses, "dp": dp}) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    # Everything is written: leave without running C++ static destructors, where a thread
    # still joinable at exit aborts the process ("terminate called without an active
    # exception" may come from there: seen once in a CI run of the resume check at dp 2).
    # A failure before this line still fails the job, and the caller checks what was written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def torchrun(dp, argv):
    env = {"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR",
                                                  str(Path.home() / ".cache/reshard/torch_extensions"))}
    job("gen_deepspeed", Path(__file__), dp, argv, env=env)


def generate(name, out):
    import deepspeed
    import torch

    spec = CASES[name]
    case_dir = out / name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    (case_dir / "oracle").mkdir(parents=True)
    ckpt = case_dir / "checkpoint"
    torchrun(spec["dp"], ["--worker", "save", "--case", name, "--dir", str(ckpt),
                          "--oracle", str(case_dir / "oracle/fp32.safetensors")])
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        (ckpt / script).unlink(missing_ok=True)
    resume = case_dir / "oracle/resume.json"
    with tempfile.TemporaryDirectory() as tmp:
        # resume from a copy: DeepSpeed's loader writes nothing, but the fixture stays pristine
        shutil.copytree(ckpt, Path(tmp) / "c")
        torchrun(spec["dp"], ["--worker", "resume", "--case", name, "--dir", str(Path(tmp) / "c"), "--json", str(resume)])
    files = _gen.files(ckpt)
    err = case_dir / "oracle/fp32.error"
    info = dict(spec, deepspeed=deepspeed.__version__, torch=torch.__version__, tag=TAG,
                oracle="deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(checkpoint)",
                engine_oracle="full_state(engine) after save_checkpoint: safe_get_full_fp32_param, "
                              "safe_get_full_optimizer_state (with round_robin_gradients: the flat "
                              "partitions of every rank cut at round_robin_bit16_offsets), module "
                              "buffers and frozen parameters",
                files=files)
    if err.exists():
        info["zero_to_fp32_error"] = err.read_text().strip()
        err.unlink()
        print(f"gen_deepspeed: {name}: zero_to_fp32 cannot read it: {info['zero_to_fp32_error']}")
    _gen.write_case(case_dir, info, "gen_deepspeed", name)


def main():
    ap = _gen.parser(__doc__, REPO / "tests/fixtures/deepspeed", ["save", "resume"])
    ap.add_argument("--resume", type=Path, help="run the resume check on this checkpoint")
    ap.add_argument("--dp", type=int)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--dump", type=Path, help="with --resume: write the engine's state after loading (safetensors)")
    ap.add_argument("--oracle")
    ap.add_argument("--stage", type=int, help="with --resume: the loading job's ZeRO stage (default: the case's)")
    ap.add_argument("--universal", action="store_true",
                    help="with --resume: load a universal checkpoint (\"checkpoint\": {\"load_universal\": true})")
    args = ap.parse_args()
    if args.mode:
        return worker(args)
    if args.resume:
        if not (args.case in CASES and args.dp and args.json):
            ap.error("--resume needs --case NAME, --dp M and --json OUT")
        extra = ["--oracle", str(args.dump)] if args.dump else []
        extra += ["--stage", str(args.stage)] if args.stage else []
        extra += ["--universal"] if args.universal else []
        torchrun(args.dp, ["--worker", "resume", "--case", args.case, "--dir", str(args.resume), "--json", str(args.json),
                           *extra])
        return
    _gen.generate_cases(ap, args, CASES, generate, "gen_deepspeed")


if __name__ == "__main__":
    main()
