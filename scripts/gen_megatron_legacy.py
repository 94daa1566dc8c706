#!/usr/bin/env python3
"""Generate Megatron-LM legacy per-rank checkpoints (``--ckpt-format torch``) for reshard's tests.

No process group is needed: the GLOBAL tensors of a tiny Llama-like megatron-core GPT (GQA,
SwiGLU, RMSNorm, untied embeddings, padded vocabulary) are made from a seed, each rank's local
shards are cut from them by Megatron's rules, and each rank's dict is ``torch.save``d where
Megatron-LM's ``save_checkpoint`` puts it (``megatron/training/checkpointing.py``):

  <case>/checkpoint/latest_checkpointed_iteration.txt          "7"
  <case>/checkpoint/iter_0000007/mp_rank_TT[_PPP]/model_optim_rng.pt

each file ``{"args": argparse.Namespace(<Megatron-LM's argument names>), "checkpoint_version":
3.0, "iteration": 7, "model": <that rank's module state dict>, "optimizer": …,
"opt_param_scheduler": …, "rng_state": [{random, np, torch, cuda, rng_tracker}],
"num_floating_point_operations_so_far": …}`` (``generate_state_dict``). The model state dict
is megatron-core's ``GPTModel.state_dict()``: LOCAL layer indices (``decoder.layers.{i}`` within
the stage), the layers' local TP shards:

  - column-parallel (``linear_qkv``, ``linear_fc1``, embedding, output layer): rank r holds rows
    chunk r; with SwiGLU ``linear_fc1`` is ``[gate; up]`` globally and rank r holds
    ``[gate_r; up_r]`` (megatron-core's ``apply_swiglu_sharded_factory``);
  - row-parallel (``linear_proj``, ``linear_fc2``): rank r holds columns chunk r;
  - norms (and row-parallel biases) replicated.

Layer norms: the local spec (``transformer_impl="local"``) names them ``input_layernorm.weight``
/ ``pre_mlp_layernorm.weight``; the TransformerEngine spec fuses them into
``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight`` and adds ``_extra_state``
entries (a ``BytesIO`` in older TransformerEngine, a uint8 tensor in newer).

Output: ``tests/fixtures/megatron_legacy/<case>/checkpoint/…`` and
``tests/fixtures/megatron_legacy/<config>.safetensors``, the GLOBAL tensors under the names
reshard presents them by (megatron-core's ``torch_dist`` names, per layer with the global
layer index): ``embedding.word_embeddings.weight``, ``decoder.layers.{i}.self_attention.
linear_qkv.{layer_norm_weight,weight,bias}``, ``….linear_proj.weight``, ``decoder.layers.{i}.mlp.
linear_fc1.{layer_norm_weight,weight}``, ``….linear_fc2.weight``, ``decoder.final_layernorm.
weight``, ``output_layer.weight``.

Usage: .venv/bin/python scripts/gen_megatron_legacy.py [--out tests/fixtures/megatron_legacy]
"""
from __future__ import annotations

import argparse
import io
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

ITERATION = 7

# tiny Llama-like: hidden 8, 4 heads of dim 2 in 2 query groups, FFN 12, 4 layers,
# vocabulary 13 padded to 16 (divisible by 2 x make_vocab_size_divisible_by)
CONFIGS = {
    "llama": dict(hidden=8, heads=4, groups=2, head_dim=2, ffn=12, layers=4, vocab=13, padded=16,
                  qkv_bias=False, te=False, dtype=torch.float32),
    # Qwen2-like q/k/v biases, TransformerEngine names, bf16
    "qwen_te": dict(hidden=8, heads=4, groups=2, head_dim=2, ffn=12, layers=4, vocab=13, padded=16,
                    qkv_bias=True, te=True, dtype=torch.bfloat16),
}

# mixture of experts: 4 experts of FFN 6 (SequentialMLP, local spec), a router, 2 layers
CONFIGS["moe"] = dict(CONFIGS["llama"], layers=2, experts=4, expert_ffn=6)

CASES = {
    "tp2": ("llama", 2, 1),
    "pp2": ("llama", 1, 2),
    "tp2_pp2": ("llama", 2, 2),
    "te_qkv_bias_tp2_pp2": ("qwen_te", 2, 2),
    "moe_tp2_ep2": ("moe", 2, 1, 2),
}


def global_tensors(c: dict, seed: int) -> dict[str, torch.Tensor]:
    """The model's global tensors under their torch_dist names (global layer index)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(c["dtype"])

    h, hd, ng, heads, f = c["hidden"], c["head_dim"], c["groups"], c["heads"], c["ffn"]
    qkv_rows = (heads + 2 * ng) * hd  # ng * (heads/ng + 2) * hd
    out = {"embedding.word_embeddings.weight": rand(c["padded"], h)}
    for i in range(c["layers"]):
        p = f"decoder.layers.{i}."
        out[p + "self_attention.linear_qkv.layer_norm_weight"] = rand(h)
        out[p + "self_attention.linear_qkv.weight"] = rand(qkv_rows, h)
        if c["qkv_bias"]:
            out[p + "self_attention.linear_qkv.bias"] = rand(qkv_rows)
        out[p + "self_attention.linear_proj.weight"] = rand(h, heads * hd)
        out[p + "mlp.linear_fc1.layer_norm_weight"] = rand(h)
        if c.get("experts"):
            fe = c["expert_ffn"]
            out[p + "mlp.router.weight"] = rand(c["experts"], h)
            for e in range(c["experts"]):
                q = f"{p}mlp.experts.local_experts.{e}."
                out[q + "linear_fc1.weight"] = rand(2 * fe, h)
                out[q + "linear_fc2.weight"] = rand(h, fe)
            continue
        out[p + "mlp.linear_fc1.weight"] = rand(2 * f, h)  # [gate; up]
        out[p + "mlp.linear_fc2.weight"] = rand(h, f)
    out["decoder.final_layernorm.weight"] = rand(h)
    out["output_layer.weight"] = rand(c["padded"], h)
    return out


def local_state_dict(c: dict, full: dict, tp: int, pp: int, t: int, s: int, ep: int = 1,
                     e: int = 0) -> dict:
    """Rank (t, s, e)'s ``GPTModel.state_dict()``: local layer indices, local TP shards, the
    expert rank's experts under local expert indices (``SequentialMLP.local_experts``)."""
    per = c["layers"] // pp
    first, last = s == 0, s == pp - 1
    sd = {}

    def rows(x):
        return x.chunk(tp, dim=0)[t].clone()

    def cols(x):
        return x.chunk(tp, dim=1)[t].clone()

    if first:
        sd["embedding.word_embeddings.weight"] = rows(full["embedding.word_embeddings.weight"])
    for li in range(per):
        gi = s * per + li
        gp, lp = f"decoder.layers.{gi}.", f"decoder.layers.{li}."
        qkv_norm = full[gp + "self_attention.linear_qkv.layer_norm_weight"].clone()
        fc1_norm = full[gp + "mlp.linear_fc1.layer_norm_weight"].clone()
        if not c["te"]:
            sd[lp + "input_layernorm.weight"] = qkv_norm
        else:
            sd[lp + "self_attention.linear_qkv.layer_norm_weight"] = qkv_norm
        sd[lp + "self_attention.linear_qkv.weight"] = rows(full[gp + "self_attention.linear_qkv.weight"])
        if c["qkv_bias"]:
            sd[lp + "self_attention.linear_qkv.bias"] = rows(full[gp + "self_attention.linear_qkv.bias"])
        if c["te"]:
            # older TransformerEngine: a BytesIO of torch.save(None)
            buf = io.BytesIO()
            torch.save(None, buf)
            buf.seek(0)
            sd[lp + "self_attention.linear_qkv._extra_state"] = buf
            sd[lp + "self_attention.core_attention._extra_state"] = None
        sd[lp + "self_attention.linear_proj.weight"] = cols(full[gp + "self_attention.linear_proj.weight"])
        if not c["te"]:
            sd[lp + "pre_mlp_layernorm.weight"] = fc1_norm
        else:
            sd[lp + "mlp.linear_fc1.layer_norm_weight"] = fc1_norm
        if c.get("experts"):
            sd[lp + "mlp.router.weight"] = full[gp + "mlp.router.weight"].clone()
            per = c["experts"] // ep
            for le in range(per):
                gq = f"{gp}mlp.experts.local_experts.{e * per + le}."
                lq = f"{lp}mlp.experts.local_experts.{le}."
                gate, up = full[gq + "linear_fc1.weight"].chunk(2, dim=0)
                sd[lq + "linear_fc1.weight"] = torch.cat([rows(gate), rows(up)], dim=0)
                sd[lq + "linear_fc2.weight"] = cols(full[gq + "linear_fc2.weight"])
            continue
        gate, up = full[gp + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        sd[lp + "mlp.linear_fc1.weight"] = torch.cat([rows(gate), rows(up)], dim=0)
        if c["te"]:
            # newer TransformerEngine: a uint8 tensor
            sd[lp + "mlp.linear_fc1._extra_state"] = torch.tensor([1, 2, 3], dtype=torch.uint8)
        sd[lp + "mlp.linear_fc2.weight"] = cols(full[gp + "mlp.linear_fc2.weight"])
    if last:
        sd["decoder.final_layernorm.weight"] = full["decoder.final_layernorm.weight"].clone()
        sd["output_layer.weight"] = rows(full["output_layer.weight"])
    return sd


def megatron_args(c: dict, tp: int, pp: int, ep: int = 1) -> argparse.Namespace:
    """The arguments Megatron-LM saves (its own argument names; a subset of the ~500)."""
    return argparse.Namespace(
        num_layers=c["layers"],
        hidden_size=c["hidden"],
        ffn_hidden_size=c["ffn"],
        num_attention_heads=c["heads"],
        group_query_attention=True,
        num_query_groups=c["groups"],
        kv_channels=c["head_dim"],
        swiglu=True,
        normalization="RMSNorm",
        norm_epsilon=1e-5,
        position_embedding_type="rope",
        rotary_base=10000,
        add_bias_linear=False,
        add_qkv_bias=c["qkv_bias"],
        untie_embeddings_and_output_weights=True,
        vocab_size=c["vocab"],
        padded_vocab_size=c["padded"],
        make_vocab_size_divisible_by=8,
        max_position_embeddings=64,
        seq_length=32,
        transformer_impl="transformer_engine" if c["te"] else "local",
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=None,
        num_layers_per_virtual_pipeline_stage=None,
        decoder_first_pipeline_num_layers=None,
        decoder_last_pipeline_num_layers=None,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=tp,
        num_experts=c.get("experts"),
        moe_ffn_hidden_size=c.get("expert_ffn"),
        moe_router_topk=2,
        moe_grouped_gemm=False,
        context_parallel_size=1,
        data_parallel_size=1,
        world_size=tp * pp * ep,
        params_dtype=c["dtype"],
        bf16=c["dtype"] == torch.bfloat16,
        fp16=False,
        ckpt_format="torch",
        use_distributed_optimizer=False,
        iteration=ITERATION,
        consumed_train_samples=ITERATION * 4,
    )


def rng_state(seed: int, full: bool) -> list:
    """``get_rng_state`` of one rank (no CUDA here: the CPU generator's state stands for the
    CUDA ones). ``full``: Python's, numpy's and torch's states as Megatron-LM saves them;
    otherwise a small stand-in, to keep the fixtures small."""
    if not full:
        return [{"torch_rng_state": torch.tensor([seed % 256], dtype=torch.uint8)}]
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    state = torch.get_rng_state()
    return [{
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": state,
        "cuda_rng_state": state,
        "rng_tracker_states": {"model-parallel-rng": state},
    }]


def generate(out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    fulls = {}
    for name, c in CONFIGS.items():
        fulls[name] = global_tensors(c, seed=1234)
        save_file(fulls[name], str(out / f"{name}.safetensors"))
    for case, (cfg, tp, pp, *more) in CASES.items():
        ep = more[0] if more else 1
        c, full = CONFIGS[cfg], fulls[cfg]
        root = out / case / "checkpoint"
        it = root / f"iter_{ITERATION:07d}"
        for s, e, t in ((s, e, t) for s in range(pp) for e in range(ep) for t in range(tp)):
            if True:
                # get_checkpoint_name: mp_rank_TT, _PPP with pipeline parallelism, _EEE with
                # expert parallelism
                folder = f"mp_rank_{t:02d}" + (f"_{s:03d}" if pp > 1 else "") + (
                    f"_{e:03d}" if ep > 1 else "")
                model = local_state_dict(c, full, tp, pp, t, s, ep, e)
                first = next(v for v in model.values() if isinstance(v, torch.Tensor))
                sd = {
                    "args": megatron_args(c, tp, pp, ep),
                    "checkpoint_version": 3.0,
                    "iteration": ITERATION,
                    "model": model,
                    # Float16OptimizerWithFloat16Params-like: each rank's own state
                    "optimizer": {
                        "optimizer": {
                            "state": {0: {"exp_avg": torch.zeros_like(first, dtype=torch.float32),
                                          "step": torch.tensor(float(ITERATION))}},
                            "param_groups": [{"lr": 1e-4, "params": [0]}],
                        },
                        "fp32_from_fp16_params": [[first.float()]],
                    },
                    "opt_param_scheduler": {"max_lr": 1e-4, "num_steps": ITERATION * 4},
                    "rng_state": rng_state(1000 + t + tp * s, full=case == "tp2"),
                    "num_floating_point_operations_so_far": 123456,
                }
                (it / folder).mkdir(parents=True)
                torch.save(sd, it / folder / "model_optim_rng.pt")
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"{out}: {total} bytes")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("tests/fixtures/megatron_legacy"))
    generate(ap.parse_args().out)
