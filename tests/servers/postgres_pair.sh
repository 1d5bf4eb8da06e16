#!/usr/bin/env bash
# A PostgreSQL primary and a streaming-replication standby on loopback, for
# the failover tests (tests/failover_postgres_test.cpp), which start and stop
# it themselves.
#
#   postgres_pair.sh start <state-dir> sync|async
#       initdb the primary, start it, pg_basebackup the standby
#       (primary_conninfo, standby.signal), start it and wait until it
#       streams; sync: synchronous_standby_names names the standby, so a
#       commit returns only once the standby has flushed it. Writes
#       <state-dir>/conninfo, a multi-host libpq string
#       (host=127.0.0.1,127.0.0.1 port=P,S target_session_attrs=read-write),
#       and <state-dir>/{primary,standby}/port
#   postgres_pair.sh cut-link <state-dir>
#       the primary refuses replication connections from now on (pg_hba,
#       reloaded) and its walsender is terminated: the standby keeps what it
#       has and receives nothing more. (A SIGSTOPped standby would still get
#       the stream into its socket buffer and apply it on SIGCONT.)
#   postgres_pair.sh kill-primary <state-dir>
#       SIGKILL the primary's postmaster and every process it started (a
#       crash of the host, as far as the standby can tell)
#   postgres_pair.sh stop-standby <state-dir>
#       stop the standby at once (immediate mode), keep its data
#   postgres_pair.sh promote <state-dir>
#       pg_ctl promote the standby and wait until it accepts writes
#   postgres_pair.sh stop <state-dir>
#       stop both and delete their data and <state-dir>
#
# As root the servers run as the `postgres` user (PostgreSQL refuses root);
# data lives in a mktemp directory named in <state-dir>/run (TCP only, so
# <state-dir> may be any path).
set -euo pipefail
usage="usage: postgres_pair.sh start|cut-link|kill-primary|stop-standby|promote|stop <state-dir> [sync|async]"
cmd=${1:?$usage}
dir=${2:?$usage}
bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
[ -x "$bindir/initdb" ] || { echo "postgres_pair.sh: no PostgreSQL server found (apt-get install postgresql)" >&2; exit 1; }

as_server=()
if [ "$(id -u)" -eq 0 ]; then as_server=(runuser -u postgres --); fi
run_dir() { cat "$dir/run"; }
psql_at() { "${as_server[@]}" "$bindir/psql" -X -q -A -t -h 127.0.0.1 -p "$1" -U keel -d postgres -c "$2"; }

# free_port: a port nothing listens on now (the server's start says if it was taken meanwhile).
free_port() {
  # Below the ephemeral range where it leaves room: a port some client's
  # outgoing connection uses (the workers make many) cannot be bound either.
  local p low span
  low=$(cut -f1 /proc/sys/net/ipv4/ip_local_port_range 2>/dev/null || echo 32768)
  span=$((low - 20000))
  [ "$span" -ge 2000 ] || span=40000
  for _ in $(seq 1 50); do
    p=$((20000 + RANDOM % span))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then echo "$p"; return 0; fi
  done
  return 1
}

# start_node <name>: on a free port, written to <state-dir>/<name>/port; a
# port taken between the check and the bind (another test's server) is
# retried on another.
start_node() {
  local run port
  run=$(run_dir)
  for _ in $(seq 1 10); do
    port=$(free_port)
    rm -f "$run/$1.log"  # pg_ctl (the server user) makes it again
    if "${as_server[@]}" "$bindir/pg_ctl" -D "$run/$1" -l "$run/$1.log" -w -t 60 \
      -o "-p $port -c listen_addresses=127.0.0.1 -c unix_socket_directories='' -c max_connections=200" \
      start >"$run/$1.pg_ctl.out" 2>&1; then
      echo "$port" >"$dir/$1/port"
      return 0
    fi
    grep -q "Address already in use" "$run/$1.log" || break
  done
  echo "postgres_pair.sh: the $1 did not start:" >&2
  sed 's/^/  | /' "$run/$1.log" "$run/$1.pg_ctl.out" >&2 || true
  return 1
}

case $cmd in
  start)
    mode=${3:?$usage}
    case $mode in sync | async) ;; *) echo "$usage" >&2; exit 2 ;; esac
    "$0" stop "$dir" 2>/dev/null || true
    mkdir -p "$dir/primary" "$dir/standby"
    run=$(mktemp -d "${TMPDIR:-/tmp}/keel-pgpair.XXXXXX")
    echo "$run" >"$dir/run"
    [ "$(id -u)" -eq 0 ] && chown postgres "$run"
    "${as_server[@]}" "$bindir/initdb" -D "$run/primary" -U keel --auth=trust -E UTF8 --no-sync >"$run/initdb.log" 2>&1 ||
      { echo "postgres_pair.sh: initdb failed:" >&2; cat "$run/initdb.log" >&2; exit 1; }
    {
      echo "wal_level = replica"
      echo "max_wal_senders = 4"
      echo "wal_keep_size = 256MB"
      echo "fsync = off"  # a crash of the process, not of the machine: the OS keeps what was written
      if [ "$mode" = sync ]; then echo "synchronous_standby_names = 'keel_standby'"; fi
    } >>"$run/primary/postgresql.conf"
    start_node primary
    pport=$(cat "$dir/primary/port")
    "${as_server[@]}" "$bindir/pg_basebackup" -h 127.0.0.1 -p "$pport" -U keel -D "$run/standby" -X stream \
      --no-sync >"$run/basebackup.log" 2>&1 ||
      { echo "postgres_pair.sh: pg_basebackup failed:" >&2; cat "$run/basebackup.log" >&2; exit 1; }
    touch "$run/standby/standby.signal"
    [ "$(id -u)" -eq 0 ] && chown postgres "$run/standby/standby.signal"
    {
      echo "primary_conninfo = 'host=127.0.0.1 port=$pport user=keel application_name=keel_standby'"
      echo "wal_retrieve_retry_interval = 200ms"
      echo "synchronous_standby_names = ''"  # once promoted it stands alone
    } >>"$run/standby/postgresql.auto.conf"
    start_node standby
    sport=$(cat "$dir/standby/port")
    # Streaming (and, for sync, named as the synchronous standby) before we say up.
    want=async
    [ "$mode" = sync ] && want=sync
    for _ in $(seq 1 600); do
      st=$(psql_at "$pport" "SELECT sync_state FROM pg_stat_replication WHERE application_name = 'keel_standby' AND state = 'streaming'" 2>/dev/null || true)
      [ "$st" = "$want" ] && break
      sleep 0.05
    done
    [ "$st" = "$want" ] || { echo "postgres_pair.sh: the standby is not streaming ($want) after 30 s" >&2; exit 1; }
    echo "host=127.0.0.1,127.0.0.1 port=$pport,$sport user=keel dbname=postgres connect_timeout=2 target_session_attrs=read-write" >"$dir/conninfo"
    echo "postgres_pair.sh: primary on 127.0.0.1:$pport, $mode standby on 127.0.0.1:$sport (data in $run)"
    ;;
  cut-link)
    run=$(run_dir)
    pport=$(cat "$dir/primary/port")
    # First match wins: a reject line at the top shuts out replication.
    { echo "host replication all all reject"; cat "$run/primary/pg_hba.conf"; } >"$run/pg_hba.new"
    cat "$run/pg_hba.new" >"$run/primary/pg_hba.conf"
    psql_at "$pport" "SELECT pg_reload_conf()" >/dev/null
    # The reload is asynchronous: terminate until no walsender is left (a
    # reconnection made before the reload took effect is terminated too).
    for _ in $(seq 1 200); do
      n=$(psql_at "$pport" "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_replication")
      sleep 0.05
      [ "$n" = 0 ] && [ "$(psql_at "$pport" "SELECT count(*) FROM pg_stat_replication")" = 0 ] && exit 0
    done
    echo "postgres_pair.sh: the walsender kept coming back" >&2
    exit 1
    ;;
  kill-primary)
    run=$(run_dir)
    pid=$(head -n 1 "$run/primary/postmaster.pid")
    kids=$(pgrep -P "$pid" || true)
    # shellcheck disable=SC2086
    kill -9 "$pid" $kids 2>/dev/null || true
    for _ in $(seq 1 400); do
      alive=0
      for p in $pid $kids; do kill -0 "$p" 2>/dev/null && alive=1; done
      [ "$alive" = 0 ] && exit 0
      sleep 0.02
    done
    echo "postgres_pair.sh: the primary's processes outlived SIGKILL" >&2
    exit 1
    ;;
  stop-standby)
    "${as_server[@]}" "$bindir/pg_ctl" -D "$(run_dir)/standby" -m immediate -w stop >/dev/null
    ;;
  promote)
    run=$(run_dir)
    sport=$(cat "$dir/standby/port")
    "${as_server[@]}" "$bindir/pg_ctl" -D "$run/standby" -w -t 60 promote >/dev/null
    for _ in $(seq 1 600); do
      [ "$(psql_at "$sport" "SELECT pg_is_in_recovery()" 2>/dev/null || true)" = f ] && exit 0
      sleep 0.05
    done
    echo "postgres_pair.sh: the standby still in recovery 30 s after promote" >&2
    exit 1
    ;;
  stop)
    run=$(cat "$dir/run" 2>/dev/null) || true
    for node in primary standby; do
      [ -n "$run" ] && [ -d "$run/$node" ] &&
        "${as_server[@]}" "$bindir/pg_ctl" -D "$run/$node" -m immediate -w stop >/dev/null 2>&1 || true
    done
    case $run in */keel-pgpair.*) rm -rf "$run" ;; esac  # only what start made
    rm -rf "$dir"
    ;;
  *)
    echo "$usage" >&2
    exit 2
    ;;
esac
