"""Megatron-LM ``--ckpt-format fsdp_dtensor`` checkpoints (Megatron-FSDP), judged by the models.

The fixtures (tests/fixtures/megatron_fsdp/<case>/, made by scripts/gen_megatron_fsdp.py) are the
tiny Llama-style megatron-core GPTModel of scripts/gen_frameworks.py wrapped in Megatron-FSDP at
TP 1 x FSDP 2 and TP 2 x FSDP 2 and saved the way Megatron-LM saves fsdp_dtensor, with the
megatron model's logits on fixed tokens. ``reshard convert`` turns each into a Hugging Face folder,
whose logits in transformers must be the megatron model's, and into a megatron-core ``torch_dist``
save directory, which megatron-core's ``dist_checkpointing.load`` reads into a GPTModel at TP 1 and
at TP 2 with the same logits. The harness checks itself first: torch's own DCP reader and the
fixture agree with the model's mbridge export, weight by weight.

Needs megatron-core and transformers in the venv (``scripts/setup_venv.sh --frameworks``; CI
installs them: there a missing one fails the tests); the megatron workers run under torchrun on
gloo.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import _quiet  # noqa: E402,F401  (_quiet: an autouse fixture)

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "megatron_fsdp"
sys.path.insert(0, str(REPO / "scripts"))
import _torchrun  # noqa: E402

from test_frameworks import GEN, close, hf_tensors, reshard_cli  # noqa: E402

NEEDS = ("megatron.core", "transformers")
MISSING = [m for m in NEEDS if importlib.util.find_spec(m.split(".")[0]) is None]
pytestmark = pytest.mark.skipif(
    bool(MISSING) and os.environ.get("CI") != "true",
    reason=f"{', '.join(MISSING)} not installed (scripts/setup_venv.sh --frameworks)",
)
CASES = ["llama_fsdp2", "llama_tp2_fsdp2"]
TOL = 1e-5
ITER = "iter_0000007"


def want_logits(case: str) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(FIXTURES / case / "logits.safetensors"))["logits"]


def input_ids(case: str) -> torch.Tensor:
    return torch.tensor(json.loads((FIXTURES / case / "inputs.json").read_text())["input_ids"])


def dcp_tensors(folder: Path) -> dict:
    """Every tensor of a DCP folder, whole, read by torch.distributed.checkpoint itself."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(folder)).read_metadata()
    sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
          for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    dcp.load(sd, checkpoint_id=str(folder), no_dist=True)
    return sd


def test_the_fixtures_are_there():
    for case in CASES:
        assert (FIXTURES / case / "fsdp_dtensor" / ITER / ".metadata").is_file(), case


@pytest.mark.parametrize("case", CASES)
def test_the_fixture_holds_the_exported_weights(case):
    # torch's reader on the fsdp_dtensor files, against mbridge's export of the same model:
    # weight_w / weight_v are the gate and up projections, the rest one to one
    sd = dcp_tensors(FIXTURES / case / "fsdp_dtensor" / ITER)
    hf = hf_tensors(FIXTURES / case / "hf_mbridge")
    vocab = hf["model.embed_tokens.weight"].shape[0]
    m = "model.module."
    assert torch.equal(sd[m + "embedding.word_embeddings.weight"][:vocab], hf["model.embed_tokens.weight"])
    for i in range(4):
        layer = f"{m}decoder.layers.{i}."
        assert torch.equal(sd[layer + "mlp.linear_fc1.weight_w"], hf[f"model.layers.{i}.mlp.gate_proj.weight"])
        assert torch.equal(sd[layer + "mlp.linear_fc1.weight_v"], hf[f"model.layers.{i}.mlp.up_proj.weight"])
        assert torch.equal(sd[layer + "input_layernorm.weight"], hf[f"model.layers.{i}.input_layernorm.weight"])


@pytest.mark.parametrize("case", CASES)
def test_hf_output_has_the_megatron_logits(case, tmp_path):
    out = tmp_path / "hf"
    reshard_cli("convert", FIXTURES / case / "fsdp_dtensor", out, "--format", "hf")
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert close(hf_logits_of(out, case), want_logits(case)) <= TOL


def hf_logits_of(folder: Path, case: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(input_ids(case)).logits


# the torch_dist output loaded by megatron-core (gen_frameworks.py's reload worker: the same
# model, whose padded vocabulary it reads from the checkpoint) at TP 1 and TP 2
@pytest.mark.parametrize("case,tp", [("llama_fsdp2", 1), ("llama_fsdp2", 2), ("llama_tp2_fsdp2", 1),
                                     ("llama_tp2_fsdp2", 2)])
def test_torch_dist_output_loads_in_megatron_core(case, tp, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "mc"
    reshard_cli("convert", FIXTURES / case / "fsdp_dtensor", out, "--format", "megatron")
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "7"
    res = tmp_path / f"logits_tp{tp}.safetensors"
    argv = ["--worker", "reload", "--case", "llama_tp2", "--dir", str(out / ITER), "--tp", str(tp), "--pp", "1",
            "--ep", "1", "--json", str(res)]
    rc, log = _torchrun.run(GEN, tp, argv, env={"PYTHONWARNINGS": "ignore"}, cwd=tmp_path, timeout=300)
    assert rc == 0, log[-6000:]
    assert close(load_file(str(res))["logits"], want_logits(case)) <= TOL
