# jetworker container image.
#
#   docker build -t jetworker .
#   docker run --rm -e NATS_URL=nats://nats.example:4222 jetworker            # the worker
#   docker run --rm -e NATS_URL=... jetworker submit --wait -- 'echo hello'   # operator CLI
#
# The worker runs as the unprivileged user `jetworker` (uid 10001) and keeps
# its outbox in /var/lib/jetworker (mount a volume there to keep it across
# re-creation). Running tasks as another user (`task_user`) needs the worker
# to run as root (`docker run --user 0`). Container tasks need the Docker
# Engine socket mounted and a user allowed to use it.
#
# This Dockerfile needs the public base images below. On a machine without
# an image registry use scripts/build-images.sh instead (same layout).

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin jetworker \
 && strip target/release/jetworker \
 && install -m 0755 target/release/jetworker /usr/local/bin/jetworker

FROM debian:bookworm-slim
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        bash ca-certificates tini \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 jetworker \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/jetworker \
        --shell /bin/bash jetworker \
 && install -d -o jetworker -g jetworker -m 0750 /var/lib/jetworker
COPY --from=build /usr/local/bin/jetworker /usr/local/bin/jetworker

ENV LANG=C.UTF-8 \
    JETWORKER_STATE_DIR=/var/lib/jetworker \
    JETWORKER_METRICS_ADDR=0.0.0.0:9090
USER jetworker
WORKDIR /home/jetworker

# /metrics, /healthz and /readyz. The health check probes /readyz with the
# binary itself (no curl in the image): healthy while the worker is
# connected to NATS and pulling. A container that runs an operator command
# instead of the worker reports unhealthy, harmlessly.
EXPOSE 9090
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["jetworker", "health"]

# tini as PID 1 reaps orphaned task processes and passes SIGTERM on to the
# worker, which drains its running tasks (drain_timeout) before it exits;
# give `docker stop -t` more than drain_timeout + kill_grace.
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/bin/tini", "--", "jetworker"]
CMD ["run"]
