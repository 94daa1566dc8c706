#!/usr/bin/env bash
# Build the Python package's release wheel as it is published: one abi3 wheel (CPython >= 3.10)
# for manylinux2014 (manylinux_2_17: glibc >= 2.17), built by maturin with zig as the C
# compiler and linker, so the native module needs no glibc symbol newer than 2.17 whatever
# the glibc of the building machine. pip installs it with no Rust toolchain.
#
#   scripts/build_wheel.sh                     x86_64 wheel into target/wheels/
#   scripts/build_wheel.sh --sdist             ... and the source distribution
#   scripts/build_wheel.sh --out DIR           into DIR (emptied of reshard-* files first)
#   scripts/build_wheel.sh --target TRIPLE     another target (aarch64-unknown-linux-gnu;
#                                              needs `rustup target add` of it)
#   scripts/build_wheel.sh --quiet             without cargo's log (errors still shown)
#
# maturin (>= 1.15: older ones pass zig a linker flag Rust >= 1.98 sets for aarch64 that zig
# refuses) and ziglang (zig from PyPI) are installed into the venv ($RESHARD_VENV or .venv,
# else a venv at ~/.cache/reshard/wheel-tools) when missing. The last line printed is the
# wheel's path. Cargo's target folder is $CARGO_TARGET_DIR or target/ (the zig build goes to
# its own <target>/<triple>/release folder, next to cargo's host builds).
set -euo pipefail
cd "$(dirname "$0")/.."

out=target/wheels sdist=0 triple="" quiet=0
while [ $# -gt 0 ]; do
  case "$1" in
    --sdist) sdist=1 ;;
    -q|--quiet) quiet=1 ;;
    --out) out="$2"; shift ;;
    --target) triple="$2"; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "build_wheel.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

venv="${RESHARD_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
  venv="$HOME/.cache/reshard/wheel-tools"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
fi
py="$venv/bin/python"
have_tools() {
  "$py" -m ziglang version >/dev/null 2>&1 && "$py" -c 'import importlib.metadata as m
assert tuple(int(x) for x in m.version("maturin").split(".")[:2]) >= (1, 15)' 2>/dev/null
}
if ! have_tools; then
  echo "build_wheel.sh: installing maturin and ziglang into $venv" >&2
  "$py" -m pip install --disable-pip-version-check -q "maturin>=1.15,<2" "ziglang>=0.13" >&2
fi
# maturin finds zig as `python -m ziglang` of the python on PATH: the venv's.
export PATH="$(cd "$venv/bin" && pwd -P):$PATH"

mkdir -p "$out"
rm -f "$out"/reshard-*.whl "$out"/reshard-*.tar.gz
# --strip: the release profile keeps line tables (debug = 1), 100 MB of the native module.
args=(build --release --strip --zig --compatibility manylinux2014 -m python/Cargo.toml -o "$out")
[ -n "$triple" ] && args+=(--target "$triple")
[ "$sdist" = 1 ] && args+=(--sdist)
[ "$quiet" = 1 ] && args+=(--quiet)
"$py" -m maturin "${args[@]}" >&2
ls "$out"/reshard-*.whl
