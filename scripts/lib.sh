# Shared by scripts/demo and scripts/test: the Debian packages keel needs,
# installed when missing (as root) or named in one apt-get line (otherwise).

keel_packages=(
  cmake ninja-build g++ clang libclang-rt-14-dev pkg-config
  libabsl-dev libfmt-dev libssl-dev catch2 libbenchmark-dev
  libsqlite3-dev sqlite3
  libpq-dev postgresql pgbouncer
  libhiredis-dev redis-server
  libcpp-httplib-dev nlohmann-json3-dev libtomlplusplus-dev libboost1.74-dev
  libasio-dev libboost-context1.74-dev
  libcurl4-openssl-dev
  libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc
  python3 python3-prometheus-client
  prometheus
)

# What scripts/bench-gateway adds: nginx (the fixed upstream; -light has all
# it uses), wrk (requests/s at 32 connections), HAProxy (the one-hop floor)
# and node with npm (Portkey's gateway). The smoke test needs only the first two.
keel_bench_smoke_packages=(nginx-light wrk)
keel_bench_packages=(nginx-light wrk haproxy)

keel_missing_packages() {
  local p
  [ $# -gt 0 ] || set -- "${keel_packages[@]}"
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"
  done
}

# keel_ensure_packages [package...]: keel's list, or the packages named.
keel_ensure_packages() {
  local missing
  missing=$(keel_missing_packages "$@" | tr '\n' ' ')
  missing=${missing% }
  [ -z "$missing" ] && return 0
  if [ "$(id -u)" -ne 0 ]; then
    echo "keel needs these Debian packages, which are not installed:" >&2
    echo "  sudo apt-get install -y --no-install-recommends $missing" >&2
    echo "Run that line (or run this script as root), then run this script again." >&2
    exit 1
  fi
  echo "installing missing packages: $missing"
  export DEBIAN_FRONTEND=noninteractive
  # shellcheck disable=SC2086
  if ! apt-get install -y --no-install-recommends $missing; then
    apt-get update
    # shellcheck disable=SC2086
    apt-get install -y --no-install-recommends $missing
  fi
}

# keel_configure <build-dir> [extra cmake args...]
# Honours KEEL_CXX (compiler), KEEL_SANITIZE, KEEL_WERROR, KEEL_BUILD_TYPE.
keel_configure() {
  local dir=$1
  shift
  cmake -S "$keel_root" -B "$dir" -G Ninja \
    -DCMAKE_BUILD_TYPE="${KEEL_BUILD_TYPE:-RelWithDebInfo}" \
    -DCMAKE_CXX_COMPILER="${KEEL_CXX:-g++}" \
    -DKEEL_SANITIZE="${KEEL_SANITIZE:-}" \
    -DKEEL_WERROR="${KEEL_WERROR:-OFF}" \
    "$@"
}

keel_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
