#!/usr/bin/env bash
# The CUDA tests one gtest suite at a time, each under its own time limit, on the GPU machine: a
# suite that hangs (or runs far longer than it should) is named and killed instead of taking the
# rest of the run with it, and the table says where the time goes.
#
#   scripts/gpu-test-suites.sh [TEST_BINARY] [GTEST_FILTER]
#
# TEST_BINARY defaults to build-gpu/tests/test_cuda (built by scripts/gpu-check.sh or by hand);
# GTEST_FILTER (default '*') picks the suites. MOE_SUITE_TIMEOUT (s, default 120) is each suite's
# limit, MOE_SUITES_DEADLINE (s, default none) stops starting suites after that long. Each
# suite's log goes to $OUT/suites/NAME.log (or /tmp/gpu-test-suites); one line per suite is
# printed (tests, passed, failed, seconds, OK / FAILED / TIMEOUT), then the failed test names.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN="${1:-build-gpu/tests/test_cuda}"
FILTER="${2:-*}"
OUT="${OUT:-/tmp/gpu-test-suites}"
LOGS="$OUT/suites"
LIMIT="${MOE_SUITE_TIMEOUT:-120}"
DEADLINE="${MOE_SUITES_DEADLINE:-0}"
mkdir -p "$LOGS"
[ -x "$BIN" ] || { echo "gpu-test-suites: no test binary at $BIN" >&2; exit 2; }

# Suite names as gtest lists them ("Suite." at the start of a line; parameterised suites keep
# their prefix), in the binary's order.
mapfile -t suites < <("$BIN" --gtest_list_tests --gtest_filter="$FILTER" | sed -n 's/^\([^ ][^ ]*\)\.$/\1/p')
[ ${#suites[@]} -gt 0 ] || { echo "gpu-test-suites: no suite matches '$FILTER'" >&2; exit 2; }

start=$SECONDS status=0
printf '%-44s %6s %6s %6s %8s  %s\n' suite tests passed failed seconds result
for suite in "${suites[@]}"; do
  if [ "$DEADLINE" -gt 0 ] && [ $((SECONDS - start)) -ge "$DEADLINE" ]; then
    printf '%-44s %6s %6s %6s %8s  %s\n' "$suite" - - - - "NOT RUN (deadline)"
    status=1
    continue
  fi
  log="$LOGS/${suite//\//_}.log"
  t0=$SECONDS
  timeout -s KILL "$LIMIT" "$BIN" --gtest_filter="$suite.*" >"$log" 2>&1
  rc=$?
  seconds=$((SECONDS - t0))
  tests=$(grep -c '^\[ RUN      \]' "$log")
  passed=$(grep -c '^\[       OK \]' "$log")
  failed=$(grep -c '^\[  FAILED  \] .*(' "$log")
  if [ "$rc" -eq 137 ]; then
    result="TIMEOUT after $LIMIT s in $(grep '^\[ RUN      \]' "$log" | tail -1 | sed 's/^\[ RUN      \] //')"
    status=1
  elif [ "$rc" -ne 0 ]; then
    result=FAILED
    status=1
  else
    result=OK
  fi
  printf '%-44s %6s %6s %6s %8s  %s\n' "$suite" "$tests" "$passed" "$failed" "$seconds" "$result"
done
echo "all suites: $((SECONDS - start)) s"
grep -h '^\[  FAILED  \] .*(' "$LOGS"/*.log | sort -u
exit $status
