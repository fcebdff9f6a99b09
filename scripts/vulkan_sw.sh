#!/usr/bin/env bash
# A software Vulkan device for a Debian/Ubuntu machine with no GPU: Mesa's lavapipe (device "llvmpipe"), the
# Vulkan loader, glslc and SPIR-V headers -- what `python3 build.py --vulkan` needs to build ggml-vulkan.
#
#   sudo scripts/vulkan_sw.sh [DEST]      # DEST: where newer headers go when needed (default /opt/kvcache-vulkan)
#
# Everything comes from the distribution's package registry. ggml-vulkan needs Vulkan-Hpp >= 1.3.268
# (vk::LayerSettingEXT); when the system's libvulkan-dev is older (Debian 12: 1.3.239; Ubuntu 22.04: 1.3.204), the
# next release's libvulkan-dev is fetched with `apt-get download` through a private apt configuration (its own
# sources list, package lists and cache under DEST; the system's apt sources, lists and installed packages are not
# touched), checked against the release's signed index as apt always does, and unpacked under DEST.
#
# Standard output is one line: the folder to pass to `build.py --vulkan --vulkan-headers` (or to put in
# $KVCACHE_VULKAN_HEADERS), empty when the system's headers suffice. Progress goes to standard error. Re-running is
# cheap: installed packages and unpacked headers are kept.
#
# ggml lists no CPU-type Vulkan device unless told to: run with GGML_VK_VISIBLE_DEVICES=0 to see llvmpipe as
# Vulkan0 (the project's Vulkan tests set it themselves).
set -euo pipefail

DEST=${1:-/opt/kvcache-vulkan}
NEED=LayerSettingEXT  # the newest Vulkan-Hpp name ggml-vulkan (ggml 0.9.x) uses
PKGS=(mesa-vulkan-drivers libvulkan1 libvulkan-dev glslc spirv-headers vulkan-tools)

log() { echo "[vulkan_sw] $*" >&2; }
die() { echo "vulkan_sw.sh: error: $*" >&2; exit 1; }

[[ $(id -u) == 0 ]] || die "run as root (it installs ${PKGS[*]} with apt-get)"
command -v apt-get >/dev/null || die "apt-get not found: this script knows Debian and Ubuntu only (elsewhere: the \
LunarG Vulkan SDK >= 1.3.268 and your distribution's Mesa lavapipe driver)"
. /etc/os-release
CODENAME=${VERSION_CODENAME:-}

missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
else
    log "installed already: ${PKGS[*]}"
fi

if grep -q "$NEED" /usr/include/vulkan/vulkan_structs.hpp 2>/dev/null; then
    log "the system's Vulkan headers have vk::$NEED: no extra headers needed"
    echo ""
    exit 0
fi
have=$(sed -n 's/^#define VK_HEADER_VERSION \([0-9]*\)$/\1/p' /usr/include/vulkan/vulkan_core.h)
log "the system's Vulkan headers (1.x.$have) lack vk::$NEED"

# the next release, from the same registry, for libvulkan-dev's headers only
case "$ID:$CODENAME" in
    debian:bookworm) SUITE="trixie"; MIRROR="http://deb.debian.org/debian"; COMP=main
                     KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg ;;
    ubuntu:jammy)    SUITE="noble"; MIRROR="http://archive.ubuntu.com/ubuntu"; COMP=main
                     KEYRING=/usr/share/keyrings/ubuntu-archive-keyring.gpg ;;
    *) die "no newer release known for $ID $CODENAME: install libvulkan-dev >= 1.3.268 (or the LunarG SDK) and \
pass its include folder to build.py --vulkan-headers" ;;
esac
[[ -f $KEYRING ]] || die "$KEYRING not found (the distribution's archive keyring verifies the download)"

APT="$DEST/apt"
mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$APT/sources.list.d" "$APT/preferences.d" "$DEST/debs"
echo "deb [signed-by=$KEYRING] $MIRROR $SUITE $COMP" > "$APT/sources.list"
OPTS=(-o "Dir::Etc::sourcelist=$APT/sources.list" -o "Dir::Etc::sourceparts=$APT/sources.list.d"
      -o "Dir::Etc::preferencesparts=$APT/preferences.d" -o "Dir::State::Lists=$APT/lists"
      -o "Dir::Cache=$APT/cache" -o "APT::Sandbox::User=root" -o "APT::Architecture=$(dpkg --print-architecture)")
ver=$(apt-cache "${OPTS[@]}" policy libvulkan-dev 2>/dev/null | sed -n 's/^ *Candidate: //p')
if [[ -z $ver || $ver == "(none)" || ! -d "$DEST/libvulkan-dev_$ver" ]]; then
    log "reading $SUITE's package list ($MIRROR) into $APT"
    apt-get "${OPTS[@]}" update -qq >&2
    ver=$(apt-cache "${OPTS[@]}" policy libvulkan-dev | sed -n 's/^ *Candidate: //p')
    [[ -n $ver && $ver != "(none)" ]] || die "no libvulkan-dev in $SUITE"
fi
OUT="$DEST/libvulkan-dev_$ver"
if ! grep -q "$NEED" "$OUT/usr/include/vulkan/vulkan_structs.hpp" 2>/dev/null; then
    log "downloading libvulkan-dev $ver from $SUITE"
    (cd "$DEST/debs" && apt-get "${OPTS[@]}" download "libvulkan-dev=$ver" >&2)
    rm -rf "$OUT.tmp" && mkdir -p "$OUT.tmp"
    dpkg-deb -x "$DEST/debs/libvulkan-dev_${ver//:/%3a}_"*.deb "$OUT.tmp"
    grep -q "$NEED" "$OUT.tmp/usr/include/vulkan/vulkan_structs.hpp" ||
        die "libvulkan-dev $ver from $SUITE has no vk::$NEED either"
    rm -rf "$OUT" && mv "$OUT.tmp" "$OUT"
fi
log "Vulkan headers $ver in $OUT/usr/include (pass it to build.py --vulkan --vulkan-headers)"
if command -v vulkaninfo >/dev/null; then
    dev=$(vulkaninfo --summary 2>/dev/null | sed -n 's/^\s*deviceName\s*=\s*//p' | paste -sd, -)
    log "Vulkan devices: ${dev:-none found}"
fi
echo "$OUT/usr/include"
