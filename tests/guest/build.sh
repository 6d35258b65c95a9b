#!/usr/bin/env bash
# Builds brokkr's test guest: Debian's cloud kernel (downloaded and unpacked,
# never installed) and a busybox-static initramfs with the virtio modules, an
# /init that leases an address and serves :8080 (HTTP), :7000 (TCP echo) and
# :7001 (UDP echo), and a power-button handler.
#
# Output in $REPO/.cache/guest/: vmlinuz, initramfs.cpio.gz, env (paths and
# sha256s). Cached: the build is keyed by the kernel package version, the
# busybox version, Go's version and this directory's files; a rerun with the
# same inputs only re-checks the key.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
out="$repo/.cache/guest"
mkdir -p "$out"
export PATH=/usr/local/go/bin:$PATH

# Modules loaded by /init, in dependency order; checked against .modinfo below.
modules=(virtio_ring virtio virtio_pci_modern_dev virtio_pci_legacy_dev virtio_pci virtio_mmio
         failover net_failover virtio_net virtio_blk button evdev)

resolve_kernel() { apt-cache depends linux-image-cloud-amd64 2>/dev/null | awk '/Depends: linux-image-/{print $2; exit}'; }
kpkg=$(resolve_kernel || true)
if [ -z "$kpkg" ]; then
  apt-get update -qq >/dev/null
  kpkg=$(resolve_kernel || true)
fi
if [ -z "$kpkg" ]; then
  echo "guest-image: cannot resolve linux-image-cloud-amd64 with apt-cache depends" >&2; exit 1
fi
kver=$(apt-cache policy "$kpkg" | awk '/Candidate:/{print $2}')
bbver=$(dpkg-query -W -f='${Version}' busybox-static 2>/dev/null || true)
[ -x /bin/busybox ] && [ -n "$bbver" ] || { echo "guest-image: busybox-static is not installed (scripts/deps.sh)" >&2; exit 1; }
command -v cpio >/dev/null || { echo "guest-image: cpio is not installed (scripts/deps.sh)" >&2; exit 1; }

key=$( { echo "$kpkg $kver busybox=$bbver $(go version)"; echo "${modules[*]}";
         cd "$here" && find . -type f ! -name '*_test.go' | LC_ALL=C sort | xargs sha256sum; } | sha256sum | cut -d' ' -f1)
if [ -f "$out/key" ] && [ "$(cat "$out/key")" = "$key" ] && [ -f "$out/vmlinuz" ] && [ -f "$out/initramfs.cpio.gz" ] && [ -f "$out/env" ]; then
  echo "guest-image: up to date ($out, $kpkg $kver)"
  exit 0
fi
echo "guest-image: building ($kpkg $kver, busybox $bbver)"

work=$(mktemp -d "$out/build.XXXXXX")
trap 'rm -rf "$work"' EXIT

# Kernel: apt-get download + dpkg -x, kept per version so a rebuild of the
# initramfs alone does not download again.
kdir="$out/kernel-$kpkg-$kver"
if [ ! -f "$kdir/.done" ]; then
  rm -rf "$kdir"; mkdir -p "$work/deb"
  (cd "$work/deb" && apt-get download -q "$kpkg=$kver" >/dev/null 2>&1) \
    || { echo "guest-image: apt-get download $kpkg=$kver failed" >&2; exit 1; }
  dpkg -x "$work"/deb/*.deb "$work/kernel"
  # Keep only what the image uses: vmlinuz and the listed modules.
  mkdir -p "$kdir/modules"
  cp "$work"/kernel/boot/vmlinuz-* "$kdir/vmlinuz"
  for m in "${modules[@]}"; do
    f=$(find "$work/kernel/lib/modules" -name "$m.ko" | head -n1)
    [ -n "$f" ] || { echo "guest-image: module $m.ko not in $kpkg" >&2; exit 1; }
    cp "$f" "$kdir/modules/"
  done
  touch "$kdir/.done"
fi

# Dependency order: every module's depends= must come earlier in the list.
seen=" "
for m in "${modules[@]}"; do
  deps=$(grep -a -o 'depends=[^[:cntrl:]]*' "$kdir/modules/$m.ko" | head -n1 | cut -d= -f2 | tr ',' ' ')
  for d in $deps; do
    case "$seen" in *" $d "*) ;; *) echo "guest-image: $m needs $d loaded first; fix the modules order" >&2; exit 1 ;; esac
  done
  seen="$seen$m "
done

# Initramfs tree.
root="$work/root"
mkdir -p "$root"/{bin,sbin,etc/acpi/PWRF,proc,sys,dev,tmp,www,lib/modules,var/run,var/log}
cp /bin/busybox "$root/bin/busybox"
for a in $("$root/bin/busybox" --list); do
  [ "$a" = busybox ] || ln -sf busybox "$root/bin/$a"
done
cp "$kdir"/modules/*.ko "$root/lib/modules/"
printf '%s\n' "${modules[@]}" > "$root/lib/modules/order"
install -m 0755 "$here/init" "$root/init"
install -m 0755 "$here/udhcpc.script" "$root/etc/udhcpc.script"
# busybox acpid runs ./PWRF/00000080 (relative to -c DIR) on the power button.
install -m 0755 "$here/poweroff.sh" "$root/etc/acpi/PWRF/00000080"
(cd "$repo" && CGO_ENABLED=0 GOOS=linux GOARCH=amd64 go build -trimpath -buildvcs=false -ldflags='-s -w' -o "$root/bin/echod" ./tests/guest/echod)
# Fixed mtimes and order: the same inputs give the same initramfs bytes.
find "$root" -exec touch -h -d @0 {} +
(cd "$root" && find . -mindepth 1 | LC_ALL=C sort | cpio --quiet --reproducible -o -H newc -R 0:0 | gzip -9n) > "$work/initramfs.cpio.gz"

cp "$kdir/vmlinuz" "$work/vmlinuz"
mv -f "$work/vmlinuz" "$out/vmlinuz"
mv -f "$work/initramfs.cpio.gz" "$out/initramfs.cpio.gz"
cat > "$out/env.tmp" <<ENV
GUEST_KERNEL=$out/vmlinuz
GUEST_KERNEL_SHA256=$(sha256sum "$out/vmlinuz" | cut -d' ' -f1)
GUEST_INITRAMFS=$out/initramfs.cpio.gz
GUEST_INITRAMFS_SHA256=$(sha256sum "$out/initramfs.cpio.gz" | cut -d' ' -f1)
GUEST_KERNEL_PACKAGE=$kpkg=$kver
ENV
mv -f "$out/env.tmp" "$out/env"
echo "$key" > "$out/key"
ls -l "$out/vmlinuz" "$out/initramfs.cpio.gz" | awk '{print "guest-image: " $NF " " $5 " bytes"}'
