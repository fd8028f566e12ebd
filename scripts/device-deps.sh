#!/usr/bin/env bash
# The C++ libraries the GPU machine lacks, carried there as Debian packages.
#
#   scripts/device-deps.sh download   here (a machine with Debian's package registry):
#                                     `apt-get download` the packages into .deps/
#   scripts/device-deps.sh unpack     there: `dpkg -x` each into /opt/deps (or $MOE_DEPS_ROOT)
#                                     and point the pkg-config files at that root
#   scripts/device-deps.sh mpi-env    there: the exports that run Open MPI from its root (below)
#
# Then configure with -DCMAKE_PREFIX_PATH=/opt/deps/usr and run with
# LD_LIBRARY_PATH=/opt/deps/usr/lib/x86_64-linux-gnu (scripts/gpu-check.sh does both).
# The GPU machine already has GoogleTest, CLI11 and OpenBLAS; nlohmann-json is seen missing,
# and nothing says it has the development files of PCRE2 or utf8proc, so those travel too
# (their runtime libraries with them). oneDNN is optional for the build and stays behind.
#
# Open MPI (mpirun, libmpi, mpi.h), for expert parallelism there (--ep N --device cuda and its
# test, test_cuda_expert_parallel): .deps/mpi, unpacked to $ROOT-mpi (/opt/deps-mpi). Debian's
# 4.1 packages with the runtime libraries a bare machine lacks (libevent, hwloc, PMIx, munge);
# the UCX, libfabric and verbs transports stay behind (the packages' own
# etc/openmpi/openmpi-mca-params.conf turns them off: ranks on one host talk through shared
# memory). dpkg -x does not run the packages' alternatives, so `unpack` links mpirun, mpiexec,
# mpicc and mpicxx to their .openmpi names. Open MPI finds its components, help texts and
# compiler-wrapper data from OPAL_PREFIX, PMIx from PMIX_PREFIX:
#
#   M=/opt/deps-mpi
#   export OPAL_PREFIX=$M/usr OPAL_SYSCONFDIR=$M/etc/openmpi
#   export PMIX_PREFIX=$M/usr/lib/x86_64-linux-gnu/pmix2
#   export PATH=$M/usr/bin:$PATH
#   export LD_LIBRARY_PATH=$M/usr/lib/x86_64-linux-gnu:$M/usr/lib/x86_64-linux-gnu/openmpi/lib:$LD_LIBRARY_PATH
#   export OMPI_MCA_mca_base_component_show_load_errors=0  # components of transports left behind
#   export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # the machine runs as root
#   cmake ... -DMPI_C_COMPILER=$M/usr/bin/mpicc   # (found on PATH too); then
#   mpirun -np 2 --oversubscribe build/tests/test_cuda_expert_parallel
#
# (`scripts/device-deps.sh mpi-env` prints those exports.) Should mpirun on one host complain
# that it finds no ssh or rsh, add `--mca plm isolated`; in a container that forbids ptrace
# between processes, `--mca btl_vader_single_copy_mechanism none`.
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
MPI_PACKAGES=(openmpi-bin openmpi-common libopenmpi3 libopenmpi-dev libevent-core-2.1-7
  libevent-pthreads-2.1-7 libhwloc15 libpmix2 libmunge2)
MPI_ROOT_DIR="$ROOT-mpi"

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
    mkdir -p .deps/mpi
    rm -f .deps/mpi/*.deb
    (cd .deps/mpi && apt-get download "${MPI_PACKAGES[@]}")
    ls -l .deps .deps/http .deps/mpi
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
    mpi_debs=(.deps/mpi/*.deb)
    if [ ${#mpi_debs[@]} -gt 0 ]; then
      mkdir -p "$MPI_ROOT_DIR"
      for deb in "${mpi_debs[@]}"; do dpkg -x "$deb" "$MPI_ROOT_DIR"; done
      # What Debian's alternatives would link (/usr/bin/mpirun -> mpirun.openmpi, ...).
      for tool in mpirun mpiexec mpicc mpicxx mpic++; do
        [ -e "$MPI_ROOT_DIR/usr/bin/$tool.openmpi" ] && ln -sfn "$tool.openmpi" "$MPI_ROOT_DIR/usr/bin/$tool"
      done
      for pc in "$MPI_ROOT_DIR"/usr/lib/x86_64-linux-gnu/pkgconfig/*.pc \
                "$MPI_ROOT_DIR"/usr/lib/x86_64-linux-gnu/openmpi/lib/pkgconfig/*.pc; do
        [ -f "$pc" ] && sed -i "s|^prefix=/usr\$|prefix=$MPI_ROOT_DIR/usr|" "$pc"
      done
      echo "device-deps: unpacked ${#mpi_debs[@]} Open MPI packages into $MPI_ROOT_DIR" \
           "(environment: $0 mpi-env)"
    fi
    ;;
  mpi-env)
    M="$MPI_ROOT_DIR"
    cat <<ENV
export OPAL_PREFIX=$M/usr OPAL_SYSCONFDIR=$M/etc/openmpi
export PMIX_PREFIX=$M/usr/lib/x86_64-linux-gnu/pmix2
export PATH=$M/usr/bin:\$PATH
export LD_LIBRARY_PATH=$M/usr/lib/x86_64-linux-gnu:$M/usr/lib/x86_64-linux-gnu/openmpi/lib:\${LD_LIBRARY_PATH:-}
export OMPI_MCA_mca_base_component_show_load_errors=0
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ENV
    ;;
  *)
    echo "usage: $0 download|unpack|mpi-env" >&2
    exit 2
    ;;
esac
