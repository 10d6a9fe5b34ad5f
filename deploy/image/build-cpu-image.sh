#!/usr/bin/env bash
# Builds the CPU image without a container engine, checks it and packages it (make image-cpu):
#   1. a Debian 12 root filesystem with mmdebstrap: essential packages plus
#      deploy/docker/runtime-packages.txt (what the Dockerfile installs), the kvpoold and kvpool
#      binaries of BUILD_DIR, user and group 65532 (kvpool);
#   2. runs kvpoold inside it (unshare + chroot, as user 65532, on loopback) and asks it for
#      health with the kvpool CLI inside the image and scrapes /metrics: the runtime packages
#      suffice and the image serves;
#   3. packages it as an OCI image archive with umoci (entrypoint, user, ports as the
#      Dockerfile's), OUT_DIR/kvpool-cpu.oci.tar (`skopeo copy oci-archive:...` or
#      `podman load` take it).
# Needs root (mmdebstrap --mode=root, chroot, mounts), network for Debian's mirror, and the
# Debian packages mmdebstrap and umoci (installed here if missing).
#
#   deploy/image/build-cpu-image.sh [BUILD_DIR] [OUT_DIR]
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
BUILD="$(cd "${1:-$ROOT/build}" && pwd)"
OUT="${2:-$BUILD/image}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
"$ROOT/scripts/install-deps.sh" mmdebstrap umoci

for bin in kvpoold kvpool; do
  [ -x "$BUILD/bin/$bin" ] || { echo "build-cpu-image: no $BUILD/bin/$bin (make build)"; exit 1; }
done
rm -rf "$OUT" && mkdir -p "$OUT"
ROOTFS="$OUT/rootfs"
packages="$(grep -v '^#' "$ROOT/deploy/docker/runtime-packages.txt" | paste -sd, -)"

echo "build-cpu-image: root filesystem (mmdebstrap bookworm + $packages)"
mmdebstrap --quiet --variant=essential --mode=root --include="$packages" bookworm "$ROOTFS" \
  "$MIRROR"
install -m 0755 "$BUILD/bin/kvpoold" "$BUILD/bin/kvpool" "$ROOTFS/usr/local/bin/"
echo "kvpool:x:65532:65532:kvpool:/nonexistent:/usr/sbin/nologin" >> "$ROOTFS/etc/passwd"
echo "kvpool:x:65532:" >> "$ROOTFS/etc/group"
chmod 1777 "$ROOTFS/tmp"

echo "build-cpu-image: running kvpoold inside it as 65532"
unshare --mount --fork bash -s "$ROOTFS" <<'INSIDE'
set -euo pipefail
R="$1"
mount -t proc proc "$R/proc"
mount --rbind /dev "$R/dev"
mount --rbind /sys "$R/sys"
# chroot execs kvpoold: $pid is the daemon's.
chroot --userspec=65532:65532 "$R" /usr/local/bin/kvpoold --listen=127.0.0.1:0 \
  --port_file=/tmp/port --pool_bytes=67108864 --metrics_listen=127.0.0.1:0 \
  --metrics_port_file=/tmp/metrics_port --ucx_tls=tcp --ucx_net_devices=lo \
  > "$R/tmp/kvpoold.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 600); do [ -s "$R/tmp/port" ] && break; sleep 0.1; done
[ -s "$R/tmp/port" ] || { cat "$R/tmp/kvpoold.log"; echo "kvpoold did not start"; exit 1; }
chroot --userspec=65532:65532 "$R" /usr/local/bin/kvpool health \
  --target="127.0.0.1:$(cat "$R/tmp/port")"
exec 3<>"/dev/tcp/127.0.0.1/$(cat "$R/tmp/metrics_port")"
printf 'GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n' >&3
grep -q '^kvpool_build_info{' <&3 || { echo "no metrics from the image"; exit 1; }
kill -TERM $pid
wait $pid  # kvpoold exits 0 after a clean shutdown (set -e fails on anything else)
trap - EXIT
echo "build-cpu-image: kvpoold served inside the image and stopped cleanly"
INSIDE
rm -f "$ROOTFS/tmp/port" "$ROOTFS/tmp/metrics_port" "$ROOTFS/tmp/kvpoold.log"

echo "build-cpu-image: OCI image (umoci)"
LAYOUT="$OUT/oci"
umoci init --layout "$LAYOUT"
umoci new --image "$LAYOUT:cpu"
umoci unpack --image "$LAYOUT:cpu" "$OUT/bundle"
rmdir "$OUT/bundle/rootfs" && mv "$ROOTFS" "$OUT/bundle/rootfs"
umoci repack --image "$LAYOUT:cpu" "$OUT/bundle"
umoci config --image "$LAYOUT:cpu" --config.user 65532:65532 \
  --config.entrypoint /usr/local/bin/kvpoold --config.entrypoint --listen=0.0.0.0:50051 \
  --config.entrypoint --metrics_listen=0.0.0.0:9400 \
  --config.exposedports 50051/tcp --config.exposedports 9400/tcp
umoci stat --image "$LAYOUT:cpu" > /dev/null
tar -C "$LAYOUT" -cf "$OUT/kvpool-cpu.oci.tar" .
rm -rf "$OUT/bundle"
echo "build-cpu-image: $OUT/kvpool-cpu.oci.tar ($(du -h "$OUT/kvpool-cpu.oci.tar" | cut -f1))"
