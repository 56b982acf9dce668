#!/usr/bin/env bash
# The test suite in two lanes at once: the SGLang servers (tests/sglang:
# most of the time, and busy on the CPU) beside everything else (daemons,
# agreement, storage, models: mostly waiting on sockets and peers). Each lane
# writes its log and its JUnit report under build/test/, prints its log when
# it ends, and the run fails if either fails.
#
#     scripts/test-lanes.sh PYTHON [PYTEST OPTION...]
#
# CPCACHE_TEST_LANES=1 runs the two lanes one after the other.
set -uo pipefail
cd "$(dirname "$0")/.."
python=$1
shift
out=build/test
mkdir -p "$out"
rm -f "$out"/*.xml "$out"/*.log "$out"/*.rc

lane() {  # NAME PYTEST-ARGS...: one pytest run, its output to its log
  local name=$1
  shift
  "$python" -m pytest "$@" --junitxml="$out/$name.xml" >"$out/$name.log" 2>&1
  echo $? >"$out/$name.rc"
}

report() {  # NAME: its log, once it has ended
  echo "===== lane $1 (exit $(cat "$out/$1.rc")): $out/$1.log"
  cat "$out/$1.log"
}

if [ "${CPCACHE_TEST_LANES:-2}" = 1 ]; then
  lane others --ignore=tests/sglang --durations=10 "$@"
  report others
  lane sglang tests/sglang --durations=25 "$@"
  report sglang
else
  lane others --ignore=tests/sglang --durations=10 "$@" &
  others=$!
  lane sglang tests/sglang --durations=25 "$@" &
  sglang=$!
  wait "$others"
  report others
  wait "$sglang"
  report sglang
fi
for name in others sglang; do
  [ "$(cat "$out/$name.rc")" = 0 ] || [ "$(cat "$out/$name.rc")" = 5 ] || exit 1
done
