#!/bin/bash
# Assembles kpr's image root file system from this (Debian) machine's packages: the agent, and
# what IPVS mode, the init container and operators call — busybox (sh, mount, sysctl, grep),
# kmod's modprobe, iptables (legacy and nft), ipset, nft, ipvsadm — with exactly the shared
# libraries they load. No package manager, no shell profile, nothing else.
#   deploy/image/rootfs.sh OUT_DIR PATH_TO_KPR
# Needs: busybox-static kmod iptables ipset nftables ipvsadm (cargo xtask image installs them).
set -euo pipefail
out=$1
kpr=$2
rm -rf "$out"
# Merged /usr, as Debian's: the libraries' recorded paths (/lib64/ld-linux...) resolve.
mkdir -p "$out"/usr/{bin,sbin,lib,lib64,local/bin} "$out"/{etc/kpr,proc,sys,dev,run,tmp,var}
for d in bin sbin lib lib64; do ln -s "usr/$d" "$out/$d"; done
ln -s ../run "$out/var/run"
mkdir -p "$out/lib/modules"
chmod 1777 "$out/tmp"

# Without its debug information (the release profile keeps it for profiling).
install -m 0755 -s "$kpr" "$out/usr/local/bin/kpr"
install -m 0755 /bin/busybox "$out/bin/busybox"
for applet in sh ash mount umount sysctl grep cat ls echo sleep; do ln -sf busybox "$out/bin/$applet"; done

copy() { # a file, at the same path
  mkdir -p "$out$(dirname "$1")"
  cp -a "$1" "$out$1"
  if [ -L "$1" ]; then copy "$(readlink -f "$1")"; fi
}
elfs=()
for b in /usr/bin/kmod /usr/sbin/xtables-legacy-multi /usr/sbin/xtables-nft-multi /usr/sbin/ipset /usr/sbin/nft /usr/sbin/ipvsadm; do
  copy "$b"
  elfs+=("$b")
done
ln -sf ../bin/kmod "$out/usr/sbin/modprobe"
for v in iptables ip6tables; do
  for suffix in "" -save -restore; do
    ln -sf xtables-legacy-multi "$out/usr/sbin/$v-legacy$suffix"
    ln -sf xtables-nft-multi "$out/usr/sbin/$v-nft$suffix"
    # Debian's default front end is nft, as on most current nodes.
    ln -sf "$v-nft$suffix" "$out/usr/sbin/$v$suffix"
  done
done
xt=$(dirname "$(ls /usr/lib/*/xtables/libxt_standard.so)")
mkdir -p "$out$xt"
cp -a "$xt"/. "$out$xt"/
elfs+=("$xt"/*.so "$kpr")
# The shared libraries every ELF above loads, and the loader.
for lib in $(ldd "${elfs[@]}" 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// && $1 !~ /:$/ {print $1}' | sort -u); do
  copy "$lib"
done
for f in /etc/protocols /etc/ethertypes /etc/services; do
  [ -e "$f" ] && copy "$f"
done
printf 'root:x:0:0:root:/:/bin/sh\n' > "$out/etc/passwd"
printf 'root:x:0:\n' > "$out/etc/group"
echo "rootfs: $(du -sh "$out" | cut -f1) in $out"
