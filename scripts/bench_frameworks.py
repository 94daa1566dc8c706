#!/usr/bin/env python3
"""reshard against mbridge converting a Llama-style model between Hugging Face and megatron-core
`torch_dist`, at a size where the peers' memory shows (BENCHMARKS.md, "Between frameworks").

    cargo build --release
    .venv/bin/python scripts/bench_frameworks.py --work /tmp/reshard-bench-frameworks --rounds 3

The model (made once, kept under --work): hidden 2048, FFN 5632, 16 heads in 4 query groups
(head dim 128), vocabulary 32000, untied embeddings, fp32, --layers 12 by default: 672M
parameters, 2.50 GiB of weights. Values are seeded random (norms around 1).

  WORK/hf/          the Hugging Face folder: config.json (LlamaConfig), model.safetensors.index.json
                    and shards of at most 1 GiB, written with the safetensors package
  WORK/mcore/       a Megatron-LM save directory (latest_checkpointed_iteration.txt, iter_0000001/)
                    written by megatron-core 0.16.1 itself: a GPTModel (local layer spec) built on
                    CPU, filled from WORK/hf by mbridge's load_weights, saved by
                    dist_checkpointing.save with what Megatron-LM's save_checkpoint puts beside the
                    model (`args` from Megatron-LM's own parse_args at tag core_v0.16.1,
                    checkpoint_version, iteration), as scripts/gen_frameworks.py does

Contenders, each a fresh process:

  HF -> megatron   `reshard convert WORK/hf OUT --format megatron` (the release binary; with
                   --wheel CMD, that `reshard` command too); mbridge: a GPTModel built on CPU in one
                   process (gloo, world size 1), `bridge.load_weights(model, hf)`, then
                   `dist_checkpointing.save({"model": model.sharded_state_dict()}, OUT)`
  megatron -> HF   `reshard convert WORK/mcore OUT --format hf`; mbridge: the same model,
                   `dist_checkpointing.load(model.sharded_state_dict(), iter)` +
                   `load_state_dict`, then `bridge.save_weights([model], OUT)` (its
                   save_pretrained-like export: the source folder's shard layout, config.json)
  imports only     `import megatron.core, mbridge, transformers` (included in mbridge's rows)

The mbridge model is built as generously as CPU allows: `perform_initialization=False` (no
random init of 672M parameters that are overwritten anyway), torch on every core, no args
saved. Megatron-LM's tools/checkpoint is not run (BENCHMARKS.md says why): at tag core_v0.16.1
its savers write only `--ckpt-format torch` (not torch_dist) and none writes a Llama Hugging Face
folder; its `core` saver asserts a TransformerEngine install and its llama_mistral loader asserts
transformers 4.x >= 4.31.

Before any time counts every contender runs once and its output is checked tensor by tensor
against the source (HF outputs: every tensor equal to WORK/hf's; megatron outputs: every
tensor of WORK/mcore read back with torch.distributed.checkpoint, equal). Then --rounds rounds,
every contender once per round, the order reversed every other round; medians. Before each
run: the previous output deleted, `sync` (not timed), the source read whole (page cache warm
for everyone). Peak RSS is the process's VmHWM and peak RssAnon its anonymous resident memory,
both read from /proc/PID/status every 2 ms; "tree" columns sum Pss and Pss_Anon
(/proc/PID/smaps_rollup, every 20 ms) over the process and its descendants (megatron-core's
writer forks helpers, whose copy-on-write pages Pss counts once).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent
ROOT = SCRIPTS.parent
PY = sys.executable
ITERATION = 1
META = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
MODEL = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=4,
             head_dim=128, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5,
             rope_theta=10000.0)
SHARD_BYTES = 1 << 30


# --------------------------------------------------------------------------- measuring

def _children(pid: int) -> list[int]:
    out = []
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out += [int(x) for x in f.read().split()]
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


def _status(pid: int) -> tuple[int, int]:
    """VmHWM and RssAnon of a process, in bytes (0, 0 once it is gone)."""
    hwm = anon = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
                elif line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return hwm, anon


def _pss(pid: int) -> tuple[int, int]:
    """Pss and Pss_Anon of a process, in bytes: its share of pages it shares (a forked helper's
    copy-on-write pages are counted once over the tree)."""
    pss = anon = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
                elif line.startswith("Pss_Anon:"):
                    anon = int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return pss, anon


def measure(cmd: list[str], env: dict | None = None, log: Path | None = None) -> dict:
    """Run `cmd`; wall time and, in bytes: peak RSS (VmHWM) and peak RssAnon of the process
    (/proc/PID/status every 2 ms), and the peak Pss and Pss_Anon summed over the process and
    its descendants (smaps_rollup every 20 ms)."""
    out = open(log or os.devnull, "wb")
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    hwm = anon = tree = tree_anon = 0
    k = 0
    while True:
        pid, status = os.waitpid(p.pid, os.WNOHANG)
        if pid:
            break
        h, a = _status(p.pid)
        hwm, anon = max(hwm, h), max(anon, a)
        if k % 10 == 0:
            t = ta = 0
            todo = [p.pid]
            while todo:
                c = todo.pop()
                x, y = _pss(c)
                t, ta = t + x, ta + y
                todo += _children(c)
            tree, tree_anon = max(tree, t), max(tree_anon, ta)
        k += 1
        time.sleep(0.002)
    wall = time.perf_counter() - t0
    out.close()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        tail = Path(log).read_text(errors="replace")[-3000:] if log else ""
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{tail}")
    return {"wall": wall, "rss": hwm, "anon": anon, "tree_pss": tree, "tree_anon": tree_anon}


def remove(p: Path) -> None:
    if p.is_dir():
        shutil.rmtree(p)
    elif p.exists():
        p.unlink()


def warm(d: Path) -> None:
    for p in sorted(d.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(8 << 20):
                    pass


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- the model

def hf_names(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the Llama model, in the order a Hugging Face save holds them."""
    h, f, v = MODEL["hidden_size"], MODEL["intermediate_size"], MODEL["vocab_size"]
    q, kv = MODEL["num_attention_heads"] * MODEL["head_dim"], MODEL["num_key_value_heads"] * MODEL["head_dim"]
    out = [("model.embed_tokens.weight", (v, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q, h)),
                (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, q)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                (p + "mlp.down_proj.weight", (h, f))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def make_hf(dst: Path, layers: int) -> None:
    """The Hugging Face folder: seeded fp32 tensors in shards of at most 1 GiB, with an index."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    tmp = dst.with_name(dst.name + ".partial")
    remove(tmp)
    tmp.mkdir(parents=True)
    cfg = LlamaConfig(num_hidden_layers=layers, tie_word_embeddings=False, hidden_act="silu",
                      attention_bias=False, mlp_bias=False, torch_dtype=torch.float32, **MODEL)
    cfg.save_pretrained(str(tmp))
    names = hf_names(layers)
    groups, cur, size = [], [], 0
    for n, shape in names:
        b = 4 * int(torch.tensor(shape).prod())
        if cur and size + b > SHARD_BYTES:
            groups.append(cur)
            cur, size = [], 0
        cur.append((n, shape))
        size += b
    groups.append(cur)
    g = torch.Generator().manual_seed(1234)
    weight_map, total = {}, 0
    for k, grp in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for n, shape in grp:
            t = torch.randn(shape, generator=g, dtype=torch.float32) * 0.02
            if "norm" in n:
                t += 1.0
            tensors[n] = t
            weight_map[n] = fname
            total += t.numel() * 4
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        del tensors
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    tmp.rename(dst)


def model_dict(hf: Path) -> dict:
    """The megatron-side configuration (as scripts/gen_frameworks.py's BASE) of the HF folder."""
    c = json.loads((hf / "config.json").read_text())
    m = dict(num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"],
             ffn_hidden_size=c["intermediate_size"], num_attention_heads=c["num_attention_heads"],
             num_query_groups=c["num_key_value_heads"], kv_channels=c["head_dim"],
             max_position_embeddings=c["max_position_embeddings"], rotary_base=int(c.get("rope_theta") or c["rope_parameters"]["rope_theta"]),
             norm_epsilon=c["rms_norm_eps"], vocab_size=c["vocab_size"], make_vocab_size_divisible_by=128,
             add_qkv_bias=False, tied=False, num_experts=None, moe_ffn_hidden_size=None, moe_router_topk=2,
             moe_grouped_gemm=False, hf="llama")
    m["padded_vocab_size"] = -(-m["vocab_size"] // 128) * 128
    return m


# --------------------------------------------------------------------------- the mbridge side (workers)

def _init():
    """torch.distributed (gloo, world size 1, no torchrun) and the CPU shims megatron and mbridge
    need (as scripts/gen_frameworks.py)."""
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    import torch
    import torch.distributed as dist

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.set_num_threads(os.cpu_count() or 1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return torch, dist


def build_model(m: dict):
    """The GPTModel (local layer spec) on CPU, parameters allocated and not initialised."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"], ffn_hidden_size=m["ffn_hidden_size"],
        num_attention_heads=m["num_attention_heads"], num_query_groups=m["num_query_groups"],
        kv_channels=m["kv_channels"], normalization="RMSNorm", layernorm_epsilon=m["norm_epsilon"],
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=m["add_qkv_bias"],
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, use_cpu_initialization=True, perform_initialization=False,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=m["padded_vocab_size"],
                     max_sequence_length=m["max_position_embeddings"], pre_process=True, post_process=True,
                     parallel_output=False, share_embeddings_and_output_weights=m["tied"],
                     position_embedding_type="rope", rotary_base=m["rotary_base"])
    model.eval()
    return model


def make_bridge(m: dict, hf: Path):
    """mbridge's LLaMABridge for the local layer spec (its separate norms named, as
    scripts/gen_frameworks.py does), reading and writing with hf's shard layout."""
    import torch
    from mbridge.core.safetensor_io import SafeTensorIO
    from mbridge.models.llama import LLaMABridge as B
    from transformers import AutoConfig

    class LocalSpec(B):
        _ATTENTION_MAPPING = dict(B._ATTENTION_MAPPING)
        _MLP_MAPPING = {"pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
                        **B._MLP_MAPPING}
        _DIRECT_MAPPING = dict(B._DIRECT_MAPPING)
        _OTHER_MAPPING = {"input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}

    bridge = LocalSpec(AutoConfig.from_pretrained(str(hf)), dtype=torch.float32,
                       make_vocab_size_divisible_by=m["padded_vocab_size"])
    bridge.vocab_size, bridge.padded_vocab_size = m["vocab_size"], m["padded_vocab_size"]
    bridge.safetensor_io = SafeTensorIO(str(hf))
    return bridge


def worker_hf2mc(args) -> None:
    """mbridge: HF folder -> megatron-core torch_dist (args.dst, an empty folder made here)."""
    torch, dist = _init()
    from megatron.core import dist_checkpointing

    hf, dst = Path(args.src), Path(args.dst)
    m = model_dict(hf)
    model = build_model(m)
    bridge = make_bridge(m, hf)
    bridge.load_weights([model], str(hf))
    dst.mkdir(parents=True)
    dist_checkpointing.save({"model": model.sharded_state_dict(metadata=META)}, str(dst), content_metadata=META)
    dist.barrier()
    dist.destroy_process_group()


def worker_mc2hf(args) -> None:
    """mbridge: megatron-core torch_dist (an iter_ folder) -> HF folder, with the source HF
    folder (args.ref) as the configuration and shard layout."""
    torch, dist = _init()
    from megatron.core import dist_checkpointing

    ref, dst = Path(args.ref), Path(args.dst)
    m = model_dict(ref)
    model = build_model(m)
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=META)}, args.src)
    model.load_state_dict(loaded["model"], strict=True)
    del loaded
    bridge = make_bridge(m, ref)
    bridge.save_weights([model], str(dst))
    dist.barrier()
    dist.destroy_process_group()


def worker_gen_mcore(args) -> None:
    """The megatron source: the model filled from the HF folder by mbridge, saved as Megatron-LM's
    save_checkpoint would (args, checkpoint_version, iteration beside the model)."""
    torch, dist = _init()
    from megatron.core import dist_checkpointing

    sys.path.insert(0, str(SCRIPTS))
    import gen_frameworks as gf

    hf, dst = Path(args.src), Path(args.dst)
    m = model_dict(hf)
    model = build_model(m)
    make_bridge(m, hf).load_weights([model], str(hf))
    margs = gf.megatron_lm_args(m, 1, 1, 1, "torch_dist", Path(args.megatron_lm))
    it = dst / f"iter_{ITERATION:07d}"
    it.mkdir(parents=True)
    sd = {"args": margs, "checkpoint_version": 3.0, "iteration": ITERATION,
          "model": model.sharded_state_dict(metadata=META), "num_floating_point_operations_so_far": 0}
    dist_checkpointing.save(sd, str(it), content_metadata=META)
    (dst / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dist.barrier()
    dist.destroy_process_group()


def worker_check(args) -> None:
    """Check an output (args.dst) against the source (args.src): megatron or HF by args.ref."""
    import warnings

    warnings.filterwarnings("ignore")  # (torch's "no process group" notes)
    if args.ref == "megatron":
        n = check_mcore(Path(args.dst), Path(args.src))
    else:
        n = check_hf(Path(args.dst), Path(args.src))
    print(n)


WORKERS = {"hf2mc": worker_hf2mc, "mc2hf": worker_mc2hf, "gen-mcore": worker_gen_mcore, "check": worker_check}


def worker_cmd(mode: str, **kw) -> list[str]:
    cmd = [PY, str(Path(__file__).resolve()), "--worker", mode]
    for k, v in kw.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    return cmd


def worker_env() -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                LOCAL_RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1", PYTHONWARNINGS="ignore")


# --------------------------------------------------------------------------- checking

def iter_dir(d: Path) -> Path:
    """The iter_ folder of a Megatron-LM save directory, or d itself."""
    f = d / "latest_checkpointed_iteration.txt"
    if f.is_file():
        t = f.read_text().strip()
        return d / (t if t == "release" else f"iter_{int(t):07d}")
    return d


def dcp_tensors(d: Path):
    """(name, tensor) of every tensor of a torch_dist checkpoint, read whole by torch."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    d = iter_dir(d)
    md = dcp.FileSystemReader(str(d)).read_metadata().state_dict_metadata
    for k, v in sorted(md.items()):
        if isinstance(v, TensorStorageMetadata):
            t = torch.empty(tuple(v.size), dtype=v.properties.dtype)
            dcp.load({k: t}, storage_reader=dcp.FileSystemReader(str(d)), no_dist=True)
            yield k, t


def check_mcore(got: Path, want: Path) -> int:
    """Every tensor of want (a torch_dist checkpoint) is in got with the same dtype, shape and
    values; returns the number compared."""
    import torch

    have = dict(dcp_tensors(got))
    n = 0
    for k, t in dcp_tensors(want):
        if k not in have:
            sys.exit(f"{got}: no tensor {k}")
        g = have.pop(k)
        if g.dtype != t.dtype or g.shape != t.shape or not torch.equal(g, t):
            sys.exit(f"{got}: {k} differs from {want}'s")
        n += 1
    return n


def hf_tensors(d: Path):
    from safetensors import safe_open

    for p in sorted(d.glob("*.safetensors")):
        with safe_open(str(p), "pt") as f:
            for k in f.keys():
                yield k, f.get_tensor(k)


def check_hf(got: Path, want: Path) -> int:
    """got holds exactly want's tensors, equal in dtype, shape and values (and a config.json)."""
    import torch

    if not (got / "config.json").is_file():
        sys.exit(f"{got}: no config.json")
    have = {}
    from safetensors import safe_open

    for p in sorted(got.glob("*.safetensors")):
        with safe_open(str(p), "pt") as f:
            for k in f.keys():
                have[k] = p
    n = 0
    for k, t in hf_tensors(want):
        if k not in have:
            sys.exit(f"{got}: no tensor {k}")
        with safe_open(str(have.pop(k)), "pt") as f:
            g = f.get_tensor(k)
        if g.dtype != t.dtype or g.shape != t.shape or not torch.equal(g, t):
            sys.exit(f"{got}: {k} differs from {want}'s")
        n += 1
    if have:
        sys.exit(f"{got}: tensors the source lacks: {sorted(have)[:5]}")
    return n


# --------------------------------------------------------------------------- driver

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/reshard-bench-frameworks"),
                    help="where the model (kept) and the outputs (deleted) go (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (default %(default)s)")
    ap.add_argument("--layers", type=int, default=12, help="decoder layers of the model (default %(default)s: 2.50 GiB)")
    ap.add_argument("--reshard", default=str(ROOT / "target" / "release" / "reshard"),
                    help="the reshard binary (default: target/release/reshard; $CARGO_TARGET_DIR is honoured)")
    ap.add_argument("--wheel", default=None,
                    help="also time this `reshard` command (the Python package's, e.g. .venv/bin/reshard)")
    ap.add_argument("--megatron-lm", type=Path,
                    default=Path(os.environ.get("RESHARD_MEGATRON_LM",
                                                Path.home() / ".cache/reshard/megatron-lm-core_v0.16.1")),
                    help="Megatron-LM sources at tag core_v0.16.1 (for the args of the megatron source)")
    ap.add_argument("--directions", default="hf2mc,mc2hf", help="which directions to time (default %(default)s)")
    ap.add_argument("--no-mbridge", action="store_true", help="time reshard only")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # a small model, to test the script
    ap.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    ap.add_argument("--src", help=argparse.SUPPRESS)
    ap.add_argument("--dst", help=argparse.SUPPRESS)
    ap.add_argument("--ref", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        WORKERS[args.worker](args)
        return

    if args.tiny:
        MODEL.update(hidden_size=256, intermediate_size=704, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, vocab_size=1000)
    reshard = args.reshard
    if "CARGO_TARGET_DIR" in os.environ and args.reshard == ap.get_default("reshard"):
        reshard = str(Path(os.environ["CARGO_TARGET_DIR"]) / "release" / "reshard")
    if not Path(reshard).is_file():
        ap.error(f"no reshard binary at {reshard} (cargo build --release, or --reshard)")
    wheel = args.wheel
    if wheel and not Path(wheel).is_file():
        ap.error(f"no reshard command at {wheel}")

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    hf, mc = work / "hf", work / "mcore"
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    if not hf.is_dir():
        t = time.monotonic()
        make_hf(hf, args.layers)
        print(f"made {hf} ({dir_bytes(hf) / 2**30:.2f} GiB) in {time.monotonic() - t:.0f} s", file=sys.stderr)
    elif json.loads((hf / "config.json").read_text())["num_hidden_layers"] != args.layers:
        sys.exit(f"{hf} has another number of layers: delete it or pass --layers")
    if not mc.is_dir():
        if not (args.megatron_lm / "megatron" / "training" / "arguments.py").is_file():
            ap.error(f"no Megatron-LM training sources at {args.megatron_lm} (see --help)")
        t = time.monotonic()
        tmp = work / "mcore.partial"
        remove(tmp)
        measure(worker_cmd("gen-mcore", src=hf, dst=tmp, megatron_lm=args.megatron_lm), env=worker_env(),
                log=logs / "gen-mcore.log")
        tmp.rename(mc)
        print(f"made {mc} ({dir_bytes(mc) / 2**30:.2f} GiB) with megatron-core in {time.monotonic() - t:.0f} s",
              file=sys.stderr)

    # (label, direction, source, command for an output path, env)
    rows = []
    dirs = args.directions.split(",")
    if "hf2mc" in dirs:
        rows.append(("reshard (release binary)", "hf2mc", hf, lambda o: [reshard, "convert", hf, o, "--format", "megatron", "-q"], None))
        rows.append(("reshard --no-fsync", "hf2mc", hf, lambda o: [reshard, "convert", hf, o, "--format", "megatron", "-q", "--no-fsync"], None))
        if wheel:
            rows.append(("reshard (Python package's command)", "hf2mc", hf, lambda o: [wheel, "convert", hf, o, "--format", "megatron", "-q"], None))
        if not args.no_mbridge:
            rows.append(("mbridge (load_weights + dist_checkpointing.save)", "hf2mc", hf,
                         lambda o: worker_cmd("hf2mc", src=hf, dst=o), "worker"))
    if "mc2hf" in dirs:
        rows.append(("reshard (release binary)", "mc2hf", mc, lambda o: [reshard, "convert", mc, o, "--format", "hf", "-q"], None))
        rows.append(("reshard --no-fsync", "mc2hf", mc, lambda o: [reshard, "convert", mc, o, "--format", "hf", "-q", "--no-fsync"], None))
        if wheel:
            rows.append(("reshard (Python package's command)", "mc2hf", mc, lambda o: [wheel, "convert", mc, o, "--format", "hf", "-q"], None))
        if not args.no_mbridge:
            rows.append(("mbridge (dist_checkpointing.load + save_weights)", "mc2hf", mc,
                         lambda o: worker_cmd("mc2hf", src=iter_dir(mc), ref=hf, dst=o), "worker"))
    if not args.no_mbridge:
        rows.append(("Python: import megatron.core, mbridge, transformers only", "imports", hf,
                     lambda o: [PY, "-c", "import megatron.core, mbridge, transformers"], None))

    out = work / "out"

    def run_row(row, log):
        label, direction, src, mk, kind = row
        remove(out)
        os.sync()
        warm(src)
        env = worker_env() if kind else None
        r = measure([str(c) for c in mk(out)], env=env, log=log)
        return r

    # checks: every contender once, untimed, its output against the source
    for row in rows:
        label, direction, src = row[:3]
        run_row(row, logs / "check.log")
        if direction in ("hf2mc", "mc2hf"):
            want, kind = (mc, "megatron") if direction == "hf2mc" else (hf, "hf")
            r = subprocess.run(worker_cmd("check", src=want, dst=out, ref=kind), capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"{label} ({direction}): {r.stderr.strip()[-2000:]}")
            print(f"checked: {direction} {label}: {r.stdout.strip()} tensors equal to {want}'s", file=sys.stderr)
    remove(out)

    load_start = open("/proc/loadavg").read().split()[:3]
    res = {i: [] for i in range(len(rows))}
    order = list(range(len(rows)))
    for r in range(args.rounds):
        seq = order if r % 2 == 0 else order[::-1]
        for i in seq:
            res[i].append(run_row(rows[i], logs / "round.log"))
        remove(out)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{rows[i][0][:20]} {res[i][-1]['wall']:.2f}s" for i in order),
              file=sys.stderr, flush=True)

    summary = []
    for i, row in enumerate(rows):
        rs = res[i]
        summary.append({"label": row[0], "direction": row[1], "walls": [x["wall"] for x in rs],
                        "wall": statistics.median(x["wall"] for x in rs), "rss": max(x["rss"] for x in rs),
                        "anon": max(x["anon"] for x in rs), "tree_pss": max(x["tree_pss"] for x in rs),
                        "tree_anon": max(x["tree_anon"] for x in rs)})
    state = {"loadavg_start": load_start, "loadavg_end": open("/proc/loadavg").read().split()[:3], "machine": platform.platform(),
             "cores": os.cpu_count(), "hf_bytes": dir_bytes(hf), "mcore_bytes": dir_bytes(mc),
             "rounds": args.rounds, "reshard": reshard, "wheel": wheel}
    for direction, title in (("hf2mc", "HF -> megatron torch_dist"), ("mc2hf", "megatron torch_dist -> HF"),
                             ("imports", "imports")):
        rs = [s for s in summary if s["direction"] == direction]
        if not rs:
            continue
        peer = next((s for s in rs if s["label"].startswith("mbridge")), None)
        print(f"\n{title}\n")
        print("| contender | median wall (s) | rounds (s) | peak RSS (MiB) | peak RssAnon (MiB) | tree Pss (MiB) "
              "| tree Pss_Anon (MiB) | time / mbridge | RSS / mbridge |")
        print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
        for s in rs:
            rt = f"{s['wall'] / peer['wall']:.3f}" if peer else ""
            rm = f"{s['rss'] / peer['rss']:.4f}" if peer else ""
            print(f"| {s['label']} | {s['wall']:.2f} | {' '.join(f'{w:.2f}' for w in s['walls'])} | "
                  f"{s['rss'] / 2**20:.0f} | {s['anon'] / 2**20:.1f} | {s['tree_pss'] / 2**20:.0f} | "
                  f"{s['tree_anon'] / 2**20:.1f} | {rt} | {rm} |")
    print(f"\n{json.dumps(state)}")
    if args.json:
        args.json.write_text(json.dumps({"state": state, "results": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
