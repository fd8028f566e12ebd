#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/) with clang + ASan/UBSan and runs each for a bounded time.
# Fails if any target crashes, leaks, hits a sanitizer report or an uncaught non-moeinfer
# exception; the reproducer lands in <build>/fuzz-artifacts/. Inputs in fuzz/regressions/<target>/
# (past findings) are replayed first.
#
# Usage: scripts/run-fuzzers.sh [seconds-per-target=60] [target ...]
#   env: BUILD_DIR (default build-fuzz), JOBS (default: all cores), CC/CXX (default clang).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${1:-60}"
shift || true
build="${BUILD_DIR:-$root/build-fuzz}"
jobs="${JOBS:-$(nproc)}"
export CC="${CC:-clang}" CXX="${CXX:-clang++}"

case "$seconds" in
  '' | *[!0-9]*) echo "usage: $0 [seconds-per-target] [target ...]" >&2; exit 2 ;;
esac

cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DMOE_BUILD_FUZZ=ON -DMOE_BUILD_TESTS=OFF -DMOE_BUILD_BENCH=OFF -DMOE_ENABLE_CUDA=OFF >/dev/null
cmake --build "$build" --target fuzzers -j "$jobs"

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for bin in "$build"/fuzz/fuzz_*; do targets+=("$(basename "$bin" | sed 's/^fuzz_//')"); done
fi

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1:symbolize=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
mkdir -p "$build/fuzz-artifacts"
failed=()
for target in "${targets[@]}"; do
  bin="$build/fuzz/fuzz_$target"
  seeds="$root/fuzz/corpus/$target"
  work="$build/fuzz-corpus/$target"  # grows across runs; the committed seeds stay untouched
  mkdir -p "$work"
  dict=()
  [ "$target" != safetensors ] && dict=(-dict="$root/fuzz/json.dict")
  regressions="$root/fuzz/regressions/$target"
  if compgen -G "$regressions/*" >/dev/null; then
    echo "== fuzz_$target: replaying $(ls "$regressions" | wc -l) regression inputs"
    if ! "$bin" "$regressions"/* >"$build/fuzz-$target-regressions.log" 2>&1; then
      echo "fuzz_$target FAILED on a regression input; log: $build/fuzz-$target-regressions.log" >&2
      grep -E 'Running:|runtime error|ERROR|SUMMARY|what\(\)' "$build/fuzz-$target-regressions.log" >&2 || true
      failed+=("$target")
      continue
    fi
  fi
  echo "== fuzz_$target for ${seconds}s"
  if "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -max_len=65536 \
      -print_final_stats=1 "${dict[@]}" \
      -artifact_prefix="$build/fuzz-artifacts/$target-" "$work" "$seeds" \
      >"$build/fuzz-$target.log" 2>&1; then
    grep -E '^stat::number_of_executed_units|^stat::new_units_added' "$build/fuzz-$target.log" |
      tr '\n' ' '
    echo
  else
    echo "fuzz_$target FAILED; log: $build/fuzz-$target.log" >&2
    grep -E 'ERROR|SUMMARY|terminate|what\(\)|Test unit written' "$build/fuzz-$target.log" >&2 || true
    failed+=("$target")
  fi
done

if [ ${#failed[@]} -ne 0 ]; then
  echo "fuzzers with findings: ${failed[*]}" >&2
  exit 1
fi
echo "all fuzzers ran ${seconds}s without a finding"
