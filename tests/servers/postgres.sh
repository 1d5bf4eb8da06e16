#!/usr/bin/env bash
# A throwaway PostgreSQL cluster on loopback for the tests.
#
#   postgres.sh start   <state-dir>   initdb into <state-dir>, start on a free port,
#                                     write <state-dir>/conninfo (a libpq conninfo string)
#   postgres.sh stop    <state-dir>   stop it and delete <state-dir>
#   postgres.sh kill    <state-dir>   stop it abruptly (like a crash), keep the data
#   postgres.sh restart <state-dir>   start it again on the same port after kill
#
# PostgreSQL refuses to run as root; as root the server runs as the
# `postgres` system user that Debian's package creates.
set -euo pipefail
cmd=${1:?usage: postgres.sh start|stop|kill|restart <state-dir>}
dir=${2:?usage: postgres.sh start|stop|kill|restart <state-dir>}
bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
[ -x "$bindir/initdb" ] || { echo "postgres.sh: no PostgreSQL server found (apt-get install postgresql)" >&2; exit 1; }

as_server=()
if [ "$(id -u)" -eq 0 ]; then as_server=(runuser -u postgres --); fi

start_on() {
  local port=$1
  "${as_server[@]}" "$bindir/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c max_connections=200" start >/dev/null
}

case $cmd in
  start)
    "$0" stop "$dir" 2>/dev/null || true
    mkdir -p "$dir"
    chmod 755 "$dir"
    [ "$(id -u)" -eq 0 ] && chown postgres "$dir"
    "${as_server[@]}" "$bindir/initdb" -D "$dir/data" -U keel --auth=trust -E UTF8 --no-sync >"$dir/initdb.log" 2>&1 ||
      { cat "$dir/initdb.log" >&2; exit 1; }
    for _ in $(seq 1 30); do
      port=$((20000 + RANDOM % 40000))
      if start_on "$port"; then
        echo "$port" >"$dir/port"
        echo "host=127.0.0.1 port=$port user=keel dbname=postgres connect_timeout=5" >"$dir/conninfo"
        echo "postgres.sh: PostgreSQL up on 127.0.0.1:$port ($dir)"
        exit 0
      fi
    done
    echo "postgres.sh: could not start PostgreSQL; log:" >&2
    cat "$dir/server.log" >&2 || true
    exit 1
    ;;
  stop)
    [ -d "$dir/data" ] && "${as_server[@]}" "$bindir/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null 2>&1 || true
    rm -rf "$dir"
    ;;
  kill)
    "${as_server[@]}" "$bindir/pg_ctl" -D "$dir/data" -m immediate -w stop >/dev/null
    ;;
  restart)
    start_on "$(cat "$dir/port")"
    ;;
  *)
    echo "postgres.sh: unknown command $cmd" >&2
    exit 2
    ;;
esac
