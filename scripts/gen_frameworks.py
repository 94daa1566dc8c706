#!/usr/bin/env python3
"""Generate the ground truth for conversions between frameworks: tiny REAL megatron-core models
(GPTModel, the local Llama-style layer spec), their checkpoints in Megatron-LM's two formats, and
mbridge's export of the same weights to a Hugging Face folder.

Every case builds a seeded megatron-core 0.16.1 GPTModel on CPU under torchrun (gloo, one process
per TP x PP rank): RMSNorm, SwiGLU (gated_linear_unit), grouped-query attention (num_query_groups <
heads), RoPE, fp32, untied embeddings unless the case says tied, q/k/v biases for the Qwen2 cases,
a vocabulary of 96 padded by Megatron-LM's rule (make_vocab_size_divisible_by 128 x TP) so that
padding rows exist; and Mixtral-like mixture-of-experts cases (4 experts, top 2, expert-parallel
over 2 processes) with megatron-core's SequentialMLP experts and with its GroupedMLP experts
(`moe_grouped_gemm`; built with the grouped_gemm package's availability check stubbed and its
weights loaded from the SequentialMLP model, whose logits and export it shares: GroupedMLP runs
only on CUDA in bf16); and a Qwen2-MoE-like case (q/k/v biases, 4 experts top 2 with the softmax
before the top-k, a shared expert with its sigmoid gate; TP 2 x EP 2, the experts split over TP
too). Every parameter is then overwritten with seeded values (norms around 1, biases
non-zero, the padding rows of the vocabulary random as in a trained model), the model computes its
logits on fixed tokens, and it is saved. Output, per case, under <out>/<case>/:

  torch_dist/    a Megatron-LM save directory: latest_checkpointed_iteration.txt ("7") and
                 iter_0000007/, saved by `dist_checkpointing.save` from the model's own
                 `sharded_state_dict()` with what Megatron-LM's save_checkpoint puts beside it:
                 common.pt holds `args` (the argparse.Namespace of Megatron-LM's own parse_args +
                 validate_args at tag core_v0.16.1, for this model), `checkpoint_version` 3.0,
                 `iteration` 7 and `num_floating_point_operations_so_far`; `rng_state` is the
                 (PP, TP)-sharded ShardedObject Megatron-LM saves
  legacy/        the same weights as Megatron-LM's `--ckpt-format torch` save:
                 latest_checkpointed_iteration.txt and iter_0000007/mp_rank_TT[_PPP]/model_optim_rng.pt,
                 each a torch.save of {args (ckpt_format 'torch'), checkpoint_version 3.0, iteration,
                 model (that rank's `state_dict_for_save_checkpoint()`), rng_state (a list of one dict),
                 num_floating_point_operations_so_far}; no optimizer (as with --no-save-optim)
  hf_mbridge/    mbridge 0.15.1's `save_weights` of the model: config.json + model.safetensors
  inputs.json    the token ids the logits are for ({"input_ids": [[...], ...]})
  logits.safetensors  "logits": the megatron model's fp32 logits, [batch, seq, vocab], gathered over
                 TP and trimmed to the real vocabulary
  case.json      the case: tp, pp, ep, the model configuration, versions, files and sizes, and the
                 maximum difference between the megatron logits and transformers' logits of
                 hf_mbridge/ (checked here: <= 1e-5)

Usage:
  python3 scripts/gen_frameworks.py [--out tests/fixtures/frameworks] [--only NAME ...] [--list]
        [--megatron-lm DIR]

Needs the project's venv with megatron-core 0.16.1, transformers and mbridge
(scripts/setup_venv.sh --frameworks), and Megatron-LM's training sources at tag core_v0.16.1 for
the saved `args` (megatron-core's wheel has no megatron/training): DIR, or $RESHARD_MEGATRON_LM, or
~/.cache/reshard/megatron-lm-core_v0.16.1, made with
  git clone --depth 1 --branch core_v0.16.1 https://github.com/NVIDIA/Megatron-LM DIR
(megatron.training, .legacy, .rl and .post_training are imported from it; megatron.core stays the
venv's, which is the same release).

What it took on CPU: torch.cuda.synchronize a no-op and torch.cuda.current_device returning "cpu"
(megatron's checkpoint writer and mbridge call them), Tensor.cuda() the tensor itself (a tied
output layer on the last PP stage); initialize_rng_tracker(inference_rng_tracker=
True); the causal attention mask passed explicitly (megatron builds its default on cuda); the
pipeline stages run by hand (stage 0's hidden states sent to stage 1 with dist.send); for MoE,
moe_utils.te_general_gemm = None and the `allgather` token dispatcher (`alltoall` makes CUDA
streams), and Megatron-LM's validate_args told the device is a Hopper (it asks CUDA about grouped
GEMM); mbridge sees SequentialMLP's experts under TransformerEngine's grouped names (a proxy
renames `local_experts.<e>.linear_fc1.weight` to `linear_fc1.weight<e>`); mbridge's name
table extended with the local spec's two norms (input_layernorm, pre_mlp_layernorm: mbridge knows
TransformerEngine's fused names only) and its vocabulary sizes set by hand (its own model builder
sets them, and needs TransformerEngine); Megatron-LM's validate_args told the device is pre-Blackwell
(it asks CUDA). The script is import-safe: megatron's writer starts a `spawn` Manager that
re-imports the main module.
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
ITERATION = 7
VOCAB = 96
# the tokens the logits are for: fixed, and reaching the top of the vocabulary
INPUT_IDS = [[1, 17, 42, 95, 3, 64, 8, 77, 30, 5], [94, 0, 12, 55, 61, 2, 88, 19, 40, 71]]

# the tiny Llama-style model every case shares (per-case overrides in CASES)
BASE = dict(num_layers=4, hidden_size=16, ffn_hidden_size=40, num_attention_heads=4, num_query_groups=2,
            kv_channels=4, max_position_embeddings=64, rotary_base=10000, norm_epsilon=1e-5,
            vocab_size=VOCAB, make_vocab_size_divisible_by=128, add_qkv_bias=False, tied=False,
            num_experts=None, moe_ffn_hidden_size=None, moe_router_topk=2, moe_grouped_gemm=False, hf="llama")

# name -> (tp, pp, ep, overrides of BASE)
CASES: dict[str, dict] = {
    "llama_tp2": dict(tp=2, pp=1, ep=1),
    "llama_pp2": dict(tp=1, pp=2, ep=1),
    "llama_tp2_pp2": dict(tp=2, pp=2, ep=1),
    "qwen2_tp2": dict(tp=2, pp=1, ep=1, model=dict(add_qkv_bias=True, hf="qwen2")),
    "llama_tied_tp2": dict(tp=2, pp=1, ep=1, model=dict(tied=True)),
    # Mixtral-like: 4 experts, top 2, megatron-core's SequentialMLP experts (the local spec),
    # expert-parallel over 2 processes (which are also the dense part's 2 data-parallel ranks)
    "mixtral_ep2": dict(tp=1, pp=1, ep=2, model=dict(num_experts=4, moe_ffn_hidden_size=24, ffn_hidden_size=24,
                                                     hf="mixtral")),
    # the same with megatron-core's GroupedMLP experts (moe_grouped_gemm): the logits and the
    # Hugging Face export come from the SequentialMLP model the weights are loaded from
    "mixtral_gg_ep2": dict(tp=1, pp=1, ep=2, model=dict(num_experts=4, moe_ffn_hidden_size=24, ffn_hidden_size=24,
                                                        moe_grouped_gemm=True, hf="mixtral")),
    # Qwen2-MoE-like: q/k/v biases, 4 routed experts (top 2, softmax before the top-k and no
    # renormalisation: megatron-core's moe_router_pre_softmax, transformers' norm_topk_prob=False)
    # and a shared expert with its sigmoid gate, at TP 2 x EP 2 (the experts split over TP too);
    # a dense FFN size of its own (Hugging Face's intermediate_size, unused by all-MoE layers); 2 layers
    "qwen2moe_tp2_ep2": dict(tp=2, pp=1, ep=2, model=dict(num_layers=2, num_experts=4, moe_ffn_hidden_size=24,
                                                          moe_shared_expert_intermediate_size=32,
                                                          moe_shared_expert_gate=True, moe_router_pre_softmax=True,
                                                          add_qkv_bias=True, hf="qwen2_moe")),
}


def model_config(case: str) -> dict:
    """The model configuration of a case (BASE with the case's overrides, padded vocabulary added)."""
    spec = CASES[case]
    m = dict(BASE, **spec.get("model", {}))
    mult = m["make_vocab_size_divisible_by"] * spec["tp"]
    m["padded_vocab_size"] = -(-m["vocab_size"] // mult) * mult
    return m


def default_megatron_lm() -> Path:
    return Path(os.environ.get("RESHARD_MEGATRON_LM",
                               Path.home() / ".cache/reshard/megatron-lm-core_v0.16.1"))


# --------------------------------------------------------------------------- CPU shims

def _init():
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.disable(logging.WARNING)
    import torch
    import torch.distributed as dist

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    # (tied embeddings with PP > 1: the last stage's output weight is moved to CUDA before the
    # embedding group's all-reduce)
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return torch, dist


def _parallel(tp, pp, ep):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep)
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return parallel_state


# --------------------------------------------------------------------------- Megatron-LM's args

def megatron_lm_args(m: dict, tp: int, pp: int, ep: int, ckpt_format: str, mlm: Path, extra=()):
    """The argparse.Namespace Megatron-LM's own parse_args + validate_args (tag core_v0.16.1)
    produce for this model, as pretrain_gpt.py would be started for it (with the options `extra`
    added), with padded_vocab_size set the way its tokenizer builder sets it."""
    if str(mlm) not in sys.path:
        sys.path.append(str(mlm))  # after site-packages: megatron.core stays the venv's
    import contextlib
    import io

    from megatron.training import arguments
    from megatron.training.tokenizer.tokenizer import _vocab_size_with_padding

    argv = ["pretrain_gpt.py", "--num-layers", str(m["num_layers"]), "--hidden-size", str(m["hidden_size"]),
            "--ffn-hidden-size", str(m["ffn_hidden_size"]), "--num-attention-heads", str(m["num_attention_heads"]),
            "--group-query-attention", "--num-query-groups", str(m["num_query_groups"]),
            "--kv-channels", str(m["kv_channels"]),
            "--seq-length", str(len(INPUT_IDS[0])), "--max-position-embeddings", str(m["max_position_embeddings"]),
            "--position-embedding-type", "rope", "--rotary-base", str(m["rotary_base"]),
            "--normalization", "RMSNorm", "--norm-epsilon", str(m["norm_epsilon"]), "--swiglu",
            "--disable-bias-linear", "--attention-dropout", "0", "--hidden-dropout", "0",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--expert-model-parallel-size", str(ep),
            "--vocab-size", str(m["vocab_size"]), "--tokenizer-type", "NullTokenizer",
            "--make-vocab-size-divisible-by", str(m["make_vocab_size_divisible_by"]),
            "--transformer-impl", "local", "--ckpt-format", ckpt_format,
            "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "10",
            "--lr", "1e-4", "--seed", "1234", "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion", "--no-rope-fusion",
            "--save", "checkpoints", "--load", "checkpoints", "--save-interval", str(ITERATION), *extra]
    if not m["tied"]:
        argv.append("--untie-embeddings-and-output-weights")
    if m["add_qkv_bias"]:
        argv.append("--add-qkv-bias")
    if m["num_experts"]:
        argv += ["--num-experts", str(m["num_experts"]), "--moe-ffn-hidden-size", str(m["moe_ffn_hidden_size"]),
                 "--moe-router-topk", str(m["moe_router_topk"]), "--moe-token-dispatcher-type", "allgather",
                 "--moe-router-load-balancing-type", "aux_loss"]
        if m["moe_grouped_gemm"]:
            argv.append("--moe-grouped-gemm")
        if m.get("moe_shared_expert_intermediate_size"):
            argv += ["--moe-shared-expert-intermediate-size", str(m["moe_shared_expert_intermediate_size"])]
        if m.get("moe_shared_expert_gate"):
            argv.append("--moe-shared-expert-gate")
        if m.get("moe_router_pre_softmax"):
            argv.append("--moe-router-pre-softmax")
    old = sys.argv
    sys.argv = argv
    arguments.get_device_arch_version = lambda: 9  # validate_args asks CUDA; a Hopper's answers
    import torch

    capability = torch.cuda.get_device_capability
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            args = arguments.parse_args()
            args.padded_vocab_size = _vocab_size_with_padding(m["vocab_size"], args, logging_enabled=False)
            arguments.validate_args(args, {})
    finally:
        sys.argv = old
        torch.cuda.get_device_capability = capability
    assert args.padded_vocab_size == m["padded_vocab_size"], (args.padded_vocab_size, m)
    return args


# --------------------------------------------------------------------------- the model

def build_model(m: dict, tp: int, pp: int, ep: int, pp_rank: int):
    """This rank's stage of the GPTModel (local layer spec), every parameter set from a seed."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    moe = {}
    if m["num_experts"]:
        from megatron.core.transformer.moe import moe_utils

        moe_utils.te_general_gemm = None  # (a TransformerEngine kernel it would try on CPU)
        moe = dict(num_moe_experts=m["num_experts"], moe_ffn_hidden_size=m["moe_ffn_hidden_size"],
                   moe_router_topk=m["moe_router_topk"], moe_grouped_gemm=m["moe_grouped_gemm"],
                   moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="aux_loss",
                   moe_aux_loss_coeff=0.0, expert_model_parallel_size=ep,
                   moe_shared_expert_intermediate_size=m.get("moe_shared_expert_intermediate_size"),
                   moe_shared_expert_gate=bool(m.get("moe_shared_expert_gate")),
                   moe_router_pre_softmax=bool(m.get("moe_router_pre_softmax")))
    cfg = TransformerConfig(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"], ffn_hidden_size=m["ffn_hidden_size"],
        num_attention_heads=m["num_attention_heads"], num_query_groups=m["num_query_groups"],
        kv_channels=m["kv_channels"], normalization="RMSNorm", layernorm_epsilon=m["norm_epsilon"],
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=m["add_qkv_bias"],
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False, **moe)
    spec = get_gpt_layer_local_spec(num_experts=m["num_experts"], moe_grouped_gemm=m["moe_grouped_gemm"],
                                    normalization="RMSNorm")
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=m["padded_vocab_size"],
                     max_sequence_length=m["max_position_embeddings"], pre_process=pp_rank == 0,
                     post_process=pp_rank == pp - 1, parallel_output=False,
                     share_embeddings_and_output_weights=m["tied"], position_embedding_type="rope",
                     rotary_base=m["rotary_base"])
    model.eval()
    return model


def seed_parameters(model, tp_rank: int, pp_rank: int, ep_rank: int) -> None:
    """Overwrite every parameter with seeded values: a replicated parameter's seed is its name
    and stage (equal on every TP rank), a TP-split one's adds the TP rank; norms ~ 1 + 0.1 N(0, 1),
    the rest 0.1 N(0, 1) (the vocabulary's padding rows included)."""
    import zlib

    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            split = bool(getattr(p, "tensor_model_parallel", False))
            key = f"{name}|pp{pp_rank}|tp{tp_rank if split else '-'}|ep{ep_rank if 'mlp.experts.' in name else '-'}"
            g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            v = torch.randn(p.shape, generator=g, dtype=torch.float32) * 0.1
            if "norm" in name:
                v += 1.0
            p.copy_(v)


def forward_logits(model, m, pp, pp_rank, pp_group, dist):
    """The logits of INPUT_IDS ([batch, seq, vocab], trimmed to the real vocabulary) on the last
    stage, None elsewhere; the stages are run by hand, stage i's hidden states sent to i + 1."""
    import torch

    ids = torch.tensor(INPUT_IDS, dtype=torch.long)
    b, s = ids.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s).expand(b, 1, s, s)
    ranks = dist.get_process_group_ranks(pp_group)
    with torch.no_grad():
        if pp_rank > 0:
            h = torch.empty(s, b, m["hidden_size"], dtype=torch.float32)
            dist.recv(h, src=ranks[pp_rank - 1])
            model.set_input_tensor(h)
        out = model(ids if pp_rank == 0 else None, pos, mask)
        if pp_rank < pp - 1:
            dist.send(out.contiguous(), dst=ranks[pp_rank + 1])
            return None
    return out[..., :m["vocab_size"]].contiguous()


# --------------------------------------------------------------------------- mbridge

def mbridge_export(model, m: dict, out: Path) -> None:
    """mbridge's save_weights of the model (every rank takes part; rank 0 writes)."""
    import torch
    from mbridge.core.safetensor_io import SafeTensorIO

    cfg = hf_config(m)
    if m["hf"] == "qwen2":
        from mbridge.models.qwen2 import Qwen2Bridge as B
    elif m["hf"] == "qwen2_moe":
        from mbridge.models.qwen2moe import Qwen2MoEBridge as B
    elif m["hf"] == "mixtral":
        from mbridge.models.mixtral import MixtralBridge as B
    else:
        from mbridge.models.llama import LLaMABridge as B

    # the local layer spec's separate norms, which mbridge (written for TransformerEngine's fused
    # linear_qkv.layer_norm_weight / linear_fc1.layer_norm_weight) does not name
    class LocalSpec(B):
        _ATTENTION_MAPPING = dict(B._ATTENTION_MAPPING)
        _MLP_MAPPING = {"pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"],
                        **B._MLP_MAPPING}
        _DIRECT_MAPPING = dict(B._DIRECT_MAPPING)
        _OTHER_MAPPING = {"input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]}

    bridge = LocalSpec(cfg, dtype=torch.float32, make_vocab_size_divisible_by=m["padded_vocab_size"])
    # what mbridge's own model builder sets (it needs TransformerEngine to run)
    bridge.vocab_size, bridge.padded_vocab_size = m["vocab_size"], m["padded_vocab_size"]
    empty = Path(tempfile.mkdtemp())
    bridge.safetensor_io = SafeTensorIO(str(empty))  # no index: one model.safetensors
    bridge.save_weights([_GroupedExpertNames(model) if m["num_experts"] else model], str(out))


class _GroupedExpertNames:
    """A model seen by mbridge with TransformerEngine's grouped-expert names: mbridge maps
    `mlp.experts.linear_fc1.weight<e>` (TEGroupedMLP) only, and the local spec's SequentialMLP
    names the same tensor `mlp.experts.local_experts.<e>.linear_fc1.weight`."""

    def __init__(self, model):
        self._model = model
        self.decoder = model.decoder

    @staticmethod
    def _rename(name):
        import re

        return re.sub(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight", r"mlp.experts.\2.weight\1", name)

    def named_parameters(self):
        for n, p in self._model.named_parameters():
            yield self._rename(n), p

    def state_dict(self):
        return {self._rename(k): v for k, v in self._model.state_dict().items()}


def hf_config(m: dict):
    """The transformers configuration of the model."""
    import torch
    from transformers import LlamaConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig

    common = dict(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"], intermediate_size=m["ffn_hidden_size"],
                  num_hidden_layers=m["num_layers"], num_attention_heads=m["num_attention_heads"],
                  num_key_value_heads=m["num_query_groups"], head_dim=m["kv_channels"],
                  max_position_embeddings=m["max_position_embeddings"], rms_norm_eps=m["norm_epsilon"],
                  rope_theta=float(m["rotary_base"]), tie_word_embeddings=m["tied"], hidden_act="silu",
                  attention_dropout=0.0, torch_dtype=torch.float32)
    if m["hf"] == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if m["hf"] == "mixtral":
        common["intermediate_size"] = m["moe_ffn_hidden_size"]
        return MixtralConfig(**common, num_local_experts=m["num_experts"], num_experts_per_tok=m["moe_router_topk"],
                             router_aux_loss_coef=0.0, sliding_window=None)
    if m["hf"] == "qwen2_moe":
        return Qwen2MoeConfig(**common, use_sliding_window=False, num_experts=m["num_experts"],
                              num_experts_per_tok=m["moe_router_topk"], moe_intermediate_size=m["moe_ffn_hidden_size"],
                              shared_expert_intermediate_size=m["moe_shared_expert_intermediate_size"],
                              norm_topk_prob=not m["moe_router_pre_softmax"], decoder_sparse_step=1,
                              mlp_only_layers=[], qkv_bias=True, router_aux_loss_coef=0.0)
    return LlamaConfig(**common, attention_bias=m["add_qkv_bias"], mlp_bias=False)


# --------------------------------------------------------------------------- workers

def grouped_gemm_twin(model, m, tp, pp, ep, pp_rank, out: Path):
    """The same weights in megatron-core's GroupedMLP experts (`moe_grouped_gemm`): built with
    the grouped_gemm package's availability check stubbed (its CUDA kernels, and bf16, are needed
    for a forward pass only), and loaded through dist_checkpointing from the SequentialMLP model
    (the two save the same keys and global shapes)."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.transformer.moe import grouped_gemm_util

    tmp = out / "_sequential"
    if dist.get_rank() == 0:
        tmp.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(model.sharded_state_dict(), str(tmp))
    dist.barrier()
    grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    twin = build_model(m, tp, pp, ep, pp_rank)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    twin.load_state_dict(dist_checkpointing.load(twin.sharded_state_dict(), str(tmp)), strict=True)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(tmp)
    return twin


def _rng_state(tp_rank):
    """What Megatron-LM's get_rng_state collects, less cuda_rng_state (no CUDA here)."""
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    return {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}


def worker_save(args):
    torch, dist = _init()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject
    from safetensors.torch import save_file

    spec = CASES[args.case]
    m = model_config(args.case)
    tp, pp, ep = spec["tp"], spec["pp"], spec["ep"]
    ps = _parallel(tp, pp, ep)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    dp_rank = ps.get_data_parallel_rank()
    rank = dist.get_rank()
    import random

    import numpy as np

    random.seed(1234)  # (the saved rng_state holds Python's, numpy's and torch's generators)
    np.random.seed(1234)
    torch.manual_seed(1234)
    seq = dict(m, moe_grouped_gemm=False)
    model = build_model(seq, tp, pp, ep, pp_rank)
    seed_parameters(model, tp_rank, pp_rank, ep_rank)
    out = Path(args.dir)
    logits = forward_logits(model, m, pp, pp_rank, ps.get_pipeline_model_parallel_group(), dist)
    if logits is not None and tp_rank == 0 and ep_rank == 0 and dp_rank == 0:
        save_file({"logits": logits}, str(out / "logits.safetensors"))
    exporter = model
    if m["moe_grouped_gemm"]:
        model = grouped_gemm_twin(model, m, tp, pp, ep, pp_rank, out)

    mlm = Path(args.megatron_lm)
    flops = 123456789
    # --- torch_dist: what Megatron-LM's save_checkpoint hands dist_checkpointing.save
    it = f"iter_{ITERATION:07d}"
    margs = megatron_lm_args(m, tp, pp, ep, "torch_dist", mlm)
    content_metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    rng = ShardedObject("rng_state", [_rng_state(tp_rank)], (pp, tp), (pp_rank, tp_rank), replica_id=dp_rank)
    sd = {"args": margs, "checkpoint_version": 3.0, "iteration": ITERATION,
          "model": model.sharded_state_dict(metadata=content_metadata), "rng_state": rng,
          "num_floating_point_operations_so_far": flops}
    td = out / "torch_dist"
    if rank == 0:
        (td / it).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sd, str(td / it), content_metadata=content_metadata)
    dist.barrier()
    if rank == 0:
        (td / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))

    # --- legacy (--ckpt-format torch): one file per (TP, PP) rank, written by DP rank 0
    largs = megatron_lm_args(m, tp, pp, ep, "torch", mlm)
    # as Megatron-LM: every (TP, PP, EP) shard written once, by a rank that is first in its
    # data-parallel group or in its expert-data-parallel group
    if dp_rank == 0 or ps.get_expert_data_parallel_rank() == 0:
        name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
        if ep > 1:
            name += f"_{ep_rank:03d}"
        d = out / "legacy" / it / name
        d.mkdir(parents=True, exist_ok=True)
        torch.save({"args": largs, "checkpoint_version": 3.0, "iteration": ITERATION,
                    "model": model.state_dict_for_save_checkpoint(), "rng_state": [_rng_state(tp_rank)],
                    "num_floating_point_operations_so_far": flops}, str(d / "model_optim_rng.pt"))
    dist.barrier()
    if rank == 0:
        (out / "legacy" / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))

    # --- mbridge's Hugging Face export
    mbridge_export(exporter, m, out / "hf_mbridge")
    dist.barrier()
    dist.destroy_process_group()


def padded_vocab_of(ckpt: Path) -> int:
    """The padded vocabulary a torch_dist checkpoint (an iter_ folder) was saved with: the rows of
    its word embeddings (or, without them, its output layer)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    for k in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if k in md:
            return int(md[k].size[0])
    raise SystemExit(f"{ckpt}: no word embeddings or output layer")


def worker_reload(args):
    """Load a torch_dist checkpoint (an iter_ folder) into a GPTModel at (--tp, --pp, --ep) the
    way Megatron-LM does (the model's whole sharded_state_dict() requested with
    dist_checkpointing.load, then model.load_state_dict(strict=True); every parameter zeroed
    before) and write its logits (first rank of the last stage) to --json."""
    torch, dist = _init()
    from megatron.core import dist_checkpointing
    from safetensors.torch import save_file

    # (GroupedMLP experts run only on CUDA in bf16: a grouped-GEMM case loads into SequentialMLP's,
    # which saves the same keys and shapes)
    m = dict(model_config(args.case), padded_vocab_size=padded_vocab_of(Path(args.dir)), moe_grouped_gemm=False)
    tp, pp, ep = args.tp, args.pp, args.ep
    ps = _parallel(tp, pp, ep)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    model = build_model(m, tp, pp, ep, pp_rank)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    meta = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=meta)}, args.dir)
    model.load_state_dict(loaded["model"], strict=True)
    logits = forward_logits(model, m, pp, pp_rank, ps.get_pipeline_model_parallel_group(), dist)
    if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        save_file({"logits": logits}, args.json)
    dist.barrier()
    dist.destroy_process_group()


def worker_mlm_load(args):
    """Load a Megatron-LM save directory (--dir: the tracker file beside iter_ folders, either
    format inside) into a GPTModel at (--tp, --pp, --ep) with Megatron-LM's own load_checkpoint
    (--load, --no-load-optim, --no-load-rng, strict; every parameter zeroed before) and write
    its logits and the iteration loaded to --json (a safetensors file). Needs Megatron-LM's
    training sources (--megatron-lm), which are not on PyPI."""
    torch, dist = _init()
    if str(args.megatron_lm) not in sys.path:
        sys.path.append(str(args.megatron_lm))  # after site-packages: megatron.core stays the venv's
    from megatron.training import global_vars
    from megatron.training.checkpointing import load_checkpoint
    from safetensors.torch import save_file

    d = Path(args.dir)
    it = d / f"iter_{int((d / 'latest_checkpointed_iteration.txt').read_text().strip()):07d}"
    legacy = not (it / "metadata.json").is_file()
    tp, pp, ep = args.tp, args.pp, args.ep
    m = dict(model_config(args.case), moe_grouped_gemm=False)
    # the vocabulary as Megatron-LM pads it for this TP (what its GPTModel is built with)
    step = m["make_vocab_size_divisible_by"] * tp
    m["padded_vocab_size"] = -(-m["vocab_size"] // step) * step
    ps = _parallel(tp, pp, ep)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    model = build_model(m, tp, pp, ep, pp_rank)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    margs = megatron_lm_args(m, tp, pp, ep, "torch" if legacy else "torch_dist", Path(args.megatron_lm))
    margs.load = str(d)
    margs.no_load_optim = True
    margs.no_load_rng = True
    margs.exit_on_missing_checkpoint = True
    global_vars.set_args(margs)
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    dp = ps.get_data_parallel_world_size()
    init_num_microbatches_calculator(dist.get_rank(), None, dp, 1, dp, False)
    plain = torch.tensor  # (read_metadata all-reduces the tracked iteration as a CUDA tensor)

    def on_cpu(*a, **k):
        if str(k.get("device", "")).startswith("cuda"):
            k["device"] = "cpu"
        return plain(*a, **k)

    torch.tensor = on_cpu
    iteration, _ = load_checkpoint([model], None, None, strict=True)
    logits = forward_logits(model, m, pp, pp_rank, ps.get_pipeline_model_parallel_group(), dist)
    if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        save_file({"logits": logits, "iteration": torch.tensor([iteration])}, args.json)
    dist.barrier()
    dist.destroy_process_group()


def worker_reshard_load(args):
    """Fill a GPTModel at (--tp, --pp, --ep) from the checkpoint --dir with reshard.torch.load
    of its sharded_state_dict() (every parameter zeroed before): a Hugging Face folder through
    --recipe (with the recipe's tp set to --tp, for the vocabulary's padding), or a torch_dist
    checkpoint as it is; write its logits to --json."""
    torch, dist = _init()
    import reshard.torch
    from safetensors.torch import save_file

    tp, pp, ep = args.tp, args.pp, args.ep
    m = dict(model_config(args.case), moe_grouped_gemm=False)
    if args.recipe:
        step = m["make_vocab_size_divisible_by"] * tp
        m["padded_vocab_size"] = -(-m["vocab_size"] // step) * step
    else:
        d = Path(args.dir)
        tracker = d / "latest_checkpointed_iteration.txt"
        if tracker.is_file():  # a save directory: its tracked iteration
            d = d / f"iter_{int(tracker.read_text().strip()):07d}"
        m["padded_vocab_size"] = padded_vocab_of(d)
    ps = _parallel(tp, pp, ep)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    model = build_model(m, tp, pp, ep, pp_rank)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    meta = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    sd = model.sharded_state_dict(metadata=meta)
    if args.recipe:
        res = reshard.torch.load(sd, args.dir, recipe=args.recipe, params={"tp": tp})
    else:
        res = reshard.torch.load(sd, args.dir)
    assert (res.missing_keys, res.unexpected_keys) == ([], []), res
    logits = forward_logits(model, m, pp, pp_rank, ps.get_pipeline_model_parallel_group(), dist)
    if logits is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        save_file({"logits": logits}, args.json)
    dist.barrier()
    dist.destroy_process_group()


WORKERS = {"save": worker_save, "reload": worker_reload, "mlm_load": worker_mlm_load,
           "reshard_load": worker_reshard_load}


# --------------------------------------------------------------------------- driver

def hf_logits(folder: Path):
    """transformers' logits of INPUT_IDS from a Hugging Face folder (fp32, eager attention)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(INPUT_IDS)).logits


def generate(name: str, out_root: Path, megatron_lm: Path) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import megatron.core
    import mbridge
    import torch
    import transformers
    from safetensors.torch import load_file

    spec = CASES[name]
    nproc = spec["tp"] * spec["pp"] * spec["ep"]
    case = out_root / name
    if case.exists():
        shutil.rmtree(case)
    case.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        secs = job(name, Path(__file__), nproc,
                   ["--worker", "save", "--case", name, "--dir", str(case), "--megatron-lm", str(megatron_lm)],
                   env={"PYTHONWARNINGS": "ignore", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}, cwd=Path(tmp))
    (case / "inputs.json").write_text(json.dumps({"input_ids": INPUT_IDS}) + "\n")
    want = load_file(str(case / "logits.safetensors"))["logits"]
    got = hf_logits(case / "hf_mbridge")
    diff = float((got - want).abs().max())
    assert diff <= 1e-5, f"{name}: transformers' logits of mbridge's export differ from megatron's by {diff}"
    m = model_config(name)
    info = {"case": name, "tp": spec["tp"], "pp": spec["pp"], "ep": spec["ep"], "processes": nproc,
            "model": m, "hf_model_type": m["hf"], "iteration": ITERATION, "input_ids": INPUT_IDS,
            "hf_mbridge_logits_max_abs_diff": diff,
            "versions": {"torch": torch.__version__, "megatron_core": megatron.core.__version__,
                         "transformers": transformers.__version__, "mbridge": mbridge.__version__,
                         "megatron_lm_args": "core_v0.16.1"},
            "job_seconds": secs, "files": _gen.files(case)}
    _gen.write_case(case, info, "gen_frameworks", name, f"; logits vs transformers: {diff:.2e}")


def main():
    ap = _gen.parser(__doc__, REPO / "tests" / "fixtures" / "frameworks", list(WORKERS))
    ap.add_argument("--megatron-lm", type=Path, default=default_megatron_lm(),
                    help="Megatron-LM sources at tag core_v0.16.1 (for the saved args)")
    ap.add_argument("--tp", type=int, default=1, help=argparse_suppress())
    ap.add_argument("--pp", type=int, default=1, help=argparse_suppress())
    ap.add_argument("--ep", type=int, default=1, help=argparse_suppress())
    ap.add_argument("--json", help=argparse_suppress())
    ap.add_argument("--recipe", help=argparse_suppress())
    args = ap.parse_args()
    if args.mode:
        WORKERS[args.mode](args)
        return
    if not args.list and not (args.megatron_lm / "megatron" / "training" / "arguments.py").is_file():
        ap.error(f"no Megatron-LM training sources at {args.megatron_lm} (see --help)")
    _gen.generate_cases(ap, args, CASES, lambda n, out: generate(n, out, args.megatron_lm), "gen_frameworks")


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
