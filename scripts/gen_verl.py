#!/usr/bin/env python3
"""Generate REAL verl checkpoints (FSDPCheckpointManager's per-rank .pt shards) for reshard.

Every case runs verl's own ``FSDPCheckpointManager.save_checkpoint`` on CPU (gloo, under torchrun
with ``world`` local processes) after one AdamW step of a tiny Llama (transformers), wrapped
with FSDP2 (``fully_shard`` on a ``("fsdp",)`` mesh: DTensor ``Shard(0)``) or FSDP1
(``FullyShardedDataParallel``, saved as ``SHARDED_STATE_DICT``: ShardedTensor). Output, per
case, under <out>/<case>/:

  checkpoint/                  exactly what verl wrote: model_world_size_W_rank_R.pt,
                               optim_world_size_W_rank_R.pt, extra_state_world_size_W_rank_R.pt,
                               fsdp_config.json, huggingface/ (config.json, the tokenizer)
  oracle/model.safetensors     the model's full state dict after the step, gathered by torch
                               (``get_model_state_dict(full_state_dict=True)``), saved before
                               the checkpoint: what the shards hold
  oracle/merged.safetensors    verl's own model merger (``FSDPModelMerger``, ``merge``) on the
                               checkpoint, where it reads it (FSDP2); for the others the reason
                               it fails is in case.json
  oracle/optim.safetensors     the optimizer's full state (``get_optimizer_state_dict`` with
                               ``full_state_dict=True``), keys ``state.<fqn>.<name>``
  oracle/input.json            token ids and the source model's logits on them (fp32)
  case.json                    versions, world size, FSDP version, what it exercises

Usage:
  python scripts/gen_verl.py [--out tests/fixtures/verl] [--only NAME ...] [--list]
Needs: scripts/setup_venv.sh --verl (verl --no-deps and the dependencies its import needs).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
import _gen  # noqa: E402
from _torchrun import job  # noqa: E402

MODEL = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
             tie_word_embeddings=False, rms_norm_eps=1e-5)

CASES = {
    "fsdp2_w2": dict(fsdp=2, world=2, exercises=["FSDP2 DTensor Shard(0) on a ('fsdp',) mesh",
                                                   "uneven shards (vocab 64 x 16 over 2 ranks, kv 8 rows)",
                                                   "AdamW state as per-parameter DTensors"]),
    "fsdp2_w3": dict(fsdp=2, world=3, exercises=["FSDP2 over 3 ranks: uneven, padded last shard (24 rows -> 8,8,8; 8 -> 3,3,2)"]),
    "fsdp1_w2": dict(fsdp=1, world=2, exercises=["FSDP1 SHARDED_STATE_DICT: ShardedTensor per parameter",
                                                   "optimizer: flat padded slices per flattened group"]),
}
SEED = 1234


def build(spec):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    # architectures as from_pretrained would set it: verl saves the config only, and its
    # merger picks the auto class from it
    cfg = LlamaConfig(**MODEL, architectures=["LlamaForCausalLM"])
    model = LlamaForCausalLM(cfg).float()
    return model


def tokenizer():
    """A word-level tokenizer of the model's 64 ids, built here (nothing downloaded): verl saves
    it into huggingface/ and its merger loads it back."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, MODEL["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tokens():
    import torch

    g = torch.Generator().manual_seed(7)
    return torch.randint(0, MODEL["vocab_size"], (2, 9), generator=g)


def worker(args):
    import torch
    import torch.distributed as dist
    from omegaconf import OmegaConf
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = CASES[args.case]
    model = build(spec)
    if spec["fsdp"] == 2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
    else:
        import functools

        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
        wrapped = FSDP(model, auto_wrap_policy=policy, use_orig_params=True, device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    ids = tokens()
    out = wrapped(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()

    full = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    optim = get_optimizer_state_dict(wrapped, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    with torch.no_grad():
        logits = wrapped(input_ids=ids).logits.detach().float()

    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    ckpt_cfg = OmegaConf.create({"save_contents": ["model", "optimizer", "extra"],
                                 "load_contents": ["model", "optimizer", "extra"]})
    mgr = FSDPCheckpointManager(model=wrapped, optimizer=opt, lr_scheduler=sched, processing_class=tokenizer(),
                                checkpoint_config=ckpt_cfg)
    mgr.save_checkpoint(args.dir, global_step=1)
    dist.barrier()
    if rank == 0:
        oracle = Path(args.oracle)
        save_file({k: v.detach().clone().contiguous() for k, v in full.items()}, str(oracle / "model.safetensors"))
        flat = {}
        for fqn, st in optim["state"].items():
            for name, v in st.items():
                if torch.is_tensor(v):
                    flat[f"state.{fqn}.{name}"] = v.detach().clone().contiguous().reshape(v.shape)
        save_file(flat, str(oracle / "optim.safetensors"))
        (oracle / "input.json").write_text(json.dumps({
            "input_ids": ids.tolist(), "logits": logits.tolist(), "loss": float(out.loss)}) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def merge(ckpt: Path, oracle: Path):
    """verl's own merger, in this process; returns None or the reason it failed."""
    import tempfile

    from safetensors.torch import load_file, save_file
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    with tempfile.TemporaryDirectory() as tmp:
        try:
            cfg = ModelMergerConfig(operation="merge", backend="fsdp", local_dir=str(ckpt),
                                    target_dir=tmp, hf_model_config_path=str(ckpt / "huggingface"))
            FSDPModelMerger(cfg).merge_and_save()
        except Exception as e:  # a layout the merger cannot read: recorded in case.json
            return f"{type(e).__name__}: {e}".replace(str(ckpt), "<checkpoint>")[:300]
        sd = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            sd.update(load_file(str(f)))
        save_file({k: v.contiguous() for k, v in sd.items()}, str(oracle / "merged.safetensors"))
    return None


def generate(name, out):
    import torch
    import transformers
    import verl

    spec = CASES[name]
    case_dir = out / name
    if case_dir.exists():
        shutil.rmtree(case_dir)
    (case_dir / "oracle").mkdir(parents=True)
    ckpt = case_dir / "checkpoint"
    job("gen_verl", Path(__file__), spec["world"],
        ["--worker", "save", "--case", name, "--dir", str(ckpt), "--oracle", str(case_dir / "oracle")])
    err = merge(ckpt, case_dir / "oracle")
    info = dict(spec, verl=verl.__version__, torch=torch.__version__, transformers=transformers.__version__,
                model=MODEL, seed=SEED,
                writer="verl.utils.checkpoint.fsdp_checkpoint_manager.FSDPCheckpointManager.save_checkpoint",
                oracle="get_model_state_dict(full_state_dict=True) before saving; verl's FSDPModelMerger "
                       "(oracle/merged.safetensors) where it reads the checkpoint",
                files=_gen.files(ckpt))
    if err:
        info["merger_error"] = err
        print(f"gen_verl: {name}: verl's merger cannot read it: {err}")
    _gen.write_case(case_dir, info, "gen_verl", name)


def main():
    ap = _gen.parser(__doc__, REPO / "tests/fixtures/verl", ["save"])
    ap.add_argument("--oracle")
    args = ap.parse_args()
    if args.mode:
        return worker(args)
    _gen.generate_cases(ap, args, CASES, generate, "gen_verl")


if __name__ == "__main__":
    main()
