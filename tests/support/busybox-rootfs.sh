#!/bin/sh
# Build the root filesystem of the container tests' image, offline: a static
# busybox plus symlinks for the applets the tests use, packed as a tar
# archive on stdout. The tests feed it to the Docker Engine API
# (`POST /images/create?fromSrc=-`, what `docker import` does), because no
# registry is reachable in CI or in the sandbox.
#
#   tests/support/busybox-rootfs.sh > rootfs.tar
#   docker import rootfs.tar jetworker-test-busybox:v1   # by hand, if wanted
#
# Needs a statically linked busybox: BUSYBOX=/path, else /bin/busybox or
# /usr/bin/busybox; when missing and running as root with apt-get, installs
# busybox-static. Everything else is POSIX sh and tar. Exit status 3 means
# no busybox could be found or installed (the tests then say SKIPPED).
set -eu

find_busybox() {
    for b in "${BUSYBOX:-}" /bin/busybox /usr/bin/busybox; do
        if [ -n "$b" ] && [ -x "$b" ]; then
            echo "$b"
            return 0
        fi
    done
    return 1
}

if ! bb=$(find_busybox); then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "busybox-rootfs: installing busybox-static" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q busybox-static >&2 \
            || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q busybox-static >&2; }
        bb=$(find_busybox) || exit 3
    else
        echo "busybox-rootfs: no busybox found; install busybox-static or set BUSYBOX" >&2
        exit 3
    fi
fi

# A dynamically linked busybox would not run in an image without libc.
if command -v file >/dev/null 2>&1 && file -L "$bb" | grep -q "dynamically linked"; then
    echo "busybox-rootfs: $bb is dynamically linked; need busybox-static" >&2
    exit 1
fi

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
mkdir -p "$root/bin" "$root/tmp" "$root/etc" "$root/proc" "$root/sys" "$root/dev"
chmod 1777 "$root/tmp"
cp "$bb" "$root/bin/busybox"
for applet in sh echo sleep env cat head tail yes true false ls id printf \
    dd wc grep sed kill ps seq test mkdir rm pwd; do
    ln -s busybox "$root/bin/$applet"
done
printf 'root:x:0:0:root:/:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' > "$root/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' > "$root/etc/group"
tar -C "$root" --numeric-owner --owner=0 --group=0 -cf - .
