#!/usr/bin/env bash
# Installs what moeinfer needs to build and test on Debian 12: the compiler and build tools,
# the C++ libraries (Debian packages), and the Python packages the tests compare against.
set -euo pipefail
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
# python3-dev, python3-venv: `pip install .` builds the Python module (nanobind needs Python's
# headers) into a virtual environment (Debian's own Python refuses pip installs outside one).
# ocl-icd-opencl-dev: Debian's oneDNN CMake config (dnnl-config.cmake) calls find_package(OpenCL),
# and configuring stops without it. ca-certificates: pip's HTTPS to the package index.
# libopenmpi-dev, openmpi-bin: the MPI communicator of expert parallelism (CPU ranks, several
# hosts) and the mpirun its tests launch. iproute2: `ip netns`, the two namespaces ("hosts") that
# an expert-parallel test runs its ranks in.
$SUDO apt-get install -y -q --no-install-recommends \
  build-essential cmake ninja-build pkg-config git ca-certificates python3 python3-pip \
  python3-dev python3-venv \
  clang libclang-rt-14-dev \
  nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev libbenchmark-dev \
  libopenblas-dev libdnnl-dev ocl-icd-opencl-dev libpcre2-dev libutf8proc-dev \
  libcpp-httplib-dev libopenmpi-dev openmpi-bin iproute2 \
  chromium
# Reference libraries for the differential tests (tokenizers, tiktoken, jinja2) and the fixture
# reader.
PIP_FLAGS="--quiet --disable-pip-version-check"
if python3 -m pip install $PIP_FLAGS --help 2>/dev/null | grep -q -- --break-system-packages; then
  PIP_FLAGS="$PIP_FLAGS --break-system-packages"
fi
python3 -m pip install $PIP_FLAGS "tokenizers>=0.20" "tiktoken>=0.7" "jinja2>=3.1" numpy openai \
  jsonschema
