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
# cpp-httplib for `moeinfer serve` / `bench-serve` there, kept in a root of its own (.deps/http,
# unpacked to $ROOT-http) so that the main build does not depend on it working: its pkg-config
# file names OpenSSL, zlib and Brotli as private requirements, which the GPU machine has as
# runtime libraries only, so `unpack` drops that line (the shared library links them itself);
# their headers travel (the header is compiled with SSL, zlib and Brotli support).
HTTP_PACKAGES=(libcpp-httplib-dev libcpp-httplib0.11 libbrotli1 libbrotli-dev libssl-dev zlib1g-dev)

case "${1:-}" in
  download)
    mkdir -p .deps
    # .gitignore ignores /.deps/ already; the exclude keeps it out of `git status` in any clone.
    exclude="$(git rev-parse --git-path info/exclude)"
    mkdir -p "$(dirname "$exclude")"
    grep -qxF '/.deps/' "$exclude" 2>/dev/null || echo '/.deps/' >>"$exclude"
    rm -f .deps/*.deb
    (cd .deps && apt-get download "${PACKAGES[@]}")
    mkdir -p .deps/http
    rm -f .deps/http/*.deb
    (cd .deps/http && apt-get download "${HTTP_PACKAGES[@]}")
    ls -l .deps .deps/http
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
    http_debs=(.deps/http/*.deb)
    if [ ${#http_debs[@]} -gt 0 ]; then
      mkdir -p "$ROOT-http"
      for deb in "${http_debs[@]}"; do dpkg -x "$deb" "$ROOT-http"; done
      for pc in "$ROOT-http"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc; do
        [ -f "$pc" ] && sed -i -e "s|^prefix=/usr\$|prefix=$ROOT-http/usr|" -e '/^Requires.private:/d' "$pc"
      done
      echo "device-deps: unpacked ${#http_debs[@]} HTTP packages into $ROOT-http"
    fi
    ;;
  *)
    echo "usage: $0 download|unpack" >&2
    exit 2
    ;;
esac
