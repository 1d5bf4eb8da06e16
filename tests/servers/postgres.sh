#!/usr/bin/env bash
# A throwaway PostgreSQL cluster on loopback for the tests.
#
#   postgres.sh start   <state-dir>   initdb, start on a free port,
#                                     write <state-dir>/conninfo (a libpq conninfo string)
#   postgres.sh stop    <state-dir>   stop it and delete its data and <state-dir>
#   postgres.sh kill    <state-dir>   stop it abruptly (like a crash), keep the data
#   postgres.sh restart <state-dir>   start it again on the same port after kill
#
# <state-dir> may be any path (a CI workspace's can be long): the server
# listens on TCP only (no Unix socket, whose path may not exceed 107 bytes),
# and its data and log live in a mktemp directory, named in <state-dir>/run
# and linked as <state-dir>/server.log. A start that fails says why at once;
# only a port that turns out taken is retried, on another port.
#
# PostgreSQL refuses to run as root; as root the server runs as the
# `postgres` system user that Debian's package creates (and the mktemp
# directory is its, since it may not reach into the state directory).
set -euo pipefail
cmd=${1:?usage: postgres.sh start|stop|kill|restart <state-dir>}
dir=${2:?usage: postgres.sh start|stop|kill|restart <state-dir>}
bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
[ -x "$bindir/initdb" ] || { echo "postgres.sh: no PostgreSQL server found (apt-get install postgresql)" >&2; exit 1; }

as_server=()
if [ "$(id -u)" -eq 0 ]; then as_server=(runuser -u postgres --); fi

run_dir() { cat "$dir/run" 2>/dev/null; }

# start_on <port>: 0 up, 2 the port is taken, 1 any other failure (its
# cause is in $run/attempt.log).
start_on() {
  local port=$1 run from
  run=$(run_dir) || { echo "postgres.sh: $dir/run is missing (was it started?)" >&2; return 1; }
  from=$(stat -c %s "$run/server.log" 2>/dev/null || echo 0)
  if "${as_server[@]}" "$bindir/pg_ctl" -D "$run/data" -l "$run/server.log" -w -t 60 \
    -o "-p $port -c listen_addresses=127.0.0.1 -c unix_socket_directories='' -c max_connections=200" \
    start >"$run/pg_ctl.out" 2>&1; then
    return 0
  fi
  { tail -c +"$((from + 1))" "$run/server.log" 2>/dev/null; cat "$run/pg_ctl.out"; } >"$run/attempt.log"
  grep -q "Address already in use" "$run/attempt.log" && return 2
  return 1
}

# Says why a start on <port> failed, in one line, then the attempt's log.
fail() {
  local port=$1 run why
  run=$(run_dir)
  if grep -q "Address already in use" "$run/attempt.log"; then
    why="127.0.0.1:$port is taken by another process"
  else
    why=$(grep -m 1 -E 'FATAL|PANIC' "$run/attempt.log" || echo 'see its output below')
  fi
  echo "postgres.sh: PostgreSQL did not start: $why" >&2
  sed 's/^/  | /' "$run/attempt.log" >&2
  exit 1
}

case $cmd in
  start)
    "$0" stop "$dir" 2>/dev/null || true
    mkdir -p "$dir"
    run=$(mktemp -d "${TMPDIR:-/tmp}/keel-postgres.XXXXXX")
    echo "$run" >"$dir/run"
    [ "$(id -u)" -eq 0 ] && chown postgres "$run"
    ln -sfn "$run/server.log" "$dir/server.log"
    "${as_server[@]}" "$bindir/initdb" -D "$run/data" -U keel --auth=trust -E UTF8 --no-sync >"$run/initdb.log" 2>&1 ||
      { echo "postgres.sh: initdb failed:" >&2; cat "$run/initdb.log" >&2; exit 1; }
    for _ in $(seq 1 30); do
      port=$((20000 + RANDOM % 40000))
      rc=0
      start_on "$port" || rc=$?
      if [ "$rc" -eq 0 ]; then
        echo "$port" >"$dir/port"
        echo "host=127.0.0.1 port=$port user=keel dbname=postgres connect_timeout=5" >"$dir/conninfo"
        echo "postgres.sh: PostgreSQL up on 127.0.0.1:$port (data in $run)"
        exit 0
      fi
      [ "$rc" -eq 2 ] || fail "$port"
    done
    echo "postgres.sh: 30 random ports were all taken; the last attempt:" >&2
    fail "$port"
    ;;
  stop)
    run=$(run_dir) || true
    # $dir/data: the layout before the mktemp directory.
    for data in ${run:+"$run/data"} "$dir/data"; do
      [ -d "$data" ] && "${as_server[@]}" "$bindir/pg_ctl" -D "$data" -m fast -w stop >/dev/null 2>&1 || true
    done
    case $run in */keel-postgres.*) rm -rf "$run" ;; esac  # only what start made
    rm -rf "$dir"
    ;;
  kill)
    "${as_server[@]}" "$bindir/pg_ctl" -D "$(run_dir)/data" -m immediate -w stop >/dev/null
    ;;
  restart)
    port=$(cat "$dir/port")
    start_on "$port" || fail "$port"
    ;;
  *)
    echo "postgres.sh: unknown command $cmd" >&2
    exit 2
    ;;
esac
