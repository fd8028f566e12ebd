#!/usr/bin/env bash
# Proves that a fresh Debian 12 machine needs nothing but the README. In a minbase Debian tree
# (debootstrap --variant=minbase) that is given only this machine's package-source and
# certificate settings, it runs as root, without CUDA, the README's build-and-generate command
# exactly as README.md spells it (scripts/install-deps.sh, cmake configure, cmake build,
# `moeinfer generate`, whose text must be the one the README shows), then the tests. A package
# that the build or the tests use and install-deps.sh does not install fails here, whatever
# this machine already has installed.
#
# The tests: the whole CPU suite, since it is the fast subset today (292 tests, about 100 s
# with -j2 on 2 cores, the slowest 62 s) and only its e2e tests use what install-deps.sh
# installs beyond the build (tokenizers, jinja2, numpy and openai from PyPI, Chromium).
# Each test is cut off at 300 s; MOE_FRESH_CTEST_ARGS narrows the set should it grow slow.
#
# What goes into the tree, read from this machine's files at run time (nothing of them is
# written into the repository):
#   - apt: /etc/apt/sources.list and sources.list.d/*.{list,sources}, the keyrings they name by
#     Signed-By where the tree lacks them, apt.conf and the apt.conf.d files that set proxies,
#     TLS or release-date checks, auth.conf(.d); /etc/resolv.conf to find the mirror;
#   - certificates: /usr/local/share/ca-certificates (where update-ca-certificates looks). No
#     package is installed before install-deps.sh: it installs ca-certificates (python3-pip
#     needs it too), whose set-up runs update-ca-certificates and so takes these in before pip
#     runs. Without them pip fails its certificate checks in the tree;
#   - pip: /etc/pip.conf, /root/.config/pip/pip.conf, /root/.pip/pip.conf (those that exist);
#   - environment: PIP_*, *_proxy, and the CA-bundle variables (SSL_CERT_FILE, SSL_CERT_DIR,
#     REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE) where set; everything else starts from `env -i`, with
#     a PATH that has no CUDA on it.
# The source is `git archive HEAD` of this checkout: what is committed, not the work tree.
#
# The debootstrap'd base is cached untouched as a tarball, $MOE_FRESH_CACHE (default
# /var/cache/moeinfer-ci)/<suite>-<arch>-minbase.tar, made before anything else goes into the
# tree and remade after 30 days; each run unpacks it into a new temporary root that an EXIT
# trap unmounts and removes, on failure too.
#
# Knobs (environment): MOE_FRESH_JOBS (build and test jobs, default 2), MOE_FRESH_CTEST_ARGS
# (more ctest arguments, e.g. "-LE e2e"; default none), MOE_FRESH_KEEP=1 (keep the tree for a
# look; its path is printed), MOE_FRESH_SUITE (default bookworm), MOE_FRESH_CACHE.
# Seen on a 2-core machine: debootstrap 45 s (once, then cached; unpacking the base 2 s),
# install-deps 109 s, configure 2 s, build 694 s, generate 1 s, 292 tests 98 s: 16 min in all
# (28 min with other builds running beside it, the build then 1317 s).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
suite="${MOE_FRESH_SUITE:-bookworm}"
cache_dir="${MOE_FRESH_CACHE:-/var/cache/moeinfer-ci}"
jobs="${MOE_FRESH_JOBS:-2}"
ctest_args="${MOE_FRESH_CTEST_ARGS-}"
keep="${MOE_FRESH_KEEP:-0}"
apt_opts=(-q -y -o DPkg::Lock::Timeout=600)

me="fresh-machine-check"
log() { echo "$me: $*"; }
die() { echo "$me: FAILED: $*" >&2; exit 1; }

timings=()
current_phase=""
phase_start=$SECONDS
total_start=$SECONDS
# phase NAME CMD...: runs CMD (errexit stays in force inside it), records how long it took; a
# failure ends the script through the EXIT trap, which names the phase.
phase() {
  current_phase="$1"
  phase_start=$SECONDS
  shift
  echo
  echo "== $me: $current_phase"
  "$@"
  timings+=("$(printf '%-14s %5d s' "$current_phase" $((SECONDS - phase_start)))")
  current_phase=""
}

# Unmounts everything mounted at or under DIR, deepest first.
unmount_under() {
  local dir="$1" m
  for m in $(awk -v d="$dir" '$2 == d || index($2, d "/") == 1 { print $2 }' /proc/mounts |
    sort -r); do
    umount "$m" 2>/dev/null || umount -l "$m" || true
  done
  if awk -v d="$dir" '$2 == d || index($2, d "/") == 1 { found = 1 } END { exit !found }' \
    /proc/mounts; then
    echo "$me: still mounted under $dir" >&2
    return 1
  fi
}

# Removes DIR once nothing is mounted under it, never crossing into another file system.
remove_tree() {
  local dir="$1"
  [ -d "$dir" ] || return 0
  if unmount_under "$dir"; then
    rm -rf --one-file-system "$dir"
  else
    echo "$me: $dir left in place" >&2
    return 1
  fi
}

root=""
base_tmp=""
cleanup() {
  local rc=$?
  set +e
  if [ -n "$current_phase" ]; then
    timings+=("$(printf '%-14s %5d s  FAILED' "$current_phase" $((SECONDS - phase_start)))")
  fi
  if [ -n "$base_tmp" ]; then remove_tree "$base_tmp"; fi
  if [ -n "$root" ]; then
    if [ "$keep" = 1 ]; then
      unmount_under "$root"
      log "kept the tree at $root (MOE_FRESH_KEEP=1)"
    else
      remove_tree "$root"
    fi
  fi
  echo
  echo "== $me: timings"
  printf '  %s\n' "${timings[@]}"
  printf '  %-14s %5d s\n' total $((SECONDS - total_start))
  if [ "$rc" = 0 ]; then
    log "PASSED: install-deps.sh, the README's build-and-generate command and the tests in a" \
      "fresh Debian $suite tree"
  elif [ -n "$current_phase" ]; then
    echo "$me: FAILED in phase '$current_phase' (status $rc): a fresh Debian $suite machine" \
      "that follows the README stops here; its output is above" >&2
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

[ "$(id -u)" = 0 ] || die "needs root (debootstrap, chroot and mounts); CI runs as root"
arch="$(dpkg --print-architecture)"

# ---- the host: debootstrap ----------------------------------------------------------------
host_tools() {
  if command -v debootstrap >/dev/null; then
    log "debootstrap is installed"
    return
  fi
  DEBIAN_FRONTEND=noninteractive apt-get update "${apt_opts[@]}"
  DEBIAN_FRONTEND=noninteractive apt-get install "${apt_opts[@]}" --no-install-recommends \
    debootstrap
}

# ---- where debootstrap fetches from: this machine's apt sources -----------------------------
# Prints "URI KEYRING" for each enabled `deb` source that serves SUITE's main component, from
# one-line *.list and deb822 *.sources files alike (KEYRING "-" where none is named).
find_mirror() {
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] || continue
    awk -v suite="$suite" '
      $1 == "deb" {
        keyring = "-"; i = 2
        if ($2 ~ /^\[/) {
          for (; i <= NF; i++) {
            if ($i ~ /signed-by=/) {
              k = $i; sub(/.*signed-by=/, "", k); sub(/\]$/, "", k); keyring = k
            }
            if ($i ~ /\]$/) break
          }
          i++
        }
        uri = $i; s = $(i + 1); main = 0
        for (j = i + 2; j <= NF; j++) if ($j == "main") main = 1
        if (s == suite && main) { print uri, keyring; exit }
      }' "$f"
  done
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] || continue
    awk -v suite="$suite" '
      function flush() {
        if (types ~ /(^| )deb( |$)/ && enabled != "no" && (" " suites " ") ~ (" " suite " ") &&
            (" " comps " ") ~ / main /) {
          split(uris, u, " "); print u[1], (keyring == "" ? "-" : keyring); done = 1; exit
        }
        types = uris = suites = comps = keyring = enabled = ""
      }
      /^[ \t]*#/ { next }
      /^[ \t]*$/ { flush(); next }
      /^[ \t]/ { next }
      {
        key = tolower($1); sub(/:$/, "", key); val = $0; sub(/^[^:]*:[ \t]*/, "", val)
        if (key == "types") types = val
        else if (key == "uris") uris = val
        else if (key == "suites") suites = val
        else if (key == "components") comps = val
        else if (key == "signed-by") keyring = val
        else if (key == "enabled") enabled = tolower(val)
      }
      END { if (!done) flush() }' "$f"
  done
}

# ---- the untouched base, cached ------------------------------------------------------------
base_tar="$cache_dir/$suite-$arch-minbase.tar"
make_base() {
  mkdir -p "$cache_dir"
  exec 9>"$cache_dir/.lock"
  flock 9
  if [ -f "$base_tar" ] && [ -z "$(find "$base_tar" -mtime +30)" ]; then
    log "cached base: $base_tar"
    exec 9>&-
    return
  fi
  local found mirror keyring proxy=""
  found="$(find_mirror | sed -n 1p)"
  [ -n "$found" ] || die "no enabled 'deb' source for $suite main in /etc/apt/sources.list*"
  read -r mirror keyring <<<"$found"
  # A proxy set for apt reaches debootstrap's wget through the environment.
  eval "$(apt-config shell proxy Acquire::http::Proxy)"
  if [ -n "$proxy" ] && [ -z "${http_proxy:-}" ]; then export http_proxy="$proxy"; fi
  local kr=()
  if [ "$keyring" != - ] && [ -f "$keyring" ]; then kr=(--keyring="$keyring"); fi
  log "debootstrap --variant=minbase $suite from this machine's apt source"
  base_tmp="$(mktemp -d "${TMPDIR:-/var/tmp}/moeinfer-base.XXXXXX")"
  debootstrap --variant=minbase --arch="$arch" "${kr[@]}" "$suite" "$base_tmp" "$mirror" \
    >"$base_tmp.log" 2>&1 || {
    tail -n 30 "$base_tmp.log" >&2
    rm -f "$base_tmp.log"
    die "debootstrap of $suite failed (log tail above)"
  }
  rm -f "$base_tmp.log"
  # Nothing has been put into the tree yet: this is the base exactly as debootstrap left it.
  unmount_under "$base_tmp"
  tar --numeric-owner -C "$base_tmp" -cf "$base_tar.partial" .
  mv -f "$base_tar.partial" "$base_tar"
  remove_tree "$base_tmp"
  base_tmp=""
  exec 9>&-
}

unpack_base() {
  root="$(mktemp -d "${TMPDIR:-/var/tmp}/moeinfer-fresh.XXXXXX")"
  tar --numeric-owner -C "$root" -xf "$base_tar"
  log "fresh root: $root"
}

# ---- this machine's package-source and certificate settings, and nothing else -------------
# apt.conf.d files that matter for reaching the mirror: proxies, TLS, release-date checks.
apt_net_settings='proxy|check-valid-until|check-date|::(cainfo|capath|verify-peer|verify-host|ssl)'
copy_settings() {
  local f k
  rm -f "$root"/etc/apt/sources.list "$root"/etc/apt/sources.list.d/*
  mkdir -p "$root/etc/apt/sources.list.d" "$root/etc/apt/apt.conf.d" "$root/etc/apt/auth.conf.d"
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
    /etc/apt/sources.list.d/*.sources; do
    if [ -f "$f" ]; then cp "$f" "$root$f"; fi
  done
  # Keyrings that the sources name and the base lacks (a local mirror's own key, say).
  for k in $(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
    /etc/apt/sources.list.d/*.sources 2>/dev/null |
    sed -n -e 's/.*signed-by=\([^] ]*\).*/\1/p' \
      -e 's/^Signed-By:[[:space:]]*\(\/[^[:space:]]*\)[[:space:]]*$/\1/p' | sort -u); do
    if [ -f "$k" ] && [ ! -e "$root$k" ]; then
      mkdir -p "$root$(dirname "$k")"
      cp "$k" "$root$k"
    fi
  done
  if [ -f /etc/apt/apt.conf ]; then cp /etc/apt/apt.conf "$root/etc/apt/"; fi
  for f in /etc/apt/apt.conf.d/*; do
    [ -f "$f" ] || continue
    if grep -qiE "$apt_net_settings" "$f"; then
      cp "$f" "$root/etc/apt/apt.conf.d/"
      log "apt setting: $(basename "$f")"
    fi
  done
  for f in /etc/apt/auth.conf /etc/apt/auth.conf.d/*; do
    if [ -f "$f" ]; then cp -p "$f" "$root$f"; fi
  done
  cp -L /etc/resolv.conf "$root/etc/resolv.conf"
  # A Debian machine has /etc/hosts from its installer; debootstrap's tree has none. Without it
  # the host's own name does not resolve, and Open MPI waits out a 5 s lookup at every start of
  # three ranks (the MPI tests took 10 s instead of 0.5 s in the tree).
  printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n::1\tlocalhost ip6-localhost ip6-loopback\n' \
    "$(hostname)" >"$root/etc/hosts"
  mkdir -p "$root/usr/local/share/ca-certificates"
  if [ -d /usr/local/share/ca-certificates ]; then
    cp -a /usr/local/share/ca-certificates/. "$root/usr/local/share/ca-certificates/"
  fi
  log "local CA certificates: $(find "$root/usr/local/share/ca-certificates" -name '*.crt' | wc -l)"
  for f in /etc/pip.conf /root/.config/pip/pip.conf /root/.pip/pip.conf; do
    if [ -f "$f" ]; then
      mkdir -p "$root$(dirname "$f")"
      cp "$f" "$root$f"
      log "pip configuration: $f"
    fi
  done
}

# The environment inside: a plain root PATH (no CUDA), the build's job count, and this
# machine's pip, proxy and CA-bundle variables. One that names a path the tree lacks (a local
# wheel folder, say) is left out: the tree gets settings, not this machine's files; paths under
# /etc/ssl are kept, since ca-certificates makes them there.
tree_env=()
make_tree_env() {
  local v
  tree_env=(PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
    CMAKE_BUILD_PARALLEL_LEVEL="$jobs")
  for v in $(compgen -e); do
    case "$v" in
      PIP_* | http_proxy | https_proxy | ftp_proxy | no_proxy | all_proxy | HTTP_PROXY | \
        HTTPS_PROXY | FTP_PROXY | NO_PROXY | ALL_PROXY | SSL_CERT_FILE | SSL_CERT_DIR | \
        REQUESTS_CA_BUNDLE | CURL_CA_BUNDLE) ;;
      *) continue ;;
    esac
    case "${!v}" in
      /etc/ssl/*) ;;
      /*)
        if [ ! -e "$root${!v}" ]; then
          log "environment: $v left out (names a path the tree lacks)"
          continue
        fi
        ;;
    esac
    tree_env+=("$v=${!v}")
  done
  log "environment: ${tree_env[*]%%=*}"
}

copy_source() {
  if [ -n "$(git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    log "note: the work tree has uncommitted changes; the check runs HEAD without them"
  fi
  mkdir -p "$root/root/moeinfer"
  git -C "$repo" archive --format=tar HEAD | tar -C "$root/root/moeinfer" -x
  log "source: $(git -C "$repo" rev-parse --short HEAD)"
}

mount_tree() {
  mount -t proc proc "$root/proc"
  mount -t sysfs sysfs "$root/sys"
  mount --bind /dev "$root/dev"
}

# in_tree CMD: runs CMD with bash as root in the tree, in the source folder.
in_tree() {
  chroot "$root" /usr/bin/env -i "${tree_env[@]}" /bin/bash -c "cd /root/moeinfer && $1"
}

# ---- the run ---------------------------------------------------------------------------------
phase host-tools host_tools
phase base make_base
phase unpack unpack_base
phase settings copy_settings
make_tree_env
phase source copy_source
mount_tree
[ ! -e "$root/usr/local/cuda" ] || die "the tree has /usr/local/cuda"

readme="$root/root/moeinfer/README.md"
readme_cmd="$(grep -m1 -E '^ +bash scripts/install-deps.sh && .*moeinfer generate' "$readme" |
  sed 's/^ *//')" || true
[ -n "$readme_cmd" ] || die "README.md has no 'bash scripts/install-deps.sh && ... generate' line"
expected="$(awk '/prints, greedily:/ { on = 1; next } on && NF { sub(/^ +/, ""); print; exit }' \
  "$readme")"
[ -n "$expected" ] || die "README.md shows no generated text after 'prints, greedily:'"
log "the README's command: $readme_cmd"

# generate_text CMD: runs CMD in the tree and keeps what it printed.
generated=""
generate_text() {
  generated="$(in_tree "$1")"
  printf '%s\n' "$generated"
}

# The README's command, part by part (its parts are joined by &&), each timed on its own.
mapfile -t parts < <(printf '%s\n' "$readme_cmd" | sed 's/ && /\n/g')
for part in "${parts[@]}"; do
  case "$part" in
    *install-deps.sh*) phase install-deps in_tree "$part" ;;
    "cmake -S "*) phase configure in_tree "$part" ;;
    "cmake --build "*) phase build in_tree "$part" ;;
    *" generate "*) phase generate generate_text "$part" ;;
    *) phase "$(echo "$part" | cut -c1-14)" in_tree "$part" ;;
  esac
done
case "$generated" in
  *"$expected"*) log "generate printed the README's text ('$expected')" ;;
  *) die "generate did not print the README's text '$expected'" ;;
esac

phase tests in_tree "ctest --test-dir build --output-on-failure --no-tests=error --timeout 300 \
  -j$jobs $ctest_args"
