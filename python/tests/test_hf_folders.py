"""Hugging Face model folders with transformers itself as the judge: a tiny random Llama saved
with ``save_pretrained`` (sharded, and in one file), resharded by reshard both ways — into
other shard sizes and through DCP at 2 ranks and back — loads with
``AutoModelForCausalLM.from_pretrained`` to the source's weights, byte for byte, because the
``hf`` output carries ``config.json`` (the source's, or one given)."""

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

import reshard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import _quiet, same  # noqa: E402,F401  (_quiet: an autouse fixture)

HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
pytestmark = pytest.mark.skipif(
    not HAVE_TRANSFORMERS and os.environ.get("CI") != "true",
    reason="transformers is not installed (scripts/setup_venv.sh --transformers)",
)


def tiny_llama(path: Path, shard: str = "50KB"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path, max_shard_size=shard)
    return model


def assert_loads_as(path: Path, model) -> None:
    from transformers import AutoModelForCausalLM

    got = AutoModelForCausalLM.from_pretrained(path)
    want = model.state_dict()
    have = got.state_dict()
    assert sorted(have) == sorted(want)
    for k, v in want.items():
        assert same(have[k], v), k


def test_a_sharded_folder_resharded_both_ways_loads_with_from_pretrained(tmp_path):
    src = tmp_path / "src"
    model = tiny_llama(src)
    assert (src / "model.safetensors.index.json").is_file() and (src / "config.json").is_file()
    ck = reshard.open(src)
    assert ck.format == "hf"
    # into one shard, and into smaller ones: config.json and generation_config.json come along
    one = tmp_path / "one"
    reshard.convert(src, one, world_size=1, format="hf")
    assert (one / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert (one / "generation_config.json").is_file()
    assert len(set(json.loads((one / "model.safetensors.index.json").read_text())["weight_map"].values())) == 1
    assert_loads_as(one, model)
    many = tmp_path / "many"
    reshard.convert(one, many, world_size=1, format="hf", max_shard_size=20_000)
    assert len(set(json.loads((many / "model.safetensors.index.json").read_text())["weight_map"].values())) > 3
    assert_loads_as(many, model)


def test_through_dcp_and_back_with_a_config_given(tmp_path):
    src = tmp_path / "src"
    model = tiny_llama(src, shard="5GB")  # one file: model.safetensors, no index
    assert (src / "model.safetensors").is_file() and not (src / "model.safetensors.index.json").exists()
    dcp = tmp_path / "dcp"
    reshard.convert(src, dcp, world_size=2, format="dcp")
    assert reshard.open(dcp).world_size == 2
    out = tmp_path / "out"
    # a DCP checkpoint has no config: give the model's
    reshard.convert(dcp, out, world_size=1, format="hf", config=src / "config.json")
    assert_loads_as(out, model)
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(reshard.CheckpointError, match="does not hold a JSON object"):
        reshard.convert(dcp, tmp_path / "out2", world_size=1, format="hf", config=bad)
    assert not (tmp_path / "out2").exists()
