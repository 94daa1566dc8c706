#!/usr/bin/env bash
# Short fuzzing session: build reshard's cargo-fuzz targets (fuzz/) and run each for SECONDS
# (default 30), one after the other on one core, then print per target the executions and
# whether it crashed.
#
#   scripts/fuzz.sh                 # every target, 30 s each
#   scripts/fuzz.sh 600 open_dcp    # one target, 10 minutes
#   FUZZ_SANITIZER=none scripts/fuzz.sh   # without AddressSanitizer (faster)
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`; installed here when missing). libFuzzer and
# the sanitizer flags need a nightly compiler; on a stable toolchain RUSTC_BOOTSTRAP=1 lets it
# accept them. New corpus entries go to fuzz/corpus/<target>/ (kept between runs, not
# committed), next to the committed seeds fuzz/seeds/<target>/; crashing inputs to
# fuzz/artifacts/<target>/, libFuzzer's output to fuzz/artifacts/<target>.log.
#
# A crash is a bug: minimize it (`cargo fuzz tmin <target> <file>` under RUSTC_BOOTSTRAP=1),
# fix it, and commit the input under tests/fixtures/fuzz/<target>/, which
# tests/it/fuzz_regressions.rs replays through the same code on every `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."

SECONDS_PER_TARGET=${1:-30}
shift || true
ALL_TARGETS=(pickle torch_zip safetensors_header hf_index layout open_dcp open_deepspeed open_producers)
if [ $# -gt 0 ]; then TARGETS=("$@"); else TARGETS=("${ALL_TARGETS[@]}"); fi
SANITIZER=${FUZZ_SANITIZER:-address}

export RUSTC_BOOTSTRAP=1
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "fuzz: installing cargo-fuzz" >&2
  cargo install cargo-fuzz
fi

cd fuzz
echo "fuzz: building ${#TARGETS[@]} target(s) (sanitizer: $SANITIZER)" >&2
for t in "${TARGETS[@]}"; do
  cargo fuzz build -s "$SANITIZER" "$t" >&2
done

crashed=0
printf '%-20s %12s  %s\n' target executions result
for t in "${TARGETS[@]}"; do
  mkdir -p "corpus/$t" "artifacts/$t"
  log="artifacts/$t.log"
  # -timeout: one input may take at most 30 s (the slowest, open_dcp, takes well under 1 s)
  if cargo fuzz run -s "$SANITIZER" "$t" "corpus/$t" "seeds/$t" -- \
      -max_total_time="$SECONDS_PER_TARGET" -timeout=30 -rss_limit_mb=4096 \
      -print_final_stats=1 >"$log" 2>&1; then
    result=ok
  else
    crash=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -n 1)
    result="CRASH: ${crash:-see fuzz/$log}"
    crashed=1
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *\([0-9]*\).*/\1/p' "$log" | tail -n 1)
  if [ -z "$execs" ]; then
    execs=$(sed -n 's/^#\([0-9][0-9]*\)[[:space:]].*/\1/p' "$log" | tail -n 1)
  fi
  printf '%-20s %12s  %s\n' "$t" "${execs:-?}" "$result"
done
exit $crashed
