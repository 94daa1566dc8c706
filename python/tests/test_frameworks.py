"""Between frameworks, judged by the models themselves: megatron-core ``torch_dist`` and
Megatron-LM's legacy per-rank checkpoints <-> Hugging Face folders.

The fixtures (tests/fixtures/frameworks/<case>/, made by scripts/gen_frameworks.py) are tiny real
megatron-core GPTModels (local Llama-style spec: RMSNorm, SwiGLU, grouped-query attention, RoPE,
fp32, a padded vocabulary; Qwen2-style q/k/v biases; tied embeddings; Mixtral-style experts at EP 2;
Qwen2-MoE-style experts with a gated shared expert at TP 2 x EP 2) saved at TP 2, PP 2 and
TP 2 x PP 2 as Megatron-LM save directories in both formats (``torch_dist/``, ``legacy/``), with
mbridge's Hugging Face export of the same weights (``hf_mbridge/``) and the megatron model's
logits on fixed tokens (``inputs.json``, ``logits.safetensors``).

First the harness checks itself: transformers' logits of mbridge's export equal megatron's;
megatron-core's ``dist_checkpointing.load`` reads each ``torch_dist`` fixture into a GPTModel at
another TP / PP with the same logits; the legacy files and the ``torch_dist`` files hold the same
weights; and the layout a converter must implement (fused per-group QKV rows, ``[gate; up]``,
the vocabulary's padding rows, the local spec's norms under TransformerEngine's names, layers
stacked on a leading axis) maps the ``torch_dist`` tensors to mbridge's, bit for bit.

Then the conversions by ``reshard convert`` and ``reshard.torch.load``: torch_dist ->
hf (logits, bitwise equal to mbridge's tensors, config.json), hf -> megatron (loaded by
megatron-core at TP 2 and at PP 2, same logits), and the round trips (hf -> megatron -> hf, legacy
-> hf, legacy TP 2 -> legacy TP 1 -> hf: byte-exact).

Needs megatron-core, transformers and mbridge in the venv (``scripts/setup_venv.sh --frameworks``;
CI installs them); the megatron workers run under torchrun on gloo (one process per rank).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import _quiet  # noqa: E402,F401  (_quiet: an autouse fixture)

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "frameworks"
GEN = REPO / "scripts" / "gen_frameworks.py"
sys.path.insert(0, str(REPO / "scripts"))
import _torchrun  # noqa: E402  (the generator's way of running its jobs)

BIN = Path(sys.executable).parent / "reshard"
NEEDS = ("megatron.core", "transformers", "mbridge")
MISSING = [m for m in NEEDS if importlib.util.find_spec(m.split(".")[0]) is None]
# under CI (which installs them) a missing producer fails the tests instead of skipping them
pytestmark = pytest.mark.skipif(
    bool(MISSING) and os.environ.get("CI") != "true",
    reason=f"{', '.join(MISSING)} not installed (scripts/setup_venv.sh --frameworks)",
)
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "case.json").is_file())
TOL = 1e-5
ITER = "iter_0000007"


def case_info(case: str) -> dict:
    return json.loads((FIXTURES / case / "case.json").read_text())


def recipe_of(case: str) -> str:
    return case_info(case)["hf_model_type"]


def want_logits(case: str) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(str(FIXTURES / case / "logits.safetensors"))["logits"]


def input_ids(case: str) -> torch.Tensor:
    return torch.tensor(json.loads((FIXTURES / case / "inputs.json").read_text())["input_ids"])


def hf_logits(folder: Path, case: str) -> torch.Tensor:
    """transformers' fp32 logits of the case's tokens from a Hugging Face folder."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(input_ids(case)).logits


def hf_tensors(folder: Path) -> dict:
    """Every tensor of a Hugging Face folder's safetensors files, by name."""
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(folder.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            assert k not in out, f"{k} in two files of {folder}"
            out[k] = v
    return out


def assert_bitwise(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    for k in want:
        a, b = got[k], want[k]
        assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), (what, k, a.dtype, a.shape, b.dtype, b.shape)
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), (what, k)


def close(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got.float() - want).abs().max())


# The configuration fields transformers' Llama / Qwen2 / Mixtral / Qwen2-MoE models read.
HF_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
             "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias",
             "use_sliding_window", "sliding_window", "rope_parameters", "num_local_experts",
             "num_experts_per_tok", "num_experts", "moe_intermediate_size", "shared_expert_intermediate_size",
             "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "qkv_bias")


def hf_config_fields(folder: Path) -> dict:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(folder))
    out = {k: getattr(cfg, k) for k in HF_FIELDS if hasattr(cfg, k)}
    rp = out.get("rope_parameters")
    if isinstance(rp, dict):  # the theta and the type are what the model reads
        out["rope_parameters"] = {k: rp[k] for k in ("rope_theta", "rope_type") if k in rp}
    return out


def reshard_cli(*argv) -> None:
    exe = BIN if BIN.exists() else "reshard"
    r = subprocess.run([str(exe), *map(str, argv)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"reshard {' '.join(map(str, argv))}: {r.stderr.strip()}"


def iter_dir(ckpt: Path) -> Path:
    """The checkpoint folder of a Megatron-LM save directory (the tracked iteration), or ``ckpt``."""
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        return ckpt / f"iter_{int(tracker.read_text().strip()):07d}"
    return ckpt


def megatron_logits(ckpt: Path, case: str, tp: int, pp: int, tmp: Path, ep: int = 1) -> torch.Tensor:
    """megatron-core's logits of the case's tokens after loading the torch_dist checkpoint `ckpt`
    into a GPTModel at (tp, pp, ep) with dist_checkpointing.load (tp x pp x ep gloo processes)."""
    from safetensors.torch import load_file

    out = tmp / f"logits_tp{tp}_pp{pp}_ep{ep}.safetensors"
    argv = ["--worker", "reload", "--case", case, "--dir", str(iter_dir(ckpt)), "--tp", str(tp), "--pp", str(pp),
            "--ep", str(ep), "--json", str(out)]
    rc, log = _torchrun.run(GEN, tp * pp * ep, argv, env={"PYTHONWARNINGS": "ignore"}, cwd=tmp, timeout=300)
    assert rc == 0, log[-6000:]
    return load_file(str(out))["logits"]


# --------------------------------------------------------------------------- the layout, in Python

def torch_dist_tensors(ckpt: Path) -> dict:
    """Every tensor of a torch_dist checkpoint folder, whole (torch.distributed.checkpoint's own
    load, without a process group); the ShardedObjects are left out."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(ckpt)).read_metadata()
    sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
          for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    dcp.load(sd, checkpoint_id=str(ckpt), no_dist=True)
    return sd


def legacy_to_torch_dist_names(case: str) -> dict:
    """The global (torch_dist-named, layer-stacked) tensors of the legacy save, put together from
    its per-rank files the way Megatron-LM splits them: embeddings, output layer, linear_qkv and
    linear_fc1 along dim 0 (linear_fc1 as each rank's [gate_r; up_r]), linear_proj and
    linear_fc2 along dim 1 (the shared expert's too), norms, the router and the shared expert's
    gate replicated; layers numbered from 0 on every PP
    stage; SequentialMLP's experts numbered from 0 on every EP rank, stacked on a second axis."""
    import re

    info = case_info(case)
    tp, pp, ep, m = info["tp"], info["pp"], info["ep"], info["model"]
    layers, experts = m["num_layers"], m["num_experts"] or 0
    per_stage = layers // pp
    root = FIXTURES / case / "legacy" / ITER
    parts: dict = {}
    for p in range(pp):
        for e in range(ep):
            for t in range(tp):
                name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
                sd = torch.load(str(root / name / "model_optim_rng.pt"), weights_only=False)
                assert sd["checkpoint_version"] == 3.0 and sd["iteration"] == 7 and sd["args"].ckpt_format == "torch"
                for k, v in sd["model"].items():
                    if v is None:  # the local linear layers' _extra_state
                        assert k.endswith("._extra_state"), k
                        continue
                    layer = expert = None
                    if k.startswith("decoder.layers."):
                        _, _, i, rest = k.split(".", 3)
                        layer = p * per_stage + int(i)
                        x = re.fullmatch(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)", rest)
                        if rest in ("mlp.experts.weight1", "mlp.experts.weight2"):
                            # GroupedMLP: weight1 is shaped [H, E_local * 2F] but holds
                            # [E_local, H, 2F] (each local expert's fc1 transposed, one after the
                            # other: a reshape, not columns side by side); weight2 [E_local * F, H]
                            # holds [E_local, F, H] (each expert's fc2 transposed)
                            local = experts // ep
                            h, f = m["hidden_size"], m["moe_ffn_hidden_size"] // tp
                            if rest.endswith("1"):
                                per = v.reshape(local, h, 2 * f).transpose(1, 2)
                            else:
                                per = v.reshape(local, f, h).transpose(1, 2)
                            fc = "linear_fc1.weight" if rest.endswith("1") else "linear_fc2.weight"
                            for j in range(local):
                                parts.setdefault(("decoder.layers.mlp.experts.experts." + fc, layer, e * local + j),
                                                 {})[t] = per[j].contiguous()
                            continue
                        if x:
                            expert = e * experts // ep + int(x.group(1))
                            rest = "mlp.experts.experts." + x.group(2)
                        rest = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                                "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}.get(rest, rest)
                        k = "decoder.layers." + rest
                    seen = parts.setdefault((k, layer, expert), {})
                    if t in seen:  # a dense tensor in every EP rank's file: the same
                        assert torch.equal(seen[t], v), (name, k)
                    seen[t] = v
    stacked: dict = {}
    for (k, layer, expert), by_tp in parts.items():
        shards = [by_tp[t] for t in range(tp)]
        if "layer_norm" in k or "layernorm" in k or k.endswith(("router.weight", "shared_experts.gate_weight")):
            assert all(torch.equal(s, shards[0]) for s in shards), k
            g = shards[0]
        elif k.endswith("linear_fc1.weight"):
            halves = [s.chunk(2) for s in shards]
            g = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        elif k.endswith(("linear_proj.weight", "linear_fc2.weight")):
            g = torch.cat(shards, dim=1)
        else:
            g = torch.cat(shards, dim=0)
        if layer is None:
            stacked[k] = g
        elif expert is None:
            stacked.setdefault(k, [None] * layers)[layer] = g
        else:
            stacked.setdefault(k, [[None] * experts for _ in range(layers)])[layer][expert] = g
    return {k: (torch.stack([torch.stack(x) if isinstance(x, list) else x for x in v]) if isinstance(v, list) else v)
            for k, v in stacked.items()}


def hf_from_torch_dist(g: dict, m: dict) -> dict:
    """The Hugging Face tensors of the global megatron tensors: what a converter must write."""
    heads, groups, hd, vocab = m["num_attention_heads"], m["num_query_groups"], m["kv_channels"], m["vocab_size"]
    q_rows = heads // groups * hd
    out = {"model.embed_tokens.weight": g["embedding.word_embeddings.weight"][:vocab],
           "model.norm.weight": g["decoder.final_layernorm.weight"]}
    if not m["tied"]:
        out["lm_head.weight"] = g["output_layer.weight"][:vocab]
    for i in range(m["num_layers"]):
        p = f"model.layers.{i}."
        for suffix in ("weight", "bias"):
            qkv = g.get(f"decoder.layers.self_attention.linear_qkv.{suffix}")
            if qkv is None:
                continue
            qkv = qkv[i].reshape(groups, q_rows + 2 * hd, *qkv.shape[2:])  # per group: its q heads, k, v
            out[p + f"self_attn.q_proj.{suffix}"] = qkv[:, :q_rows].reshape(-1, *qkv.shape[2:])
            out[p + f"self_attn.k_proj.{suffix}"] = qkv[:, q_rows:q_rows + hd].reshape(-1, *qkv.shape[2:])
            out[p + f"self_attn.v_proj.{suffix}"] = qkv[:, q_rows + hd:].reshape(-1, *qkv.shape[2:])
        out[p + "self_attn.o_proj.weight"] = g["decoder.layers.self_attention.linear_proj.weight"][i]
        if m["hf"] == "qwen2_moe":  # per-expert gate/up/down, the router, the gated shared expert
            moe = p + "mlp."
            out[moe + "gate.weight"] = g["decoder.layers.mlp.router.weight"][i]
            for e in range(m["num_experts"]):
                gate, up = g["decoder.layers.mlp.experts.experts.linear_fc1.weight"][i, e].chunk(2)
                out[moe + f"experts.{e}.gate_proj.weight"], out[moe + f"experts.{e}.up_proj.weight"] = gate, up
                out[moe + f"experts.{e}.down_proj.weight"] = g["decoder.layers.mlp.experts.experts.linear_fc2.weight"][i, e]
            gate, up = g["decoder.layers.mlp.shared_experts.linear_fc1.weight"][i].chunk(2)
            out[moe + "shared_expert.gate_proj.weight"], out[moe + "shared_expert.up_proj.weight"] = gate, up
            out[moe + "shared_expert.down_proj.weight"] = g["decoder.layers.mlp.shared_experts.linear_fc2.weight"][i]
            out[moe + "shared_expert_gate.weight"] = g["decoder.layers.mlp.shared_experts.gate_weight"][i]
        elif m["num_experts"]:  # Mixtral: per-expert w1 (gate), w3 (up), w2 (down) and the router
            moe = p + "block_sparse_moe."
            out[moe + "gate.weight"] = g["decoder.layers.mlp.router.weight"][i]
            for e in range(m["num_experts"]):
                gate, up = g["decoder.layers.mlp.experts.experts.linear_fc1.weight"][i, e].chunk(2)
                out[moe + f"experts.{e}.w1.weight"], out[moe + f"experts.{e}.w3.weight"] = gate, up
                out[moe + f"experts.{e}.w2.weight"] = g["decoder.layers.mlp.experts.experts.linear_fc2.weight"][i, e]
        else:
            gate, up = g["decoder.layers.mlp.linear_fc1.weight"][i].chunk(2)
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
            out[p + "mlp.down_proj.weight"] = g["decoder.layers.mlp.linear_fc2.weight"][i]
        out[p + "input_layernorm.weight"] = g["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][i]
        out[p + "post_attention_layernorm.weight"] = g["decoder.layers.mlp.linear_fc1.layer_norm_weight"][i]
    return {k: v.contiguous() for k, v in out.items()}


# --------------------------------------------------------------------------- the harness itself

def test_the_fixtures_are_there():
    assert {"llama_tp2", "llama_pp2", "llama_tp2_pp2", "qwen2_tp2", "llama_tied_tp2", "mixtral_ep2",
            "mixtral_gg_ep2", "qwen2moe_tp2_ep2"} <= set(CASES), CASES


@pytest.mark.parametrize("case", CASES)
def test_mbridge_export_has_the_megatron_logits(case):
    assert close(hf_logits(FIXTURES / case / "hf_mbridge", case), want_logits(case)) <= TOL


@pytest.mark.parametrize("case", CASES)
def test_the_layout_maps_torch_dist_and_legacy_to_mbridge_bitwise(case):
    """The torch_dist tensors, the legacy files put together and mbridge's export are the same
    weights under the documented layout (docs/megatron-format.md)."""
    info = case_info(case)
    m = info["model"]
    g = torch_dist_tensors(iter_dir(FIXTURES / case / "torch_dist"))
    assert g["embedding.word_embeddings.weight"].shape == (m["padded_vocab_size"], m["hidden_size"])
    assert g["decoder.layers.self_attention.linear_qkv.weight"].shape[0] == m["num_layers"]
    assert_bitwise(legacy_to_torch_dist_names(case), g, "legacy vs torch_dist")
    assert_bitwise(hf_from_torch_dist(g, m), hf_tensors(FIXTURES / case / "hf_mbridge"), "layout vs mbridge")


def test_common_pt_holds_megatron_lm_args():
    from megatron.core import dist_checkpointing

    for case in CASES:
        info = case_info(case)
        m = info["model"]
        common = dist_checkpointing.load_common_state_dict(str(iter_dir(FIXTURES / case / "torch_dist")))
        a = common["args"]
        assert common["checkpoint_version"] == 3.0 and common["iteration"] == 7
        assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size) == (info["tp"], info["pp"])
        assert (a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads, a.num_query_groups,
                a.kv_channels, a.padded_vocab_size) == (m["num_layers"], m["hidden_size"], m["ffn_hidden_size"],
                                                        m["num_attention_heads"], m["num_query_groups"],
                                                        m["kv_channels"], m["padded_vocab_size"])
        assert a.group_query_attention and a.swiglu and a.normalization == "RMSNorm" and not a.add_bias_linear
        assert a.position_embedding_type == "rope" and a.ckpt_format == "torch_dist"
        assert a.untie_embeddings_and_output_weights == (not m["tied"]) and a.add_qkv_bias == m["add_qkv_bias"]


# (case, tp, pp, ep): torch_dist fixtures loaded at splits they were not saved at (TP -> PP,
# TP x PP -> 1, q/k/v biases, GroupedMLP's experts into SequentialMLP's at EP 1, TP 2 x EP 2's experts
# and shared expert into one process); the other cases' tensors are tied to these by the layout check
# above, and each load costs a torchrun (~13 s)
RELOADS = [("llama_tp2", 1, 2, 1), ("llama_tp2_pp2", 1, 1, 1), ("qwen2_tp2", 1, 1, 1), ("mixtral_gg_ep2", 1, 1, 1),
           ("qwen2moe_tp2_ep2", 1, 1, 1)]


@pytest.mark.parametrize("case,tp,pp,ep", RELOADS)
def test_torch_dist_loads_at_another_split(case, tp, pp, ep, tmp_path):
    got = megatron_logits(FIXTURES / case / "torch_dist", case, tp, pp, tmp_path, ep=ep)
    assert close(got, want_logits(case)) <= TOL


# --------------------------------------------------------------------------- the conversions

@pytest.mark.parametrize("case", CASES)
def test_torch_dist_to_hf(case, tmp_path):
    out = tmp_path / "hf"
    reshard_cli("convert", FIXTURES / case / "torch_dist", out, "--format", "hf")
    assert close(hf_logits(out, case), want_logits(case)) <= TOL
    assert_bitwise(hf_tensors(out), hf_tensors(FIXTURES / case / "hf_mbridge"), "reshard vs mbridge")
    assert hf_config_fields(out) == hf_config_fields(FIXTURES / case / "hf_mbridge")


# HF -> megatron: the cases whose Hugging Face model differs in kind (plain, q/k/v biases, tied, MoE,
# MoE with a shared expert)
HF_SOURCES = ["llama_tp2", "qwen2_tp2", "llama_tied_tp2", "mixtral_ep2", "qwen2moe_tp2_ep2"]


# the (TP, PP, EP) splits megatron-core loads reshard's output at: TP 2 and PP 2 apart for the
# plain model, together (4 processes, one torchrun) for the others (tied embeddings then span
# stages), and the MoE models' experts over 2 expert ranks too (Qwen2-MoE's with PP 2, and its
# experts and shared expert split over TP 2 apart)
HF_SPLITS = {"llama_tp2": [(2, 1, 1), (1, 2, 1)], "mixtral_ep2": [(2, 2, 1), (1, 1, 2)],
             "qwen2moe_tp2_ep2": [(1, 2, 2), (2, 1, 1)]}


@pytest.mark.parametrize("case", HF_SOURCES)
def test_hf_to_torch_dist_loads_at_tp2_and_pp2(case, tmp_path):
    out = tmp_path / "mc"
    reshard_cli("convert", FIXTURES / case / "hf_mbridge", out, "--format", "megatron", "--recipe", recipe_of(case))
    for tp, pp, ep in HF_SPLITS.get(case, [(2, 2, 1)]):
        got = megatron_logits(out, case, tp, pp, tmp_path, ep=ep)
        assert close(got, want_logits(case)) <= TOL, (tp, pp, ep)


@pytest.mark.parametrize("case", HF_SOURCES)
def test_hf_to_megatron_to_hf_is_byte_exact(case, tmp_path):
    src = FIXTURES / case / "hf_mbridge"
    reshard_cli("convert", src, tmp_path / "mc", "--format", "megatron", "--recipe", recipe_of(case))
    reshard_cli("convert", tmp_path / "mc", tmp_path / "hf", "--format", "hf", "--recipe", recipe_of(case))
    assert_bitwise(hf_tensors(tmp_path / "hf"), hf_tensors(src), "round trip")
    assert hf_config_fields(tmp_path / "hf") == hf_config_fields(src)


@pytest.mark.parametrize("case", CASES)
def test_legacy_to_hf(case, tmp_path):
    out = tmp_path / "hf"
    reshard_cli("convert", FIXTURES / case / "legacy", out, "--format", "hf")
    assert_bitwise(hf_tensors(out), hf_tensors(FIXTURES / case / "hf_mbridge"), "legacy -> hf vs mbridge")
    assert close(hf_logits(out, case), want_logits(case)) <= TOL


# legacy at TP 2 -> legacy at TP 1 -> hf; the output's format name and TP option as the CLI spells them
LEGACY_TP1 = ["--format", "megatron-legacy", "--tp", "1"]


@pytest.mark.parametrize("case", ["llama_tp2", "qwen2_tp2", "qwen2moe_tp2_ep2"])
def test_legacy_tp2_to_legacy_tp1_to_hf(case, tmp_path):
    reshard_cli("convert", FIXTURES / case / "legacy", tmp_path / "l1", *LEGACY_TP1)
    files = sorted(p.relative_to(tmp_path / "l1").as_posix() for p in (tmp_path / "l1").rglob("*.pt"))
    ep = case_info(case)["ep"]  # (the expert ranks' files stay: --tp changes TP only)
    want = [f"{ITER}/mp_rank_00" + (f"_{e:03d}" if ep > 1 else "") + "/model_optim_rng.pt" for e in range(ep)]
    assert files == want, files
    reshard_cli("convert", tmp_path / "l1", tmp_path / "hf", "--format", "hf")
    assert_bitwise(hf_tensors(tmp_path / "hf"), hf_tensors(FIXTURES / case / "hf_mbridge"), "legacy tp1 -> hf")


# legacy -> torch_dist: a Megatron-LM save directory again (the same iteration), its layers and
# experts stacked under megatron-core's keys, which megatron-core loads (the Rust tests compare
# the bytes with megatron-core's own torch_dist save of each case)
@pytest.mark.parametrize("case,tp,pp,ep", [("llama_tp2_pp2", 2, 1, 1), ("mixtral_gg_ep2", 1, 1, 2)])
def test_legacy_to_torch_dist_loads_in_megatron_core(case, tp, pp, ep, tmp_path):
    out = tmp_path / "mc"
    reshard_cli("convert", FIXTURES / case / "legacy", out, "--format", "megatron")
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "7"
    assert (out / ITER / "metadata.json").is_file()
    assert close(megatron_logits(out, case, tp, pp, tmp_path, ep=ep), want_logits(case)) <= TOL


def megatron_lm() -> Path:
    """Megatron-LM's training sources (tag core_v0.16.1), as scripts/gen_frameworks.py finds them."""
    return Path(os.environ.get("RESHARD_MEGATRON_LM", Path.home() / ".cache/reshard/megatron-lm-core_v0.16.1"))


# Megatron-LM's own load_checkpoint (--load DIR: the tracker file, then the iteration folder in
# either format) on reshard's save directories. Its training code is not on PyPI (megatron-core
# is megatron.core only), so this runs where the sources are (RESHARD_MEGATRON_LM), CI included
# when it has them; dist_checkpointing.load judges the same outputs above without them.
@pytest.mark.skipif(not (megatron_lm() / "megatron" / "training" / "checkpointing.py").is_file(),
                    reason="Megatron-LM's training sources (not on PyPI) are not here: set RESHARD_MEGATRON_LM")
@pytest.mark.parametrize("case,src,args,split", [
    ("llama_tp2", "hf_mbridge", ["--format", "megatron", "--save-dir", "--param", "tp=2"], (2, 1, 1)),
    ("mixtral_ep2", "legacy", ["--format", "megatron"], (1, 1, 2)),
    ("llama_tp2_pp2", "legacy", ["--format", "megatron-legacy", "--tp", "2", "--pp", "1"], (2, 1, 1)),
])
def test_megatron_lm_loads_the_save_directories(case, src, args, split, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "save"
    reshard_cli("convert", FIXTURES / case / src, out, *args)
    tp, pp, ep = split
    res = tmp_path / "mlm.safetensors"
    argv = ["--worker", "mlm_load", "--case", case, "--dir", str(out), "--tp", str(tp), "--pp", str(pp),
            "--ep", str(ep), "--json", str(res), "--megatron-lm", str(megatron_lm())]
    rc, log = _torchrun.run(GEN, tp * pp * ep, argv, cwd=tmp_path, timeout=300,
                            env={"PYTHONWARNINGS": "ignore", "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert rc == 0, log[-6000:]
    got = load_file(str(res))
    assert int(got["iteration"][0]) == (0 if src == "hf_mbridge" else 7)
    assert close(got["logits"], want_logits(case)) <= TOL


# --------------------------------------------------------------------------- loading across frameworks

# (transformers 5 keeps Mixtral's and Qwen2-MoE's experts fused in memory, gate_up_proj [E, 2F, H],
# under other names than their files' per-expert tensors: the recipes' in-memory names)
@pytest.mark.parametrize("case,form", [("llama_tp2", "torch_dist"), ("qwen2_tp2", "legacy"), ("llama_tp2_pp2", "torch_dist"),
                                       ("mixtral_ep2", "torch_dist"), ("mixtral_gg_ep2", "legacy"),
                                       ("qwen2moe_tp2_ep2", "torch_dist")])
def test_torch_load_fills_a_hugging_face_model_from_a_megatron_checkpoint(case, form):
    """``reshard.torch.load(hf_model.state_dict(), megatron_ckpt, recipe=...)``: no file
    written, every tensor equal to what transformers' from_pretrained makes of mbridge's
    export, the same logits."""
    import reshard.torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(FIXTURES / case / "hf_mbridge"))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    sd = model.state_dict()
    res = reshard.torch.load(sd, FIXTURES / case / form, recipe="auto")
    assert (res.missing_keys, res.unexpected_keys) == ([], [])
    model.load_state_dict(sd)
    ref = AutoModelForCausalLM.from_pretrained(str(FIXTURES / case / "hf_mbridge"), dtype=torch.float32)
    assert_bitwise(model.state_dict(), ref.state_dict(), "reshard.torch.load vs from_pretrained(mbridge)")
    with torch.no_grad():
        logits = model(input_ids(case)).logits
    assert close(logits, want_logits(case)) <= TOL


# the reverse: megatron-core's own model (its sharded_state_dict(): each parameter's block of the
# global tensor, SwiGLU's [gate_r; up_r] as two) filled from a Hugging Face folder through the
# recipe, or from a torch_dist checkpoint saved at another split, in tp x pp x ep processes
@pytest.mark.parametrize("case,src,recipe,split", [
    ("llama_tp2", "hf_mbridge", "llama", (2, 1, 1)),
    ("mixtral_ep2", "hf_mbridge", "mixtral", (1, 1, 2)),
    ("llama_tp2_pp2", "torch_dist", None, (2, 1, 1)),
])
def test_torch_load_fills_a_megatron_core_model(case, src, recipe, split, tmp_path):
    from safetensors.torch import load_file

    tp, pp, ep = split
    res = tmp_path / "logits.safetensors"
    argv = ["--worker", "reshard_load", "--case", case, "--dir", str(FIXTURES / case / src), "--tp", str(tp),
            "--pp", str(pp), "--ep", str(ep), "--json", str(res)] + (["--recipe", recipe] if recipe else [])
    rc, log = _torchrun.run(GEN, tp * pp * ep, argv, env={"PYTHONWARNINGS": "ignore"}, cwd=tmp_path, timeout=300)
    assert rc == 0, log[-6000:]
    assert close(load_file(str(res))["logits"], want_logits(case)) <= TOL


def test_torch_load_through_a_recipe_says_what_is_missing():
    import reshard
    import reshard.torch

    sd = {"model.norm.weight": torch.zeros(16), "model.extra.weight": torch.zeros(3)}
    with pytest.raises(reshard.RequestError, match=r"1 key\(s\) of the state dict are not among the recipe's tensors: `model.extra.weight`"):
        reshard.torch.load(sd, FIXTURES / "llama_tp2" / "torch_dist", recipe="llama")
    res = reshard.torch.load(sd, FIXTURES / "llama_tp2" / "torch_dist", recipe="llama", strict=False)
    assert res.missing_keys == ["model.extra.weight"]
    want = hf_tensors(FIXTURES / "llama_tp2" / "hf_mbridge")["model.norm.weight"]
    assert torch.equal(sd["model.norm.weight"], want)
