"""Block-quantized FP8 weights (DeepSeek-V3 style) dequantized by ``reshard.convert(...,
dtype=...)``, judged by DeepSeek-V3's ``weight_dequant`` formula in torch on CPU:
``(x.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:M, :N]).to(dtype)``
— on the committed fixture (``scripts/gen_fp8.py``: a tiny Llama whose linear layers are
quantized as transformers' FineGrainedFP8 quantizer does, with partial edge blocks), on every
one of the 256 FP8 byte values, and by the logits of the model loaded from reshard's output."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import reshard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import _quiet  # noqa: E402,F401  (_quiet: an autouse fixture)

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "fp8" / "checkpoint"


def weight_dequant(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype, block=(128, 128)) -> torch.Tensor:
    m, n = q.shape
    full = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:m, :n]
    return (q.to(torch.float32) * full).to(dtype)


def torch_dequantized(sd: dict, dtype: torch.dtype) -> dict:
    out = {}
    for k, v in sd.items():
        if k.endswith("_scale_inv"):
            continue
        if v.dtype == torch.float8_e4m3fn:
            out[k] = weight_dequant(v, sd[k + "_scale_inv"], dtype)
        else:
            out[k] = v.to(dtype)
    return out


def read_folder(path: Path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype,name", [(torch.bfloat16, "bfloat16"), (torch.float32, "float32")])
def test_convert_dequantizes_as_weight_dequant(tmp_path, dtype, name):
    src = load_file(FIXTURE / "model.safetensors")
    want = torch_dequantized(src, dtype)
    dst = tmp_path / "out"
    reshard.convert(str(FIXTURE), str(dst), world_size=1, dtype=name)
    got = read_folder(dst)
    assert sorted(got) == sorted(want)
    for k in want:
        assert bits_equal(got[k], want[k]), k
    config = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in config


def test_every_fp8_byte_and_partial_blocks(tmp_path):
    # all 256 byte values (NaN's payload aside), in a [200, 300] weight: blocks 2 × 3, the
    # last row and column of blocks partial, each block its own scale
    g = torch.Generator().manual_seed(1)
    q = (torch.arange(200 * 300) * 7 % 256).to(torch.uint8)
    q[(q == 0x7F) | (q == 0xFF)] = 0x11
    q = q.reshape(200, 300).view(torch.float8_e4m3fn)
    s = torch.rand(2, 3, generator=g) * 1e-2 + 1e-4
    s[1, 2] = 3.0e38  # products beyond bf16's range round to infinity, as torch's do
    src = tmp_path / "src"
    src.mkdir()
    save_file({"w.weight": q, "w.weight_scale_inv": s}, str(src / "model.safetensors"))
    for dtype, name in [(torch.bfloat16, "bf16"), (torch.float16, "f16"), (torch.float32, "f32")]:
        dst = tmp_path / name
        reshard.convert(str(src), str(dst), world_size=1, dtype=name)
        got = read_folder(dst)
        assert list(got) == ["w.weight"]
        assert bits_equal(got["w.weight"], weight_dequant(q, s, dtype)), name


def test_without_dtype_fp8_is_kept(tmp_path):
    dst = tmp_path / "out"
    reshard.convert(str(FIXTURE), str(dst), world_size=1)
    src = load_file(FIXTURE / "model.safetensors")
    got = read_folder(dst)
    assert sorted(got) == sorted(src)
    for k in src:
        assert bits_equal(got[k], src[k]), k


def test_logits_of_the_dequantized_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    dst = tmp_path / "out"
    reshard.convert(str(FIXTURE), str(dst), world_size=1, dtype="bfloat16")
    # the reference: torch's dequantized weights, saved beside the same config
    ref_dir = tmp_path / "ref"
    ref_dir.mkdir()
    (ref_dir / "config.json").write_text((dst / "config.json").read_text())
    want = torch_dequantized(load_file(FIXTURE / "model.safetensors"), torch.bfloat16)
    save_file(want, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    load = transformers.AutoModelForCausalLM.from_pretrained
    model, ref = load(str(dst), dtype=torch.bfloat16), load(str(ref_dir), dtype=torch.bfloat16)
    cfg = model.config
    ids = torch.arange(12).reshape(2, 6) % cfg.vocab_size
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)


def test_malformed_scale_is_an_error_naming_the_file(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    q = torch.zeros(200, 300).to(torch.float8_e4m3fn)
    save_file({"w.weight": q, "w.weight_scale_inv": torch.ones(2, 2)}, str(src / "model.safetensors"))
    with pytest.raises(reshard.ReshardError, match=r"model\.safetensors.*w\.weight_scale_inv has shape \[2, 2\]"):
        reshard.convert(str(src), str(tmp_path / "out"), world_size=1, dtype="bf16")
