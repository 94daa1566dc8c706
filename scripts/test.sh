#!/usr/bin/env bash
# The project's one test command (README "Tests"; .ci/run calls it): sets up what the tests
# need when it is missing, then runs every suite.
#
#   1. setup (idempotent, seconds once done): the Python venv with real torch, Lightning,
#      DeepSpeed, transformers, megatron-core, mbridge, torchtitan, moto's S3 server and pytest
#      (scripts/setup_venv.sh, cached in ~/.cache/reshard/venv and linked as .venv: several
#      GB and about 15 minutes the first time), and Debian's slurm-wlm for the one-node Slurm
#      test (scripts/slurm_local.sh install, as root; elsewhere that test says why it skips);
#   2. Rust: every crate's tests (unit, the integration binary tests/it, the resource bounds,
#      doctests), then clippy and rustdoc under -D warnings;
#   3. Python: the release wheel built and installed into the venv, and its pytest suite
#      (real torch, Lightning and gloo processes; the README's own blocks run as written).
#
#   scripts/test.sh              everything
#   scripts/test.sh --rust       Rust only      scripts/test.sh --python   Python only
#   scripts/test.sh --no-setup   use the venv as it is (RESHARD_VENV or .venv)
#   extra arguments after -- go to pytest (e.g. scripts/test.sh --python -- -k slice)
#
# Under CI=true a Python test that needs torch fails instead of skipping when torch is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

rust=1 python=1 setup=1
pytest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --rust) python=0 ;;
    --python) rust=0 ;;
    --no-setup) setup=0 ;;
    --) shift; pytest_args=("$@"); break ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "test.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

if [ "$setup" = 1 ] && [ "$python" = 1 ]; then
  echo "== setup: the venv (scripts/setup_venv.sh) and Slurm (scripts/slurm_local.sh install)"
  start=$(date +%s)
  bash scripts/setup_venv.sh --lightning --deepspeed --transformers --megatron --frameworks --torchtitan --s3 --verl --torch-checkpointing
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    bash scripts/slurm_local.sh install
  else
    echo "   no root or apt-get: Slurm not installed (its test will say it skips)"
  fi
  echo "   ready in $(( $(date +%s) - start )) s"
fi

if [ "$rust" = 1 ]; then
  # Every crate of the workspace (the floors' unit tests, the integration binary tests/it,
  # the resource bounds, the doctests), then the lints and the docs under -D warnings.
  echo "== Rust: cargo test --workspace"
  cargo test --workspace
  echo "== Rust: cargo clippy --workspace --all-targets -- -D warnings"
  cargo clippy --workspace --all-targets -- -D warnings
  echo "== Rust: cargo doc --workspace --no-deps (RUSTDOCFLAGS=-D warnings)"
  RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps
fi

if [ "$python" = 1 ]; then
  venv="${RESHARD_VENV:-.venv}"
  py="$venv/bin/python"
  if [ ! -x "$py" ] || ! "$py" -c 'import torch, pytest' >/dev/null 2>&1; then
    msg="no venv with torch and pytest at $venv (scripts/test.sh without --no-setup makes it)"
    if [ "${CI:-}" = true ]; then echo "test.sh: error: $msg" >&2; exit 1; fi
    echo "== Python: SKIPPED: $msg"
    exit 0
  fi
  # The venv's real path, not the .venv link: pip writes the interpreter's path into the
  # `reshard` command's shebang, and the venv is shared by every clone that links it.
  py="$(cd "$venv" && pwd -P)/bin/python"
  start=$(date +%s)
  # One wheel, built once: the release wheel itself (scripts/build_wheel.sh: abi3, manylinux2014
  # by maturin --zig, which installs maturin and ziglang into the venv the first time),
  # installed here, checked and installed into a venv with no Rust toolchain by
  # python/tests/test_wheel.py, and into venvs of the other CPython versions found on the
  # machine by python/tests/test_abi3.py (RESHARD_WHEEL). Elsewhere than Linux: pip wheel.
  rm -rf target/wheels/test && mkdir -p target/wheels/test
  if [ "$(uname -s)" = Linux ]; then
    echo "== Python: the release wheel (scripts/build_wheel.sh), installed with pip"
    RESHARD_VENV="$venv" bash scripts/build_wheel.sh --quiet --out target/wheels/test >/dev/null
  else
    echo "== Python: pip wheel ./python (maturin builds the native module in release mode)"
    "$py" -m pip wheel --disable-pip-version-check -q --no-deps -w target/wheels/test ./python
  fi
  wheel="$(ls target/wheels/test/reshard-*.whl)"
  "$py" -m pip install --disable-pip-version-check -q --no-deps --force-reinstall "$wheel"
  export RESHARD_WHEEL="$PWD/$wheel"
  echo "   built and installed in $(( $(date +%s) - start )) s"
  echo "== Python: pytest python/tests"
  # From the repository's root, so that `import reshard` is the installed package, not the
  # source folder python/reshard (which has no native module in a clean clone).
  "$py" -m pytest python/tests -q -p no:cacheprovider "${pytest_args[@]}"
fi
