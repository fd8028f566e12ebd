#!/usr/bin/env bash
# The C++ libraries the GPU machine lacks, carried there as Debian packages.
#
#   scripts/device-deps.sh download   here (a machine with Debian's package registry):
#                                     `apt-get download` the packages into .deps/
#   scripts/device-deps.sh unpack     there: `dpkg -x` each into /opt/deps (or $MOE_DEPS_ROOT)
#                                     and point the pkg-config files at that root
#
# Then configure with -DCMAKE_PREFIX_PATH=/opt/deps/usr and run with
# LD_LIBRARY_PATH=/opt/deps/usr/lib/x86_64-linux-gnu (scripts/gpu-check.sh does both).
# The GPU machine already has GoogleTest, CLI11 and OpenBLAS; nlohmann-json is seen missing,
# and nothing says it has the development files of PCRE2 or utf8proc, so those travel too
# (their runtime libraries with them). oneDNN is optional for the build and stays behind.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(
  nlohmann-json3-dev
  libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3
  libutf8proc-dev libutf8proc2
)
ROOT="${MOE_DEPS_ROOT:-/opt/deps}"

case "${1:-}" in
  download)
    mkdir -p .deps
    # .gitignore ignores /.deps/ already; the exclude keeps it out of `git status` in any clone.
    exclude="$(git rev-parse --git-path info/exclude)"
    mkdir -p "$(dirname "$exclude")"
    grep -qxF '/.deps/' "$exclude" 2>/dev/null || echo '/.deps/' >>"$exclude"
    rm -f .deps/*.deb
    (cd .deps && apt-get download "${PACKAGES[@]}")
    ls -l .deps
    ;;
  unpack)
    shopt -s nullglob
    debs=(.deps/*.deb)
    if [ ${#debs[@]} -eq 0 ]; then
      echo "device-deps: no packages in .deps/ (run '$0 download' here and carry .deps)" >&2
      exit 1
    fi
    mkdir -p "$ROOT"
    for deb in "${debs[@]}"; do dpkg -x "$deb" "$ROOT"; done
    # The .pc files say prefix=/usr; make them name the unpacked root instead.
    for pc in "$ROOT"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc "$ROOT"/usr/share/pkgconfig/*.pc; do
      [ -f "$pc" ] && sed -i "s|^prefix=/usr\$|prefix=$ROOT/usr|" "$pc"
    done
    echo "device-deps: unpacked ${#debs[@]} packages into $ROOT"
    ;;
  *)
    echo "usage: $0 download|unpack" >&2
    exit 2
    ;;
esac
