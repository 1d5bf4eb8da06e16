#!/usr/bin/env bash
# A network namespace joined to the host by a veth pair, with a Redis inside
# it, for the partition tests (tests/failover_partition_test.cpp). Root only
# (ip netns). Traffic stays on the pair: 10.<a>.<b>.1 on the host's side,
# 10.<a>.<b>.2 inside, a /30 no other interface uses.
#
#   partition.sh start <state-dir> [postgres]
#                                    make the namespace and the pair, start Redis on
#                                    10.a.b.2:6379 inside (and PostgreSQL on 10.a.b.2:5432, data
#                                    in a mktemp directory); write <state-dir>/{ns,host_ip,ns_ip}
#   partition.sh cut   <state-dir>   nothing passes either way: a blackhole route to the other
#                                    end on each side (more specific than the pair's /30; taking
#                                    the link down instead would send the host's packets to its
#                                    default route, out of the namespaces the test made)
#   partition.sh heal  <state-dir>   the blackhole routes removed
#   partition.sh stop  <state-dir>   stop Redis, delete the namespace (its end of the pair goes with it)
set -euo pipefail
usage="usage: partition.sh start|cut|heal|stop <state-dir>"
cmd=${1:?$usage}
dir=${2:?$usage}
[ "$(id -u)" -eq 0 ] || { echo "partition.sh: network namespaces need root" >&2; exit 1; }
command -v ip >/dev/null || { echo "partition.sh: ip not found (apt-get install iproute2)" >&2; exit 1; }

case $cmd in
  start)
    "$0" stop "$dir" 2>/dev/null || true
    mkdir -p "$dir"
    id=$(( ($$ + RANDOM) % 60000 ))
    ns="keel-part-$id"
    host_if="kp$id"h
    ns_if="kp$id"n
    a=$(( 100 + id / 250 % 150 )); b=$(( id % 250 ))
    host_ip="10.$a.$b.1"; ns_ip="10.$a.$b.2"
    echo "$ns" >"$dir/ns"; echo "$host_if" >"$dir/host_if"
    echo "$host_ip" >"$dir/host_ip"; echo "$ns_ip" >"$dir/ns_ip"
    ip netns add "$ns"
    ip link add "$host_if" type veth peer name "$ns_if"
    ip link set "$ns_if" netns "$ns"
    ip addr add "$host_ip/30" dev "$host_if"
    ip link set "$host_if" up
    ip -n "$ns" addr add "$ns_ip/30" dev "$ns_if"
    ip -n "$ns" link set "$ns_if" up
    ip -n "$ns" link set lo up
    ip netns exec "$ns" redis-server --bind "$ns_ip" --port 6379 --dir "$dir" --daemonize yes \
      --pidfile "$dir/redis.pid" --logfile "$dir/redis.log" --save "" --appendonly no --protected-mode no >/dev/null
    if [ "${3:-}" = postgres ]; then
      bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
      run=$(mktemp -d "${TMPDIR:-/tmp}/keel-partpg.XXXXXX")
      echo "$run" >"$dir/pg_run"
      chown postgres "$run"
      runuser -u postgres -- "$bindir/initdb" -D "$run/data" -U keel --auth=trust -E UTF8 --no-sync >"$run/initdb.log" 2>&1 ||
        { echo "partition.sh: initdb failed" >&2; cat "$run/initdb.log" >&2; exit 1; }
      printf 'host all all %s/32 trust\nhost all all %s/32 trust\n' "$host_ip" "$ns_ip" >>"$run/data/pg_hba.conf"
      ip netns exec "$ns" runuser -u postgres -- "$bindir/pg_ctl" -D "$run/data" -l "$run/server.log" -w -t 60 \
        -o "-p 5432 -c listen_addresses=$ns_ip -c unix_socket_directories='' -c fsync=off" start >"$run/pg_ctl.out" 2>&1 ||
        { echo "partition.sh: PostgreSQL did not start" >&2; cat "$run/server.log" "$run/pg_ctl.out" >&2; exit 1; }
    fi
    for _ in $(seq 1 200); do
      redis-cli -h "$ns_ip" -p 6379 ping 2>/dev/null | grep -q PONG && {
        echo "partition.sh: Redis on $ns_ip:6379 in namespace $ns, host side $host_ip"
        exit 0
      }
      sleep 0.05
    done
    echo "partition.sh: Redis did not answer on $ns_ip:6379" >&2
    cat "$dir/redis.log" >&2 || true
    exit 1
    ;;
  cut)
    ip route add blackhole "$(cat "$dir/ns_ip")/32"
    ip -n "$(cat "$dir/ns")" route add blackhole "$(cat "$dir/host_ip")/32"
    ;;
  heal)
    ip route del blackhole "$(cat "$dir/ns_ip")/32" 2>/dev/null || true
    ip -n "$(cat "$dir/ns")" route del blackhole "$(cat "$dir/host_ip")/32" 2>/dev/null || true
    # Up once the host reaches the namespace again.
    for _ in $(seq 1 200); do
      redis-cli -h "$(cat "$dir/ns_ip")" -p 6379 ping 2>/dev/null | grep -q PONG && exit 0
      sleep 0.05
    done
    echo "partition.sh: the namespace is not reachable after heal" >&2
    exit 1
    ;;
  stop)
    if [ -f "$dir/ns_ip" ]; then ip route del blackhole "$(cat "$dir/ns_ip")/32" 2>/dev/null || true; fi
    if [ -f "$dir/pg_run" ]; then
      run=$(cat "$dir/pg_run")
      bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
      [ -d "$run/data" ] && runuser -u postgres -- "$bindir/pg_ctl" -D "$run/data" -m immediate -w stop >/dev/null 2>&1 || true
      case $run in */keel-partpg.*) rm -rf "$run" ;; esac
    fi
    if [ -f "$dir/redis.pid" ]; then kill "$(cat "$dir/redis.pid")" 2>/dev/null || true; fi
    if [ -f "$dir/ns" ]; then ip netns delete "$(cat "$dir/ns")" 2>/dev/null || true; fi
    if [ -f "$dir/host_if" ]; then ip link delete "$(cat "$dir/host_if")" 2>/dev/null || true; fi
    rm -rf "$dir"
    ;;
  *)
    echo "$usage" >&2
    exit 2
    ;;
esac
