#!/usr/bin/env bash
# Create (if missing) the Python environments used to generate fixtures and to let real
# torch judge reshard's outputs (scripts/gen_fixtures.py, scripts/torch_interop.py).
#
#   scripts/setup_venv.sh                 main venv: newest torch + safetensors + numpy + pytest
#   scripts/setup_venv.sh --lightning     ... plus Lightning (fixture cases fabric_*; the
#                                          Python package's tests, which CI runs)
#   scripts/setup_venv.sh --bench         ... plus Lightning, accelerate and matplotlib
#                                          (scripts/compare.py)
#   scripts/setup_venv.sh --torch21       ... plus a second venv with torch==2.1.0
#                                          (fixture case fabric_fsdp1_w4_f32_torch21)
#   scripts/setup_venv.sh --deepspeed     ... plus DeepSpeed and ninja (scripts/gen_deepspeed.py,
#                                          the DeepSpeed interop tests, which CI runs)
#   scripts/setup_venv.sh --transformers  ... plus Hugging Face transformers (the from_pretrained
#                                          tests, which CI runs)
#   scripts/setup_venv.sh --torchtitan    ... plus torchtitan 0.3.0 (--no-deps) and the few of its
#                                          dependencies its checkpoint, optimizer and dataloader
#                                          components import: tyro, torchdata, spmd-types
#                                          (scripts/gen_torchtitan.py, python/tests/test_torchtitan.py)
#   scripts/setup_venv.sh --megatron      ... plus megatron-core 0.16.1 and psutil (the load-back
#                                          tests of megatron outputs, which CI runs; the fixture
#                                          generator scripts/gen_megatron.py has venvs of its own)
#   scripts/setup_venv.sh --frameworks    ... plus megatron-core and transformers (as above) and mbridge
#                                          0.15.1 (--no-deps: its own requirements would move torch,
#                                          transformers or megatron-core) with einops, the one of its
#                                          dependencies its import needs (python/tests/test_frameworks.py,
#                                          which CI runs; scripts/gen_frameworks.py)
#   scripts/setup_venv.sh --verl          ... plus transformers and verl 0.9.1 (--no-deps: its own
#                                          requirements would move torch and transformers) with the
#                                          dependencies its checkpoint manager and model merger import:
#                                          ray, tensordict, omegaconf, accelerate, codetiming, peft
#                                          (--no-deps), datasets, pillow, orjson (scripts/gen_verl.py,
#                                          python/tests/test_verl.py, which CI runs)
#   scripts/setup_venv.sh --torch-checkpointing ... plus Meta's torch-checkpointing 0.1.1 (--no-deps:
#                                          it needs torch >= 2.11, already here; scripts/gen_torch_checkpointing.py)
#   scripts/setup_venv.sh --s3            ... plus moto's S3 server and boto3 (the object-storage
#                                          tests start a server on 127.0.0.1: test_remote.py)
#                                          scripts/bench_remote.py --server s3s also wants s3s-fs, a
#                                          compiled S3 server, not installed here (a several-minute
#                                          Rust build): cargo install s3s-fs --version 0.14.1
#                                          --features binary --locked
#
# Locations: ${RESHARD_VENV:-$HOME/.cache/reshard/venv} and
#            ${RESHARD_VENV21:-$HOME/.cache/reshard/venv-torch21}.
# <repo>/.venv is made a symlink to the main venv.
# Idempotent: an existing venv whose packages import is left alone.
# The torch wheels are several GB (CUDA libraries), so keep the venvs and reuse them.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RESHARD_VENV:-$HOME/.cache/reshard/venv}"
VENV21="${RESHARD_VENV21:-$HOME/.cache/reshard/venv-torch21}"
PYTHON="${RESHARD_PYTHON:-python3}"
LIGHTNING_SPEC="${RESHARD_LIGHTNING_SPEC:-lightning==2.6.6}"

want_torch21=0
want_lightning=0
want_bench=0
want_deepspeed=0
want_transformers=0
want_megatron=0
want_torchtitan=0
want_s3=0
want_frameworks=0
want_verl=0
want_torch_checkpointing=0
for arg in "$@"; do
  case "$arg" in
    --torch21) want_torch21=1 ;;
    --lightning) want_lightning=1 ;;
    --bench) want_lightning=1; want_bench=1 ;;
    --deepspeed) want_deepspeed=1 ;;
    --transformers) want_transformers=1 ;;
    --torchtitan) want_torchtitan=1 ;;
    --megatron) want_megatron=1 ;;
    --frameworks) want_frameworks=1; want_megatron=1; want_transformers=1 ;;
    --verl) want_verl=1; want_transformers=1 ;;
    --torch-checkpointing) want_torch_checkpointing=1 ;;
    --s3) want_s3=1 ;;
    -h|--help) sed -n '2,43p' "$0"; exit 0 ;;
    *) echo "setup_venv.sh: unknown argument: $arg" >&2; exit 2 ;;
  esac
done

say() { echo "setup_venv: $*"; }

# ensure_venv DIR IMPORT_CHECK PIP_SPEC...
ensure_venv() {
  local dir="$1" check="$2"; shift 2
  if [ ! -x "$dir/bin/python" ]; then
    say "creating venv $dir with $("$PYTHON" --version 2>&1)"
    mkdir -p "$(dirname "$dir")"
    "$PYTHON" -m venv "$dir"
  else
    say "venv exists: $dir"
  fi
  if "$dir/bin/python" -c "$check" >/dev/null 2>&1; then
    say "  packages already present: $("$dir/bin/python" -c "$check" 2>/dev/null)"
  else
    say "  installing: $*"
    "$dir/bin/python" -m pip install --disable-pip-version-check -q "$@"
    say "  installed: $("$dir/bin/python" -c "$check")"
  fi
}

CHECK='import torch, safetensors, numpy, pytest; print("torch", torch.__version__, "safetensors", safetensors.__version__, "numpy", numpy.__version__, "pytest", pytest.__version__)'
CHECK_L='import torch, safetensors, numpy, lightning; print("torch", torch.__version__, "safetensors", safetensors.__version__, "numpy", numpy.__version__, "lightning", lightning.__version__)'

ensure_venv "$VENV" "$CHECK" torch safetensors numpy pytest
if [ "$want_lightning" = 1 ]; then
  ensure_venv "$VENV" "$CHECK_L" "$LIGHTNING_SPEC"
fi
if [ "$want_bench" = 1 ]; then
  ensure_venv "$VENV" 'import accelerate, matplotlib; print("accelerate", accelerate.__version__, "matplotlib", matplotlib.__version__)' accelerate matplotlib
fi
if [ "$want_deepspeed" = 1 ]; then
  # DeepSpeed builds from source (~40 s); ninja JIT-compiles its CPU shm op on first use.
  ensure_venv "$VENV" 'import deepspeed, ninja; print("deepspeed", deepspeed.__version__)' "${RESHARD_DEEPSPEED_SPEC:-deepspeed==0.19.8}" ninja
fi
if [ "$want_transformers" = 1 ]; then
  ensure_venv "$VENV" 'import transformers; print("transformers", transformers.__version__)' "${RESHARD_TRANSFORMERS_SPEC:-transformers==5.25.0}"
fi
if [ "$want_megatron" = 1 ]; then
  # megatron-core's async checkpoint writer needs psutil
  ensure_venv "$VENV" 'import megatron.core, psutil; print("megatron-core", megatron.core.__version__)' "${RESHARD_MEGATRON_SPEC:-megatron-core==0.16.1}" psutil
fi
if [ "$want_frameworks" = 1 ]; then
  # mbridge exports a megatron-core model to a Hugging Face folder: the reference the
  # Megatron <-> Hugging Face conversions are judged against
  ensure_venv "$VENV" 'import mbridge, einops; print("mbridge", mbridge.__version__)' \
    --no-deps "${RESHARD_MBRIDGE_SPEC:-mbridge==0.15.1}" "${RESHARD_EINOPS_SPEC:-einops==0.8.2}"
fi
if [ "$want_torchtitan" = 1 ]; then
  # torchtitan's own requirements pull datasets, wandb, tensorboard, ...: none of them is
  # imported by the components reshard's tests drive, so it goes in without dependencies,
  # with only what those imports need (tyro with its dependencies; torchdata's
  # StatefulDataLoader and spmd-types, pinned as torchtitan 0.3.0 pins it, without theirs).
  ensure_venv "$VENV" 'import tyro; print("tyro", tyro.__version__)' "${RESHARD_TYRO_SPEC:-tyro==1.0.17}"
  ensure_venv "$VENV" 'import torchtitan.components.checkpoint, torchtitan.components.optimizer, torchtitan.components.dataloader; print("torchtitan ok")' \
    --no-deps "${RESHARD_TORCHTITAN_SPEC:-torchtitan==0.3.0}" torchdata==0.11.0 spmd-types==0.2.3
fi
if [ "$want_torch_checkpointing" = 1 ]; then
  # no dependencies beyond torch (>= 2.11); --no-deps so torch is not moved
  ensure_venv "$VENV" 'from torch_checkpointing import CheckpointManager; print("torch_checkpointing ok")' \
    --no-deps "${RESHARD_TORCH_CHECKPOINTING_SPEC:-torch-checkpointing==0.1.1}"
fi
if [ "$want_verl" = 1 ]; then
  # verl pins transformers < 5.11 and tensordict <= 0.10: it goes in without dependencies, with
  # only what `verl.utils.checkpoint.fsdp_checkpoint_manager` and `verl.model_merger` import
  ensure_venv "$VENV" 'import ray, tensordict, omegaconf, accelerate, codetiming, datasets, PIL, orjson; print("verl deps ok")' \
    "${RESHARD_RAY_SPEC:-ray==2.60.0}" tensordict==0.15.3 omegaconf==2.4.0 accelerate==1.16.0 codetiming==1.4.0 \
    datasets==5.2.0 pillow==13.0.0 orjson==3.13.0
  ensure_venv "$VENV" 'from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager; import verl.model_merger.fsdp_model_merger; print("verl ok")' \
    --no-deps "${RESHARD_VERL_SPEC:-verl==0.9.1}" peft==0.22.0
fi
if [ "$want_s3" = 1 ]; then
  ensure_venv "$VENV" 'import moto, boto3, flask; print("moto", moto.__version__, "boto3", boto3.__version__)' "${RESHARD_MOTO_SPEC:-moto[server]==5.2.6}" "${RESHARD_BOTO3_SPEC:-boto3==1.44.18}"
fi

# <repo>/.venv -> main venv
link="$REPO_ROOT/.venv"
if [ -L "$link" ]; then
  if [ "$(readlink "$link")" = "$VENV" ]; then
    say "symlink ok: $link -> $VENV"
  else
    ln -sfn "$VENV" "$link"
    say "symlink updated: $link -> $VENV"
  fi
elif [ -e "$link" ]; then
  say "WARNING: $link exists and is not a symlink; left alone"
else
  ln -s "$VENV" "$link"
  say "symlink created: $link -> $VENV"
fi

if [ "$want_torch21" = 1 ]; then
  # torch 2.1.0 has wheels for Python <= 3.11 and needs numpy < 2.
  ensure_venv "$VENV21" "$CHECK" "torch==2.1.0" "numpy<2" safetensors
  if [ "$want_lightning" = 1 ]; then
    ensure_venv "$VENV21" "$CHECK_L" "$LIGHTNING_SPEC" "torch==2.1.0" "numpy<2"
  fi
fi
say "done"
