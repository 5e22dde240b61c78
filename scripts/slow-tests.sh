#!/usr/bin/env bash
# The long end-to-end scenarios kept out of the default suite (marked `slow`): the
# delay schedules other than the default, a whole run stopped and resumed, a late
# joiner, a member frozen past the liveness TTL, a round without its quorum, more
# adversary attacks, the demo stopped by signals.
#
#   scripts/slow-tests.sh            # every slow test
#   scripts/slow-tests.sh -k quorum  # extra arguments go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" -m pytest -q -m slow "$@"
