#!/usr/bin/env bash
# PgBouncer in transaction pooling mode in front of the tests' PostgreSQL
# (tests/servers/postgres.sh), on loopback, for the pooler tests.
#
#   pgbouncer.sh start <state-dir> <postgres-state-dir>   start on a free port; write
#                                                         <state-dir>/port and <state-dir>/conninfo
#   pgbouncer.sh stop  <state-dir>                        stop it and delete <state-dir>
#
# pool_mode = transaction, auth_type = trust (loopback only), at most 20
# server connections per database and user. TCP only, so <state-dir> may be
# any path. PgBouncer refuses to run as root: as root it runs as `postgres`.
set -euo pipefail
usage="usage: pgbouncer.sh start <state-dir> <postgres-state-dir> | stop <state-dir>"
cmd=${1:?$usage}
dir=${2:?$usage}
command -v pgbouncer >/dev/null || { echo "pgbouncer.sh: pgbouncer not found (apt-get install pgbouncer)" >&2; exit 1; }
as_server=()
if [ "$(id -u)" -eq 0 ]; then as_server=(runuser -u postgres --); fi

case $cmd in
  start)
    pg=${3:?$usage}
    "$0" stop "$dir" 2>/dev/null || true
    mkdir -p "$dir"
    run=$(mktemp -d "${TMPDIR:-/tmp}/keel-pgbouncer.XXXXXX")
    echo "$run" >"$dir/run"
    pgport=$(cat "$pg/port")
    echo '"keel" ""' >"$run/users.txt"
    for _ in $(seq 1 30); do
      port=$((20000 + RANDOM % 40000))
      cat >"$run/pgbouncer.ini" <<EOF
[databases]
postgres = host=127.0.0.1 port=$pgport dbname=postgres user=keel
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $port
unix_socket_dir =
auth_type = trust
auth_file = $run/users.txt
pool_mode = transaction
max_client_conn = 400
default_pool_size = 20
logfile = $run/pgbouncer.log
pidfile = $run/pgbouncer.pid
EOF
      [ "$(id -u)" -eq 0 ] && chown -R postgres "$run"
      if "${as_server[@]}" pgbouncer -d "$run/pgbouncer.ini" >"$run/start.out" 2>&1; then
        for _ in $(seq 1 200); do
          if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            echo "$port" >"$dir/port"
            echo "host=127.0.0.1 port=$port user=keel dbname=postgres connect_timeout=5" >"$dir/conninfo"
            echo "pgbouncer.sh: PgBouncer (transaction pooling) on 127.0.0.1:$port in front of 127.0.0.1:$pgport"
            exit 0
          fi
          sleep 0.05
        done
      fi
      grep -q "Address already in use" "$run/pgbouncer.log" "$run/start.out" 2>/dev/null && continue
      echo "pgbouncer.sh: PgBouncer did not start:" >&2
      sed 's/^/  | /' "$run/start.out" "$run/pgbouncer.log" >&2 2>/dev/null || true
      exit 1
    done
    echo "pgbouncer.sh: 30 random ports were all taken" >&2
    exit 1
    ;;
  stop)
    run=$(cat "$dir/run" 2>/dev/null) || true
    if [ -n "$run" ] && [ -f "$run/pgbouncer.pid" ]; then
      pid=$(cat "$run/pgbouncer.pid")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.05; done
    fi
    case $run in */keel-pgbouncer.*) rm -rf "$run" ;; esac  # only what start made
    rm -rf "$dir"
    ;;
  *)
    echo "$usage" >&2
    exit 2
    ;;
esac
