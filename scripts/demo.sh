#!/usr/bin/env bash
# The jetworker demo, one command on a fresh machine:
#
#   scripts/demo.sh            run it, print the results, clean up
#   scripts/demo.sh --keep     leave the server and workers running and say
#                              how to submit more (and how to stop them)
#
# It installs nats-server if needed (scripts/install-nats-server.sh), builds
# the release binary, starts a private nats-server with JetStream on a free
# port with a temporary store, starts two workers (`jetworker run --labels
# default`), submits the example tasks in examples/tasks/ plus two inline
# ones with `jetworker submit --wait`, prints each final result, and stops
# the workers (SIGTERM, they drain) and the server. Exit code 0 when every
# task ended as expected (the timeout example is expected to time out).
#
# Options and environment:
#   --keep                    keep everything running (also DEMO_KEEP=1)
#   --port N    / NATS_PORT   client port of the private server (default: a free one)
#   --workers N / DEMO_WORKERS  number of workers (default 2)
#   DEMO_DIR                  working directory (default: a new temp dir;
#                             a directory you name is not deleted)
#   DEMO_TIMEOUT              seconds to wait for each result (default 120)
#   JETWORKER_BIN             use this jetworker binary, do not build
#   CARGO_TARGET_DIR, CARGO   where and with what to build (default ./target, cargo)
#   NATS_SERVER_BIN           nats-server to use (see install-nats-server.sh)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KEEP="${DEMO_KEEP:-0}"
PORT="${NATS_PORT:-}"
WORKERS="${DEMO_WORKERS:-2}"
WAIT_SECS="${DEMO_TIMEOUT:-120}"
CARGO="${CARGO:-cargo}"

usage() { sed -n '2,/^set -e/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case "$1" in
        --keep) KEEP=1 ;;
        --port) PORT="${2:?--port needs a number}"; shift ;;
        --port=*) PORT="${1#*=}" ;;
        --workers) WORKERS="${2:?--workers needs a number}"; shift ;;
        --workers=*) WORKERS="${1#*=}" ;;
        -h | --help) usage; exit 0 ;;
        *) echo "demo: unknown argument $1 (try --help)" >&2; exit 2 ;;
    esac
    shift
done
case "$WORKERS" in '' | *[!0-9]* | 0) echo "demo: --workers must be a positive number" >&2; exit 2 ;; esac
case "$PORT" in *[!0-9]*) echo "demo: --port must be a number" >&2; exit 2 ;; esac

if [ -t 1 ]; then
    say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
else
    say() { printf '==> %s\n' "$*"; }
fi
die() { echo "demo: error: $*" >&2; exit 1; }

# --- tools -------------------------------------------------------------------
say "checking nats-server"
NATS_SERVER_BIN="$("$ROOT/scripts/install-nats-server.sh")" || die "could not install nats-server"
echo "    $("$NATS_SERVER_BIN" --version) at $NATS_SERVER_BIN"

if [ -n "${JETWORKER_BIN:-}" ]; then
    BIN="$JETWORKER_BIN"
else
    command -v "$CARGO" >/dev/null 2>&1 || die "cargo not found: install Rust (rustup) or set JETWORKER_BIN"
    say "building jetworker (cargo build --release)"
    (cd "$ROOT" && "$CARGO" build --release --bin jetworker) || die "cargo build failed"
    BIN="${CARGO_TARGET_DIR:-$ROOT/target}/release/jetworker"
    case "$BIN" in /*) ;; *) BIN="$ROOT/$BIN" ;; esac
fi
[ -x "$BIN" ] || die "no jetworker binary at $BIN"
"$BIN" submit --help 2>/dev/null | grep -q -- '--wait' \
    || die "this jetworker has no 'submit --wait' yet ($("$BIN" --version))"

# --- working directory and port ---------------------------------------------
if [ -n "${DEMO_DIR:-}" ]; then
    DIR="$DEMO_DIR"
    OWN_DIR=0
    mkdir -p "$DIR"
    DIR="$(cd "$DIR" && pwd)"
else
    DIR="$(mktemp -d "${TMPDIR:-/tmp}/jetworker-demo.XXXXXX")"
    OWN_DIR=1
fi
mkdir -p "$DIR/out"

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
if [ -z "$PORT" ]; then
    if command -v python3 >/dev/null 2>&1; then
        PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    else
        PORT=$((20000 + RANDOM % 20000))
        while port_open "$PORT"; do PORT=$((PORT + 1)); done
    fi
elif port_open "$PORT"; then
    die "port $PORT is already in use (choose another with --port or NATS_PORT)"
fi
URL="nats://127.0.0.1:$PORT"

# --- cleanup -----------------------------------------------------------------
NATS_PID=
WORKER_PIDS=()
SUBMIT_PIDS=()
OK=0

# stop PID NAME SECONDS: SIGTERM, wait, then SIGKILL.
stop() {
    local pid="$1" name="$2" secs="$3" i
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || return 0
    for ((i = 0; i < secs * 10; i++)); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    echo "demo: $name did not stop within ${secs}s; killing it" >&2
    kill -KILL "$pid" 2>/dev/null || true
}

cleanup() {
    local rc=$? pid
    trap - EXIT INT TERM
    [ "$KEEP" = 1 ] && [ "$OK" = 1 ] && exit "$rc"
    for pid in "${SUBMIT_PIDS[@]}"; do # interrupted while waiting for results
        kill -TERM "$pid" 2>/dev/null || true
    done
    if [ "${#WORKER_PIDS[@]}" -gt 0 ]; then
        say "stopping the workers (SIGTERM: they drain and deregister)"
        for pid in "${WORKER_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
        for pid in "${WORKER_PIDS[@]}"; do stop "$pid" "worker $pid" 30; done
        for pid in "${WORKER_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    fi
    if [ -n "$NATS_PID" ]; then
        say "stopping nats-server"
        stop "$NATS_PID" nats-server 10
        wait "$NATS_PID" 2>/dev/null || true
    fi
    if [ "$rc" != 0 ]; then
        echo "demo: logs are in $DIR (nats.log, w*.log, out/)" >&2
    elif [ "$OWN_DIR" = 1 ]; then
        rm -rf "$DIR"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# In --keep mode the processes outlive this script (and its terminal).
launch() { # launch LOG CMD...: start in the background, $! is its pid
    local log="$1"
    shift
    if [ "$KEEP" = 1 ]; then
        nohup "$@" </dev/null >"$log" 2>&1 &
    else
        "$@" </dev/null >"$log" 2>&1 &
    fi
}

# --- server ------------------------------------------------------------------
say "starting nats-server with JetStream on $URL (store in $DIR/nats)"
launch "$DIR/nats.log" "$NATS_SERVER_BIN" -a 127.0.0.1 -p "$PORT" -js -sd "$DIR/nats" -n jetworker-demo
NATS_PID=$!
for ((i = 0; i < 100; i++)); do
    port_open "$PORT" && break
    kill -0 "$NATS_PID" 2>/dev/null || { cat "$DIR/nats.log" >&2; die "nats-server exited"; }
    sleep 0.1
done
port_open "$PORT" || { cat "$DIR/nats.log" >&2; die "nats-server is not listening on $PORT"; }

# --- workers -----------------------------------------------------------------
say "starting $WORKERS workers (labels: default)"
for ((i = 1; i <= WORKERS; i++)); do
    launch "$DIR/w$i.log" "$BIN" run --server "$URL" --labels default --name "demo-w$i" \
        --state-dir "$DIR/w$i" --slots 2 --drain-timeout 10s --kill-grace 2s
    WORKER_PIDS+=($!)
    echo "    worker demo-w$i: pid $!, log $DIR/w$i.log"
done
sleep 1
for ((i = 1; i <= WORKERS; i++)); do
    if ! kill -0 "${WORKER_PIDS[$((i - 1))]}" 2>/dev/null; then
        tail -n 20 "$DIR/w$i.log" >&2
        die "worker demo-w$i exited at once"
    fi
done

# --- tasks -------------------------------------------------------------------
RUN="$(date +%H%M%S)"
NAMES=()
EXPECT=()
submit() { # submit NAME EXPECTED-STATUS SUBMIT-ARGS...: in the background
    local name="$1" expect="$2"
    shift 2
    NAMES+=("$name")
    EXPECT+=("$expect")
    timeout "$((WAIT_SECS + 10))" "$BIN" submit --server "$URL" --id "demo-$RUN-$name" \
        --wait --wait-timeout "${WAIT_SECS}s" "$@" </dev/null >"$DIR/out/$name.txt" 2>&1 &
    SUBMIT_PIDS+=($!)
}

say "submitting tasks to tasks.default and waiting for their results"
EX="$ROOT/examples/tasks"
# shellcheck disable=SC2016 # the script is expanded by the task's shell
submit inline-shell success --label default --type shell -- 'echo "hello from $(uname -n) at $(date -u +%H:%M:%S)"'
submit inline-command success --label default --type command --retries 0 -- uname -s -m
submit shell-hello success --file "$EX/shell-hello.json"
submit command-args success --file "$EX/command-args.json"
submit retry-then-succeed success --file "$EX/retry-then-succeed.json"
submit shard-0-of-2 success --file "$EX/shard-0-of-2.json"
submit shard-1-of-2 success --file "$EX/shard-1-of-2.json"
submit timeout timeout --file "$EX/timeout.json"
for ((i = 0; i < ${#NAMES[@]}; i++)); do
    rc=0
    wait "${SUBMIT_PIDS[$i]}" || rc=$?
    echo "$rc" >"$DIR/out/${NAMES[$i]}.rc"
done
SUBMIT_PIDS=()

# --- results -----------------------------------------------------------------
good=0
for ((i = 0; i < ${#NAMES[@]}; i++)); do
    name="${NAMES[$i]}"
    expect="${EXPECT[$i]}"
    rc="$(cat "$DIR/out/$name.rc" 2>/dev/null || echo '?')"
    out="$(cat "$DIR/out/$name.txt" 2>/dev/null || true)"
    if [ "$expect" = success ]; then
        [ "$rc" = 0 ] && verdict=ok || verdict=UNEXPECTED
    else
        # Any other final status: submit exits 1 and the summary names it.
        if [ "$rc" = 1 ] && grep -q " $expect " <<<"$out"; then verdict=ok; else verdict=UNEXPECTED; fi
    fi
    [ "$verdict" = ok ] && good=$((good + 1))
    echo
    echo "--- $name (expected $expect, submit exit $rc): $verdict"
    printf '%s\n' "$out" | sed 's/^/    /'
done
echo
workers_seen="$(cat "$DIR"/out/*.txt 2>/dev/null | grep -oE 'worker demo-w[0-9]+' | sort -u | sed 's/^worker //' | paste -sd ' ' -)"
[ -n "$workers_seen" ] && say "tasks ran on: $workers_seen"
say "$good of ${#NAMES[@]} tasks ended as expected"
[ "$good" = "${#NAMES[@]}" ] || exit 1
OK=1

# The newcomer's next step: the binary on PATH.
cat <<EOF

The jetworker binary is $BIN
Put it on your PATH with one of:
    cargo install --path "$ROOT"          # installs into ~/.cargo/bin
    ln -s "$BIN" ~/.local/bin/jetworker
EOF

if [ "$KEEP" = 1 ]; then
    cat >"$DIR/stop.sh" <<EOF
#!/usr/bin/env bash
# Stop the jetworker demo started by scripts/demo.sh --keep.
for pid in ${WORKER_PIDS[*]}; do kill -TERM "\$pid" 2>/dev/null; done
for pid in ${WORKER_PIDS[*]}; do while kill -0 "\$pid" 2>/dev/null; do sleep 0.2; done; done
kill -TERM $NATS_PID 2>/dev/null
while kill -0 $NATS_PID 2>/dev/null; do sleep 0.2; done
$([ "$OWN_DIR" = 1 ] && echo "rm -rf '$DIR'")
echo "jetworker demo stopped"
EOF
    chmod +x "$DIR/stop.sh"
    cat <<EOF

The demo keeps running: nats-server on $URL, $WORKERS workers, files in $DIR.
Submit more tasks:

    export NATS_URL=$URL
    $BIN submit --wait -- 'echo hello again'
    $BIN submit --wait --file $EX/retry-then-succeed.json
    $BIN submit --shards 4 --wait -- 'echo shard \$SHARD_NO of \$SHARD_TOTAL'
    $BIN submit --label default --type command -- /bin/echo hi
    $BIN results
    $BIN workers

Stop it with:  $DIR/stop.sh
EOF
fi
