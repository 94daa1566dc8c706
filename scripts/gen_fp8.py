#!/usr/bin/env python3
"""Generate the block-quantized FP8 fixture (DeepSeek-V3 style) for reshard's tests.

A tiny LlamaForCausalLM (hidden 136, intermediate 200, 1 layer: every linear layer's shape
leaves partial edge blocks of 128×128) is built by transformers with a fixed seed, its
linear layers' weights quantized to float8_e4m3fn with per-128×128-block `weight_scale_inv`
(f32, [ceil(M/128), ceil(N/128)]) as transformers' FineGrainedFP8 quantizer
(`Fp8Quantize._quantize_one`) computes them: scale = 448 / amax (amax 0: 1), inv = 1 / scale,
q = clamp(x · scale, ±448).to(float8_e4m3fn). transformers' quantizer leaves tensors whose
shape is not a multiple of the block alone; DeepSeek-V3's checkpoints have such tensors
(kv_a_proj_with_mqa [576, 7168]), so the same formula is applied over zero-padded blocks, and
checked here bit for bit against transformers' own function on a tensor whose shape divides.
Embeddings, norms and lm_head stay bf16, as in DeepSeek-V3's checkpoints.

Output, under <out> (default tests/fixtures/fp8):

  checkpoint/model.safetensors   the FP8 weights, their scales, the bf16 rest
  checkpoint/config.json         the model's config with quantization_config (fp8, e4m3,
                                 dynamic, weight_block_size [128, 128])
  expected.json                  per tensor of the dequantized output: dtype, shape and the
                                 CRC-32 of its bytes as bf16 and as f32, by DeepSeek-V3's
                                 weight_dequant in torch on CPU:
                                 (x.float() * s.repeat_interleave(128, 0)
                                  .repeat_interleave(128, 1)[:M, :N]).to(dtype)
  expected_k_proj_bf16.safetensors   one dequantized tensor's bytes in full
  case.json                      versions and what was checked

Usage: python scripts/gen_fp8.py [--out tests/fixtures/fp8]
"""
from __future__ import annotations

import argparse
import json
import os
import zlib

import torch

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Fp8Quantize._quantize_one over zero-padded 128×128 blocks."""
    m, n = w.shape
    mb, nb = -(-m // BLOCK), -(-n // BLOCK)
    x = torch.zeros(mb * BLOCK, nb * BLOCK, dtype=torch.float32)
    x[:m, :n] = w.to(torch.float32)
    blocks = x.reshape(mb, BLOCK, nb, BLOCK)
    max_abs = blocks.abs().amax(dim=(-3, -1))
    safe = torch.where(max_abs > 0, max_abs, torch.ones_like(max_abs))
    scales = FP8_MAX / safe
    scales = torch.where(max_abs > 0, scales, torch.ones_like(scales))
    inv = (1.0 / scales).to(torch.float32)
    q = torch.clamp(blocks * scales.unsqueeze(-1).unsqueeze(-3), min=-FP8_MAX, max=FP8_MAX).to(FP8)
    return q.reshape(mb * BLOCK, nb * BLOCK)[:m, :n].contiguous(), inv


def dequantize(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """DeepSeek-V3's weight_dequant (inference/kernel.py) on CPU."""
    m, n = q.shape
    full = s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:m, :n]
    return (q.to(torch.float32) * full).to(dtype)


def cross_check_transformers() -> str:
    """Our quantize equals transformers' own on a shape that divides into blocks."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    class _Q:  # the quantizer object Fp8Quantize reads its config from
        quantization_config = FineGrainedFP8Config(weight_block_size=[BLOCK, BLOCK])

    g = torch.Generator().manual_seed(7)
    w = (torch.randn(256, 384, generator=g) * 0.05).to(torch.bfloat16)
    w[0, 0] = 0  # a zero and a whole zero block
    w[128:, 256:] = 0
    out = Fp8Quantize(_Q())._quantize_one("x.weight", w)
    q, inv = quantize(w)
    assert torch.equal(out["x.weight"].view(torch.uint8), q.view(torch.uint8)), "fp8 bytes differ"
    assert torch.equal(out["x.weight_scale_inv"], inv), "scales differ"
    return "quantize == transformers Fp8Quantize._quantize_one (256×384, bf16, a zero block)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="tests/fixtures/fp8")
    a = ap.parse_args()
    import transformers
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    checked = [cross_check_transformers()]
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=136,
        intermediate_size=200,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=34,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():  # weights wide enough that blocks differ in scale
            p.mul_(1 + torch.rand(()) * 3)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors: dict[str, torch.Tensor] = {}
    quantized = []
    for k, v in sd.items():
        # DeepSeek-V3 quantizes the linear layers' weights only
        if v.ndim == 2 and k.endswith("_proj.weight"):
            q, inv = quantize(v)
            tensors[k] = q
            tensors[k + "_scale_inv"] = inv
            quantized.append(k)
        else:
            tensors[k] = v
    ck = os.path.join(a.out, "checkpoint")
    os.makedirs(ck, exist_ok=True)
    save_file(tensors, os.path.join(ck, "model.safetensors"), metadata={"format": "pt"})
    conf = cfg.to_dict()
    conf["quantization_config"] = QUANT_CONFIG
    conf["torch_dtype"] = "bfloat16"
    with open(os.path.join(ck, "config.json"), "w") as f:
        json.dump(conf, f, indent=2, sort_keys=True)
        f.write("\n")

    def crc(t: torch.Tensor) -> int:
        return zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes())

    expected = {}
    for k, v in tensors.items():
        if k.endswith("_scale_inv"):
            continue
        if k in quantized:
            s = tensors[k + "_scale_inv"]
            bf, f32 = dequantize(v, s, torch.bfloat16), dequantize(v, s, torch.float32)
        else:
            bf, f32 = v, v.to(torch.float32)
        expected[k] = {"shape": list(v.shape), "bf16_crc32": crc(bf), "f32_crc32": crc(f32)}
    with open(os.path.join(a.out, "expected.json"), "w") as f:
        json.dump({"block": [BLOCK, BLOCK], "quantized": quantized, "tensors": expected}, f, indent=1, sort_keys=True)
        f.write("\n")
    k = "model.layers.0.self_attn.k_proj.weight"
    save_file(
        {k: dequantize(tensors[k], tensors[k + "_scale_inv"], torch.bfloat16)},
        os.path.join(a.out, "expected_k_proj_bf16.safetensors"),
    )
    with open(os.path.join(a.out, "case.json"), "w") as f:
        json.dump(
            {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "model": "LlamaForCausalLM, hidden 136, intermediate 200, 1 layer, vocab 64",
                "quantized": len(quantized),
                "checked": checked,
            },
            f,
            indent=1,
        )
        f.write("\n")
    print(f"wrote {a.out}: {len(quantized)} quantized weights")


if __name__ == "__main__":
    main()
