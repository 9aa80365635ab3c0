#!/usr/bin/env bash
# compute-sanitizer's memcheck, synccheck and racecheck over every kernel family
# (bench/sanitizer_cases.py); full reports under $OUT, one summary line per tool printed.
#   run from the repository root: bash bench/sanitize.sh
set -u -o pipefail
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
export PTXFORGE_CACHE_DIR=/tmp/ptxforge-cache
OUT=${OUT:-/tmp/ptxforge-out}
mkdir -p "$OUT"
for tool in memcheck synccheck racecheck; do
  report="$OUT/sanitize-$tool.txt"
  timeout 240 compute-sanitizer --tool "$tool" --report-api-errors no \
    python3 bench/sanitizer_cases.py > "$report" 2>&1
  echo "$tool: exit $? | $(grep -c '^ran' "$report") cases ran | $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$report" | tail -1)"
done
