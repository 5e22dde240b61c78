#!/usr/bin/env bash
# Run the default test suite while two CPU-bound processes run beside it (what a
# contributor's busy desktop looks like). The script starts and stops the two
# burners itself and exits non-zero if any test fails.
#
#   scripts/stress-tests.sh              # the default suite (README's test command)
#   scripts/stress-tests.sh -k e2e       # extra arguments go to pytest
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}

burners=()
stop_burners() {
    for pid in "${burners[@]}"; do
        kill "$pid" 2>/dev/null
    done
    wait "${burners[@]}" 2>/dev/null
}
trap stop_burners EXIT INT TERM

for _ in 1 2; do
    # A pure-Python busy loop: one full core each, no I/O, no memory growth.
    "$PYTHON" -c 'while True: pass' &
    burners+=($!)
done
echo "stress-tests: 2 CPU burners running (pids ${burners[*]}); load before the suite: $(cut -d' ' -f1-3 /proc/loadavg)"

started=$(date +%s)
"$PYTHON" -m pytest -q "$@"
status=$?
echo "stress-tests: suite exited $status after $(( $(date +%s) - started )) s beside 2 CPU burners"
exit $status
