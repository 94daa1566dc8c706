"""Megatron-LM's own layouts from Python (``tests/fixtures/megatron_legacy``, written by
``scripts/gen_megatron_legacy.py``): a save directory opens the iteration its
``latest_checkpointed_iteration.txt`` names, ``step=N`` chooses ``iter_{N:07}``, and a legacy
per-rank checkpoint reads as the global tensors the generator cut it from, byte for byte."""

import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import reshard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _util import _quiet  # noqa: E402,F401  (_quiet: an autouse fixture)

FIX = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "megatron_legacy"


def _equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), k


@pytest.mark.parametrize("case", ["tp2", "tp2_pp2"])
def test_a_save_directory_reads_the_tracked_iteration_as_global_tensors(case, tmp_path):
    want = load_file(str(FIX / "llama.safetensors"))
    save = tmp_path / "save"
    shutil.copytree(FIX / case / "checkpoint", save)
    ck = reshard.open(save)
    _equal({t.name: ck.get_tensor(t.name) for t in ck.tensors()}, want)
    assert ck.format == "megatron-legacy" and ck.world_size == (2 if case == "tp2" else 4)
    # step=7 is iter_0000007; a missing iteration is named
    ck7 = reshard.open(save, step=7)
    assert sorted(t.name for t in ck7.tensors()) == sorted(want)
    with pytest.raises(reshard.ReshardError, match="has no iteration 8"):
        reshard.open(save, step=8)
    with pytest.raises(reshard.RequestError, match="give tag or step"):
        reshard.open(save, step=7, tag="iter_0000007")
    out = tmp_path / "m.safetensors"
    reshard.convert(save, out, world_size=1, format="safetensors", step=7, recipe="none")
    _equal(load_file(str(out)), want)


@pytest.mark.parametrize("tp,pp,files", [(1, 1, ["mp_rank_00"]), (2, 4, [f"mp_rank_0{t}_00{p}" for p in range(4) for t in range(2)])])
def test_convert_writes_a_legacy_checkpoint_at_another_split(tp, pp, files, tmp_path):
    """``reshard.convert(..., format="megatron-legacy", tp=, pp=)``: Megatron-LM's rank files at
    that split, whose arguments say it, read back as the source's global tensors."""
    want = load_file(str(FIX / "llama.safetensors"))
    out = tmp_path / "legacy"
    reshard.convert(FIX / "tp2" / "checkpoint", out, world_size=1, format="megatron-legacy", tp=tp, pp=pp)
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "7"
    assert sorted(p.name for p in (out / "iter_0000007").iterdir()) == sorted(files)
    saved = torch.load(str(out / "iter_0000007" / files[0] / "model_optim_rng.pt"), weights_only=False)
    a = saved["args"]
    assert (a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.ckpt_format) == (tp, pp, "torch")
    assert saved["checkpoint_version"] == 3.0 and saved["iteration"] == 7
    ck = reshard.open(out)
    _equal({t.name: ck.get_tensor(t.name) for t in ck.tensors()}, want)
    with pytest.raises(reshard.ReshardError, match="--tp 3 does not divide args.padded_vocab_size 16"):
        reshard.convert(FIX / "tp2" / "checkpoint", tmp_path / "bad", world_size=1, format="megatron-legacy", tp=3)
    assert not (tmp_path / "bad").exists()
