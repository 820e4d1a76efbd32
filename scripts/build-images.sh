#!/usr/bin/env bash
# Build the container images jetworker:local and nats:local without pulling
# anything (no image registry needed): each image is a rootfs assembled from
# local files, brought in with `docker import`, then finished by a small
# Dockerfile (deploy/Dockerfile.offline, deploy/Dockerfile.nats.offline).
#
# Usage: scripts/build-images.sh [all|jetworker|nats]      (default: all)
#
# Environment:
#   JETWORKER_IMAGE   tag of the worker image        (default jetworker:local)
#   NATS_IMAGE        tag of the nats-server image   (default nats:local)
#   JETWORKER_BIN     use this prebuilt jetworker binary instead of building
#   CARGO_TARGET_DIR  cargo's target directory        (default ./target)
#   CARGO             cargo command                   (default cargo)
#   NATS_SERVER_BIN   nats-server binary (default: scripts/install-nats-server.sh)
#   FORCE=1           rebuild even if the images are up to date
#   DOCKER_BUILDKIT   builder for the small Dockerfiles (default 0: classic)
#
# An image is up to date when its label org.jetworker.inputs equals the hash
# of everything that goes into it (binaries, Dockerfile, this script), so a
# rerun only costs a no-op `cargo build`. Needs docker; installs the Debian
# packages it copies from (busybox-static, bash, tini, ca-certificates) when
# they are missing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
JETWORKER_IMAGE="${JETWORKER_IMAGE:-jetworker:local}"
NATS_IMAGE="${NATS_IMAGE:-nats:local}"
CARGO="${CARGO:-cargo}"
WHAT="${1:-all}"
LABEL=org.jetworker.inputs

case "$WHAT" in
    all | jetworker | nats) ;;
    -h | --help)
        sed -n '2,/^set -e/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
        exit 0
        ;;
    *) echo "usage: $0 [all|jetworker|nats]" >&2; exit 2 ;;
esac

log() { echo "build-images: $*" >&2; }
die() { log "error: $*"; exit 1; }

command -v docker >/dev/null 2>&1 || die "docker not found"
docker info >/dev/null 2>&1 || die "cannot reach the Docker Engine (is it running? are you allowed to use it?)"

# --- host packages we copy files from -------------------------------------
APT_UPDATED=
apt_install() { # apt_install DEBIAN_PACKAGE
    command -v apt-get >/dev/null 2>&1 || die "install the Debian package $1 (no apt-get here)"
    [ "$(id -u)" = 0 ] || die "install the Debian package $1 (needs root)"
    log "installing $1"
    if [ -z "$APT_UPDATED" ]; then
        apt-get update -qq >/dev/null || die "apt-get update failed"
        APT_UPDATED=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$1" >/dev/null || die "apt-get install $1 failed"
}

need_file() { # need_file FILE DEBIAN_PACKAGE
    [ -e "$1" ] && return 0
    apt_install "$2"
    [ -e "$1" ] || die "$2 installed but $1 is still missing"
}

is_static() { # no program interpreter, i.e. `ldd` finds nothing to load
    local out
    out="$(LC_ALL=C ldd "$1" 2>&1 || true)"
    grep -qE 'not a dynamic executable|statically linked' <<<"$out"
}

# /bin/busybox comes from Debian's busybox (dynamic) or busybox-static (which
# replaces it); the images need the static one.
BUSYBOX=/bin/busybox
need_file "$BUSYBOX" busybox-static
if ! is_static "$BUSYBOX"; then
    apt_install busybox-static
    is_static "$BUSYBOX" || die "$BUSYBOX is not static: install the Debian package busybox-static"
fi

# --- helpers ---------------------------------------------------------------
TMP="$(mktemp -d "${TMPDIR:-/tmp}/jetworker-images.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT

# Copy a file into the rootfs at the same path (following symlinks).
put() { # put ROOTFS SRC [DEST]
    local dest="${3:-$2}"
    mkdir -p "$1$(dirname "$dest")"
    cp -L "$2" "$1$dest"
}

# Copy the shared libraries and the loader that `ldd` lists for a binary.
put_libs() { # put_libs ROOTFS BINARY
    local lib
    for lib in $(LC_ALL=C ldd "$2" 2>/dev/null | grep -oE '(/[^ ]+)' | sort -u); do
        [ -e "$lib" ] && put "$1" "$lib"
    done
}

# Busybox as /bin/busybox with a link for each applet, never overwriting a
# real program already in the rootfs.
put_busybox() { # put_busybox ROOTFS
    local r="$1" applet
    put "$r" "$BUSYBOX" /bin/busybox
    for applet in $("$BUSYBOX" --list-full); do
        if [ -e "$r/$applet" ] || [ -L "$r/$applet" ]; then
            continue
        fi
        mkdir -p "$r/$(dirname "$applet")"
        ln -s /bin/busybox "$r/$applet"
    done
}

base_fs() { # base_fs ROOTFS: directories and /etc files every image gets
    local r="$1"
    mkdir -p "$r"/{bin,sbin,usr/bin,usr/sbin,usr/local/bin,etc,root,dev,proc,sys,run,var/tmp}
    install -d -m 1777 "$r/tmp"
    chmod 1777 "$r/var/tmp"
    chmod 0700 "$r/root"
    cat >"$r/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
jetworker:x:10001:10001:jetworker:/home/jetworker:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
EOF
    cat >"$r/etc/group" <<'EOF'
root:x:0:
jetworker:x:10001:
nogroup:x:65534:
EOF
    cat >"$r/etc/nsswitch.conf" <<'EOF'
passwd: files
group: files
shadow: files
hosts: files dns
networks: files
protocols: files
services: files
EOF
    : >"$r/etc/hosts"
    : >"$r/etc/resolv.conf"
}

hash_of() { # hash_of FILE...: one hash of names and contents
    local f
    for f in "$@"; do
        printf '%s ' "$(basename "$f")"
        sha256sum <"$f" | cut -d' ' -f1
    done | sha256sum | cut -c1-32
}

image_label() { # image_label IMAGE -> the inputs label or nothing
    docker image inspect -f "{{ index .Config.Labels \"$LABEL\" }}" "$1" 2>/dev/null || true
}

# Import ROOTFS as BASE, build DOCKERFILE from it as IMAGE with the hash label.
import_and_build() { # import_and_build ROOTFS BASE DOCKERFILE IMAGE HASH
    local rootfs="$1" base="$2" dockerfile="$3" image="$4" hash="$5" old new
    old="$(docker image inspect -f '{{.Id}}' "$image" 2>/dev/null || true)"
    tar --numeric-owner --owner=0 --group=0 -C "$rootfs" -cf - . \
        | docker import --message "jetworker offline rootfs $hash" - "$base" >/dev/null \
        || die "docker import of $base failed"
    # The classic builder (unless DOCKER_BUILDKIT says otherwise) uses the
    # local base image as it is and never pulls.
    DOCKER_BUILDKIT="${DOCKER_BUILDKIT:-0}" docker build --quiet --build-arg "BASE=$base" --label "$LABEL=$hash" \
        -t "$image" - <"$dockerfile" >"$TMP/build.log" 2>&1 \
        || { cat "$TMP/build.log" >&2; die "docker build of $image failed"; }
    new="$(docker image inspect -f '{{.Id}}' "$image")"
    # Drop the previous version (and its untagged base) unless a container uses it.
    if [ -n "$old" ] && [ "$old" != "$new" ]; then
        docker rmi "$old" >/dev/null 2>&1 || true
    fi
}

# --- jetworker:local -------------------------------------------------------
build_jetworker() {
    local bin bash tini ca hash r
    if [ -n "${JETWORKER_BIN:-}" ]; then
        bin="$JETWORKER_BIN"
        [ -x "$bin" ] || die "JETWORKER_BIN=$bin is not an executable"
    else
        log "cargo build --release"
        (cd "$ROOT" && "$CARGO" build --release --bin jetworker) || die "cargo build failed"
        bin="${CARGO_TARGET_DIR:-$ROOT/target}/release/jetworker"
        case "$bin" in /*) ;; *) bin="$ROOT/$bin" ;; esac
        [ -x "$bin" ] || die "no binary at $bin"
    fi
    bash=/bin/bash
    tini=/usr/bin/tini-static
    ca=/etc/ssl/certs/ca-certificates.crt
    need_file "$bash" bash
    need_file "$tini" tini
    need_file "$ca" ca-certificates

    hash="$(hash_of "$bin" "$bash" "$BUSYBOX" "$tini" "$ca" \
        "$ROOT/deploy/Dockerfile.offline" "${BASH_SOURCE[0]}")"
    if [ -z "${FORCE:-}" ] && [ "$(image_label "$JETWORKER_IMAGE")" = "$hash" ]; then
        log "$JETWORKER_IMAGE is up to date"
        return 0
    fi
    log "assembling the $JETWORKER_IMAGE rootfs"
    r="$TMP/jetworker"
    base_fs "$r"
    if command -v strip >/dev/null 2>&1; then
        strip -o "$TMP/jetworker.bin" "$bin"
    else
        cp "$bin" "$TMP/jetworker.bin"
    fi
    put "$r" "$TMP/jetworker.bin" /usr/local/bin/jetworker
    chmod 0755 "$r/usr/local/bin/jetworker"
    put_libs "$r" "$bin"
    put "$r" "$bash" /bin/bash
    put_libs "$r" "$bash"
    ln -s /bin/bash "$r/usr/bin/bash"
    put "$r" "$tini" /usr/bin/tini
    put "$r" "$ca" /etc/ssl/certs/ca-certificates.crt
    put_busybox "$r"
    log "importing and building $JETWORKER_IMAGE"
    import_and_build "$r" "${JETWORKER_IMAGE%%:*}-rootfs:local" \
        "$ROOT/deploy/Dockerfile.offline" "$JETWORKER_IMAGE" "$hash"
    log "built $JETWORKER_IMAGE ($(docker run --rm --entrypoint jetworker "$JETWORKER_IMAGE" --version))"
}

# --- nats:local --------------------------------------------------------------
build_nats() {
    local bin hash r
    bin="$("$ROOT/scripts/install-nats-server.sh")" || die "no nats-server"
    is_static "$bin" || die "$bin is not a static binary"
    hash="$(hash_of "$bin" "$BUSYBOX" "$ROOT/deploy/Dockerfile.nats.offline" "${BASH_SOURCE[0]}")"
    if [ -z "${FORCE:-}" ] && [ "$(image_label "$NATS_IMAGE")" = "$hash" ]; then
        log "$NATS_IMAGE is up to date"
        return 0
    fi
    log "assembling the $NATS_IMAGE rootfs"
    r="$TMP/nats"
    base_fs "$r"
    put "$r" "$bin" /usr/local/bin/nats-server
    chmod 0755 "$r/usr/local/bin/nats-server"
    mkdir -p "$r/data"
    put_busybox "$r"
    log "importing and building $NATS_IMAGE"
    import_and_build "$r" "${NATS_IMAGE%%:*}-rootfs:local" \
        "$ROOT/deploy/Dockerfile.nats.offline" "$NATS_IMAGE" "$hash"
    log "built $NATS_IMAGE ($(docker run --rm "$NATS_IMAGE" --version))"
}

case "$WHAT" in
    all) build_jetworker; build_nats ;;
    jetworker) build_jetworker ;;
    nats) build_nats ;;
esac
