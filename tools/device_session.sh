#!/usr/bin/env bash
# The GPU jobs by name, for one device call each, run from the repository root (`.bench` carried): the table is
# tools/scenarios.py (`python -m tools.scenarios` lists it; --dry-run prints the commands). Results under $OUT.
#   RIMURU_COMMIT=abc1234 bash tools/device_session.sh profile serve          # jobs run in the order given
# NOTE: give RIMURU_COMMIT literally: the device's copy of the tree can carry git metadata older than its files
set -u
source tools/device_env.sh
exec python -P -m tools.scenarios "$@"
