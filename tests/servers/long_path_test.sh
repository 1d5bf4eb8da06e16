#!/usr/bin/env bash
# The server fixtures from a state directory whose path is over 150 bytes, as
# a CI workspace's can be (a Unix socket's path may not exceed 107): start,
# answer, kill, restart with the data kept, stop and leave nothing behind.
# And a restart on a port something else holds fails at once, naming it.
#
#   long_path_test.sh <base-dir> [<scripts-dir>]   (default: this script's directory)
# shellcheck disable=SC2016  # the bash -c snippets take their paths as $1, $2
set -euo pipefail
base=${1:?usage: long_path_test.sh <base-dir> [<scripts-dir>]}
scripts=${2:-$(cd "$(dirname "$0")" && pwd)}

long=$base/this-directory-name-is-long-like-a-ci-workspace
while [ ${#long} -le 150 ]; do long=$long/and-longer-still-0123456789; done
squat=$base/squatter
failures=0
check() {  # check <what> <command...>
  local what=$1
  shift
  if "$@"; then echo "ok: $what"; else echo "FAILED: $what"; failures=$((failures + 1)); fi
}

squat_on() {  # a bare Redis holding 127.0.0.1:<port>
  mkdir -p "$squat"
  redis-server --port "$1" --bind 127.0.0.1 --dir "$squat" --daemonize yes --save "" --appendonly no \
    --pidfile "$squat/pid" --logfile "$squat/log" >/dev/null
  for _ in $(seq 1 100); do
    redis-cli -p "$1" ping 2>/dev/null | grep -q PONG && return 0
    sleep 0.05
  done
  return 1
}
unsquat() {
  if [ -f "$squat/pid" ]; then
    pid=$(cat "$squat/pid")
    kill "$pid" 2>/dev/null || true
    while st=$(ps -o stat= -p "$pid") && [[ $st != Z* ]]; do sleep 0.02; done  # gone or a zombie
  fi
  rm -rf "$squat"
}
cleanup() {
  unsquat
  "$scripts/postgres.sh" stop "$long/postgres" >/dev/null 2>&1 || true
  "$scripts/redis.sh" stop "$long/redis" >/dev/null 2>&1 || true
  rm -rf "$base"
}
trap cleanup EXIT
rm -rf "$base"
mkdir -p "$long"
echo "state directories under $long (${#long} bytes)"

# restart_refused <server>: with its port held by another process, a restart
# fails within 10 s and says the port is taken.
restart_refused() {
  local server=$1 port t0 rc=0
  port=$(cat "$long/$server/port")
  squat_on "$port" || { echo "could not hold port $port"; return 1; }
  t0=$(date +%s)
  "$scripts/$server.sh" restart "$long/$server" 2>"$base/restart.err" || rc=$?
  local took=$(($(date +%s) - t0))
  unsquat
  sed 's/^/    /' "$base/restart.err"
  [ "$rc" -ne 0 ] && [ "$took" -le 10 ] && grep -q "127.0.0.1:$port is taken" "$base/restart.err"
}

pg=$long/postgres
pg_query() { psql "$(cat "$pg/conninfo")" -Atc "$1" 2>&1; }
if "$scripts/postgres.sh" start "$pg"; then
  check "postgres answers" [ "$(pg_query 'select 40 + 2')" = 42 ]
  check "postgres keeps data over kill + restart" bash -c '
    psql "$(cat "$1/conninfo")" -qc "create table t(v int); insert into t values (7)" &&
    "$2/postgres.sh" kill "$1" && "$2/postgres.sh" restart "$1" >/dev/null &&
    [ "$(psql "$(cat "$1/conninfo")" -Atc "select v from t")" = 7 ]' _ "$pg" "$scripts"
  "$scripts/postgres.sh" kill "$pg"
  check "postgres restart on a taken port fails at once, saying so" restart_refused postgres
  check "postgres restarts once the port is free" "$scripts/postgres.sh" restart "$pg"
  run=$(cat "$pg/run" 2>/dev/null || echo "$pg")
  "$scripts/postgres.sh" stop "$pg"
  check "postgres stop removes the state and data directories" bash -c '[ ! -e "$1" ] && [ ! -e "$2" ]' _ "$pg" "$run"
else
  check "postgres starts" false
fi

rd=$long/redis
if "$scripts/redis.sh" start "$rd"; then
  check "redis answers" [ "$(redis-cli -p "$(cat "$rd/port")" ping)" = PONG ]
  check "redis keeps data over kill + restart" bash -c '
    redis-cli -p "$(cat "$1/port")" set k 7 >/dev/null &&
    "$2/redis.sh" kill "$1" && "$2/redis.sh" restart "$1" &&
    [ "$(redis-cli -p "$(cat "$1/port")" get k)" = 7 ]' _ "$rd" "$scripts"
  "$scripts/redis.sh" kill "$rd"
  check "redis restart on a taken port fails at once, saying so" restart_refused redis
  check "redis restarts once the port is free" "$scripts/redis.sh" restart "$rd"
  "$scripts/redis.sh" stop "$rd"
  check "redis stop removes the state directory" [ ! -e "$rd" ]
else
  check "redis starts" false
fi

[ "$failures" -eq 0 ] || { echo "long_path_test.sh: $failures check(s) failed"; exit 1; }
echo "long_path_test.sh: every check passed"
