#!/usr/bin/env bash
# Smoke test of the compose deployment, offline:
#
#   1. builds jetworker:local and nats:local (scripts/build-images.sh);
#   2. `docker-compose up -d --scale worker=3` under its own project name,
#      NATS published on a free 127.0.0.1 port;
#   3. waits for NATS and the workers;
#   4. submits N tasks (`jetworker submit --shards N --wait --json` from the
#      host) and checks that all succeed and that their results name more
#      than one worker_id;
#   5. `docker-compose down -v` (also on failure or Ctrl-C).
#
# With SMOKE_CLUSTER=1 it runs deploy/compose.cluster.yml instead (3 NATS
# nodes, streams with 3 replicas) and, in step 4, a failure drill: tasks
# submitted one by one (each `sleep 1`) while one NATS container and one
# worker container are SIGKILLed (`docker kill`); the NATS node is started
# again. Then every task must have exactly one final result, the last
# record of its history, and must have run once, or more only where its
# history shows another attempt (the killed worker's lease ran out). The
# task script counts its runs in a directory bind-mounted from the host.
#
# Exit code 0 on success, 1 on failure (with the containers' logs), 2 when
# a tool is missing. Last line: "compose-smoke: PASS ..." or "...: FAIL ...".
#
# Environment:
#   SMOKE_PROJECT     compose project name        (default jetworker-smoke)
#   SMOKE_NATS_PORT   host port for NATS          (default: a free port)
#   SMOKE_WORKERS     worker replicas             (default 3)
#   SMOKE_TASKS       tasks to submit             (default 12)
#   SMOKE_TIMEOUT     seconds to wait for results (default 120)
#   SMOKE_CLUSTER=1   the 3-node cluster and its drill (above)
#   SMOKE_KEEP=1      leave the containers up afterwards
#   COMPOSE           compose command (default: `docker compose` if present,
#                     else docker-compose)
#   JETWORKER_BIN     host jetworker binary (default: the one build-images.sh
#                     builds in ${CARGO_TARGET_DIR:-target}/release)
#   JETWORKER_IMAGE, NATS_IMAGE, CARGO_TARGET_DIR, FORCE: see build-images.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Lower case [a-z0-9_-], as compose normalizes it (its labels carry that form).
PROJECT="$(printf '%s' "${SMOKE_PROJECT:-jetworker-smoke}" | tr '[:upper:]' '[:lower:]' | tr -cd 'a-z0-9_-')"
WORKERS="${SMOKE_WORKERS:-3}"
TASKS="${SMOKE_TASKS:-12}"
TIMEOUT="${SMOKE_TIMEOUT:-120}"
CLUSTER="${SMOKE_CLUSTER:-0}"
if [ "$CLUSTER" = 1 ]; then
    COMPOSE_FILE="$ROOT/deploy/compose.cluster.yml"
    NATS_SERVICES=(nats1 nats2 nats3)
else
    COMPOSE_FILE="$ROOT/docker-compose.yml"
    NATS_SERVICES=(nats)
fi
export JETWORKER_IMAGE="${JETWORKER_IMAGE:-jetworker:local}"
export NATS_IMAGE="${NATS_IMAGE:-nats:local}"

log() { echo "compose-smoke: $*"; }
fail() { log "FAIL: $*"; exit 1; }
missing() { log "FAIL: $*"; exit 2; }

command -v docker >/dev/null 2>&1 || missing "docker not found"
if [ -n "${COMPOSE:-}" ]; then
    read -r -a COMPOSE_CMD <<<"$COMPOSE"
elif docker compose version >/dev/null 2>&1; then
    COMPOSE_CMD=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
    COMPOSE_CMD=(docker-compose)
else
    missing "neither 'docker compose' nor docker-compose found"
fi

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
free_port() {
    if command -v python3 >/dev/null 2>&1; then
        python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
    else
        local p=$((20000 + RANDOM % 20000))
        while port_open "$p"; do p=$((p + 1)); done
        echo "$p"
    fi
}
PORT="${SMOKE_NATS_PORT:-$(free_port)}"
PORTS=("$PORT")
export NATS_PORT="$PORT" NATS_HOST=127.0.0.1
if [ "$CLUSTER" = 1 ]; then
    NATS_PORT_2="$(free_port)"
    NATS_PORT_3="$(free_port)"
    while [ "$NATS_PORT_3" = "$NATS_PORT_2" ] || [ "$NATS_PORT_3" = "$PORT" ]; do NATS_PORT_3="$(free_port)"; done
    export NATS_PORT_2 NATS_PORT_3
    PORTS+=("$NATS_PORT_2" "$NATS_PORT_3")
fi
URL="$(printf 'nats://127.0.0.1:%s,' "${PORTS[@]}")"
URL="${URL%,}"

# --- images and the host binary ------------------------------------------------
log "building images ($JETWORKER_IMAGE, $NATS_IMAGE)"
"$ROOT/scripts/build-images.sh" all || fail "could not build the images"
BIN="${JETWORKER_BIN:-${CARGO_TARGET_DIR:-$ROOT/target}/release/jetworker}"
case "$BIN" in /*) ;; *) BIN="$ROOT/$BIN" ;; esac
[ -x "$BIN" ] || missing "no host jetworker binary at $BIN"

# --- compose -------------------------------------------------------------------
TMP="$(mktemp -d "${TMPDIR:-/tmp}/jetworker-smoke.XXXXXX")"
# Test-only settings on top of the real compose file: few slots per worker,
# so that the tasks spread over the replicas whatever the CPU count.
cat >"$TMP/override.yml" <<'EOF'
version: "2.4"
services:
  worker:
    environment:
      JETWORKER_SLOTS: "2"
EOF
if [ "$CLUSTER" = 1 ]; then
    # The drill: a short ack wait, so that the killed worker's tasks come
    # back soon, and the runs directory shared with the host (the workers
    # run as uid 10001).
    mkdir -m 0777 "$TMP/runs"
    cat >>"$TMP/override.yml" <<EOF
      JETWORKER_ACK_WAIT: 10s
    volumes:
      - "$TMP/runs:/runs"
EOF
fi
compose() {
    "${COMPOSE_CMD[@]}" -p "$PROJECT" -f "$COMPOSE_FILE" -f "$TMP/override.yml" "$@"
}

WORKERS_SEEN=0
finish() {
    local rc=$?
    trap - EXIT INT TERM
    if [ "$rc" != 0 ]; then
        log "container logs (last 40 lines each):"
        compose ps 2>&1 | sed 's/^/    /' || true
        compose logs --no-color --tail 40 worker "${NATS_SERVICES[@]}" 2>&1 | sed 's/^/    /' || true
    fi
    if [ "${SMOKE_KEEP:-0}" = 1 ]; then
        log "left running: project $PROJECT, NATS on $URL (stop: ${COMPOSE_CMD[*]} -p $PROJECT down -v)"
    else
        compose down -v --remove-orphans >"$TMP/down.log" 2>&1 || { cat "$TMP/down.log"; log "warning: down failed"; }
    fi
    rm -rf "$TMP"
    if [ "$rc" = 0 ] && [ "$CLUSTER" = 1 ]; then
        log "PASS: $TASKS tasks, one final result each, through the loss of a NATS node and a worker"
    elif [ "$rc" = 0 ]; then
        log "PASS: $TASKS tasks succeeded on $WORKERS_SEEN of $WORKERS workers"
    else
        log "FAIL (exit $rc)"
    fi
    exit "$rc"
}
trap finish EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

log "starting project $PROJECT: ${NATS_SERVICES[*]} + $WORKERS workers, NATS on $URL (${COMPOSE_CMD[*]})"
compose down -v --remove-orphans >/dev/null 2>&1 || true
compose up -d --no-build --scale "worker=$WORKERS" >"$TMP/up.log" 2>&1 \
    || { cat "$TMP/up.log"; fail "compose up failed"; }

# --- wait for NATS and the workers ---------------------------------------------
deadline=$((SECONDS + 60))
for p in "${PORTS[@]}"; do
    until port_open "$p" || [ "$SECONDS" -ge "$deadline" ]; do sleep 0.2; done
    port_open "$p" || fail "NATS is not reachable on 127.0.0.1:$p"
done

# Worker containers: how many run without ever having restarted, and how
# many exited or restarted (plain docker with the labels both compose
# versions set: quicker than `compose ps`).
worker_states() {
    local up=0 down=0 id
    for id in $(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" \
        --filter "label=com.docker.compose.service=worker"); do
        case "$(docker inspect -f '{{.State.Running}} {{.State.Restarting}} {{.RestartCount}}' "$id" 2>/dev/null)" in
            "true false 0") up=$((up + 1)) ;;
            "false false 0") ;; # created, not started yet
            *) down=$((down + 1)) ;;
        esac
    done
    echo "$up $down"
}
deadline=$((SECONDS + 60))
while :; do
    read -r up down <<<"$(worker_states)"
    [ "$down" = 0 ] || fail "$down worker container(s) exited or restarted"
    [ "$up" = "$WORKERS" ] && break
    [ "$SECONDS" -lt "$deadline" ] || fail "only $up of $WORKERS workers are running after 60s"
    sleep 0.5
done
sleep 2 # a worker that cannot start exits within this
read -r up down <<<"$(worker_states)"
if [ "$up" != "$WORKERS" ] || [ "$down" != 0 ]; then
    fail "$up of $WORKERS workers are running, $down exited or restarted"
fi
log "NATS and $WORKERS workers are up"

# --- the cluster drill -----------------------------------------------------------
if [ "$CLUSTER" = 1 ]; then
    RUNS="$TMP/runs"
    runs_started() { find "$RUNS" -type f | wc -l | tr -d ' '; }
    log "drill: submitting $TASKS tasks, one every 0.3s (each sleeps 1s)"
    (
        for i in $(seq 1 "$TASKS"); do
            # The same id on a retry: the stream's dedup window drops a
            # second copy of a publish whose PubAck was lost.
            # shellcheck disable=SC2016 # expanded by the task's shell
            until "$BIN" --server "$URL" submit --id "cz-$i" --label default --type shell -- \
                'echo run >> /runs/$SCHEDULE_INSTANCE_ID; sleep 1' >/dev/null 2>>"$TMP/submit.err"; do
                sleep 0.5
            done
            sleep 0.3
        done
    ) &
    LOAD=$!
    deadline=$((SECONDS + 60))
    until [ "$(runs_started)" -ge 3 ]; do
        [ "$SECONDS" -lt "$deadline" ] || fail "no task ran within 60s"
        sleep 0.2
    done
    NATS_VICTIM="$(compose ps -q nats2)"
    WORKER_VICTIM="$(docker ps -q --filter "label=com.docker.compose.project=$PROJECT" \
        --filter "label=com.docker.compose.service=worker" | head -n 1)"
    [ -n "$NATS_VICTIM" ] && [ -n "$WORKER_VICTIM" ] || fail "cannot find the containers to kill"
    log "drill: docker kill nats2 and worker $WORKER_VICTIM under load"
    docker kill "$NATS_VICTIM" "$WORKER_VICTIM" >/dev/null
    wait "$LOAD" || fail "the load generator failed"
    log "drill: all $TASKS tasks submitted; starting nats2 again"
    docker start "$NATS_VICTIM" >/dev/null
    deadline=$((SECONDS + TIMEOUT))
    problems=0
    for i in $(seq 1 "$TASKS"); do
        id="cz-$i"
        until { "$BIN" --server "$URL" results "$id" --json >"$TMP/$id.jsonl" 2>/dev/null || true; } \
            && grep -q '"final":true' "$TMP/$id.jsonl"; do
            [ "$SECONDS" -lt "$deadline" ] || fail "no final result for $id within ${TIMEOUT}s"
            sleep 0.5
        done
        finals="$(grep -c '"final":true' "$TMP/$id.jsonl")"
        runs=0
        [ -f "$RUNS/$id" ] && runs="$(wc -l <"$RUNS/$id" | tr -d ' ')"
        # A second claim or a later attempt in the history: a lease was lost
        # (the killed worker's).
        claims="$(grep -c '"status":"running"' "$TMP/$id.jsonl" || true)"
        retried=0
        if [ "$claims" -gt 1 ] || grep -q '"attempt":\([2-9]\|[1-9][0-9]\)' "$TMP/$id.jsonl"; then
            retried=1
        fi
        why=""
        [ "$finals" = 1 ] || why="$finals final results"
        tail -n 1 "$TMP/$id.jsonl" | grep -q '"final":true' || why="$why; the final result is not the last record"
        [ "$runs" -ge 1 ] || why="$why; a final result but no run"
        if [ "$runs" -gt 1 ] && [ "$retried" = 0 ]; then why="$why; ran $runs times without a lost lease"; fi
        if [ -n "$why" ]; then
            problems=$((problems + 1))
            log "$id: ${why#; }"
            sed 's/^/    /' "$TMP/$id.jsonl"
        fi
    done
    [ "$problems" = 0 ] || fail "$problems of $TASKS tasks broke the invariants"
    exit 0
fi

# --- tasks -----------------------------------------------------------------------
log "submitting $TASKS tasks and waiting for their results (up to ${TIMEOUT}s)"
set +e
# shellcheck disable=SC2016 # expanded by the task's shell
"$BIN" submit --server "$URL" --label default --shards "$TASKS" --wait --wait-timeout "${TIMEOUT}s" --json \
    --type shell -- 'sleep 0.5; echo "shard $SHARD_NO of $SHARD_TOTAL on $(uname -n)"' \
    </dev/null >"$TMP/results.jsonl" 2>"$TMP/submit.err"
rc=$?
set -e
[ -s "$TMP/submit.err" ] && sed 's/^/    submit: /' "$TMP/submit.err"

finals="$(grep -c '"final":true' "$TMP/results.jsonl" || true)"
successes="$(grep '"final":true' "$TMP/results.jsonl" | grep -c '"status":"success"' || true)"
WORKERS_SEEN="$({ grep -o '"worker_id":"[^"]*"' "$TMP/results.jsonl" || true; } | sort -u | wc -l | tr -d ' ')"
log "results: $finals final, $successes successful; per worker:"
{ grep -o '"worker_id":"[^"]*"' "$TMP/results.jsonl" || true; } | cut -d'"' -f4 | sort | uniq -c | sed 's/^ */    /'
{ grep '"final":true' "$TMP/results.jsonl" | grep -v '"status":"success"' || true; } | head -n 5 | sed 's/^/    not successful: /'

[ "$rc" = 0 ] || fail "jetworker submit exited $rc"
[ "$successes" = "$TASKS" ] || fail "$successes of $TASKS tasks succeeded"
if [ "$WORKERS" -gt 1 ] && [ "$WORKERS_SEEN" -lt 2 ]; then
    fail "all results came from one worker"
fi
