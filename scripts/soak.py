#!/usr/bin/env python3
"""The soak's driver (scripts/soak builds the gateway and starts Redis, then
runs this). It starts `gateway --serve` with the fleet's Redis and drives it
in cycles: normal load, a provider fault (slowdown, outage, rate limit,
stall, invalid output in turn) during which the Redis server is killed and
restarted, recovery, then idle. At the start and end of each cycle it reads
the gateway's RSS and open file descriptors from /proc, and at idle it
checks that every permit, in-flight and queue gauge is back at zero.
It prints a Markdown report: requests by outcome, p50/p99 per class, the
error budget, the per-cycle resources and the idle gauges.

Standard library only. Usage (normally through scripts/soak):
  soak.py --gateway PATH --redis-script tests/servers/redis.sh --redis-dir DIR
          [--minutes 10] [--cycle-seconds 60] [--rate 30] [--report FILE]
"""
import argparse
import itertools
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

FAULTS = ["slowdown", "outage", "rate_limit", "stall", "invalid_output"]


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Gateway:
    def __init__(self, binary, redis, data_dir):
        self.port = free_port()
        self.log = open(os.path.join(data_dir, "gateway.log"), "w")
        self.proc = subprocess.Popen([binary, "--serve", str(self.port), data_dir, "--redis", redis],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        end = time.time() + 30
        while time.time() < end:
            try:
                self.get("/healthz")
                return
            except OSError:
                if self.proc.poll() is not None:
                    sys.exit(f"soak: the gateway exited with {self.proc.returncode}; see {self.log.name}")
                time.sleep(0.1)
        sys.exit("soak: the gateway did not answer /healthz within 30 s")

    def request(self, method, path, body=None, key=None, timeout=10):
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Idempotency-Key"] = key
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def get(self, path):
        return self.request("GET", path)

    def resources(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            rss = int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1))
        fds = len(os.listdir(f"/proc/{self.proc.pid}/fd"))
        return rss, fds

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class Tally:
    """Outcomes and client-side latencies, by class."""

    def __init__(self):
        self.mu = threading.Lock()
        self.outcomes = {}   # (class, outcome) -> count
        self.latency = {}    # class -> [seconds]

    def add(self, cls, outcome, seconds):
        with self.mu:
            self.outcomes[(cls, outcome)] = self.outcomes.get((cls, outcome), 0) + 1
            self.latency.setdefault(cls, []).append(seconds)


def outcome_of(cls, status, body):
    if status == 0:
        return "transport_error"
    if status == 200 and cls == "recovery":
        return "ok"
    if status == 200:
        try:
            j = json.loads(body)
        except ValueError:
            return "bad_json"
        if j.get("replayed"):
            return "replayed"
        return "degraded" if j.get("degraded") else "full"
    if status == 202:
        return "queued"
    return str(status)


def driver(gw, tally, stop, rate, cls, seq):
    """One client thread: `rate` requests a second of class `cls`."""
    period = 1.0 / rate
    nxt = time.time()
    while not stop.is_set():
        n = next(seq)
        t0 = time.time()
        try:
            if cls == "recovery":  # operators and monitoring: the class that must always get through
                status, body = gw.get("/healthz" if n % 2 else "/metrics")
            elif cls == "batch":
                status, body = gw.request("POST", "/v1/batch", {"tenant": f"t{n % 8}", "learner": f"l{n % 50}",
                                                                "sessions": ["session one", "session two"]},
                                              key=f"soak-{n}")
            else:
                status, body = gw.request("POST", "/v1/feedback", {"tenant": f"t{n % 8}", "question_id": "q-timeouts",
                                                                   "answer": "one deadline, stages get what remains",
                                                                   "class": cls},
                                              key=f"soak-{n}")
        except OSError:
            status, body = 0, b""
        tally.add(cls, outcome_of(cls, status, body), time.time() - t0)
        nxt += period
        time.sleep(max(0.0, nxt - time.time()))


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


GAUGE_RE = re.compile(r"^# TYPE (\S+) gauge$", re.M)
IDLE_GAUGE = re.compile(r"in_flight|outstanding|active|queued|permits|held|depth")


def idle_gauges(gw):
    """Every gauge that should be zero at idle, with its value: from /healthz
    (bulkhead slots, the batch queue) and /metrics (in-flight, outstanding,
    permit gauges). Each of the two reads holds one slot of the recovery
    class while it runs (operator requests are that class): not counted."""
    out = {}
    _, h = gw.get("/healthz")
    health = json.loads(h)
    for name, pool in health.get("bulkheads", {}).items():
        out[f"bulkhead {name} active"] = pool["active"] - (1 if name == "recovery" else 0)
        out[f"bulkhead {name} queued"] = pool["queued"]
    q = health.get("batch_queue", {})
    out["batch_queue queued"] = q.get("queued", -1)
    out["batch_queue running"] = q.get("running", -1)
    _, m = gw.get("/metrics")
    text = m.decode()
    for fam in GAUGE_RE.findall(text):
        if not IDLE_GAUGE.search(fam):
            continue
        for line in text.splitlines():
            if line.startswith(fam + "{") or line.startswith(fam + " "):
                series, value = line.rsplit(" ", 1)
                own = 1 if series == 'gateway_bulkhead_active{class="recovery"}' else 0
                out[series] = float(value) - own
    return out, health


def await_idle(gw, limit):
    end = time.time() + limit
    while True:
        g, health = idle_gauges(gw)
        if all(v == 0 for v in g.values()) or time.time() > end:
            return g, health
        time.sleep(0.5)


def redis(script, state_dir, cmd):
    subprocess.run([script, cmd, state_dir], check=True, stdout=subprocess.DEVNULL)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gateway", required=True)
    ap.add_argument("--redis-script", required=True)
    ap.add_argument("--redis-dir", required=True)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--cycle-seconds", type=float, default=60)
    ap.add_argument("--rate", type=float, default=30, help="interactive requests a second")
    ap.add_argument("--report", default="")
    a = ap.parse_args()

    with open(os.path.join(a.redis_dir, "port")) as f:
        redis_addr = "127.0.0.1:" + f.read().strip()
    data_dir = tempfile.mkdtemp(prefix="keel-soak-")
    gw = Gateway(a.gateway, redis_addr, data_dir)
    cycles = max(1, int(a.minutes * 60 / a.cycle_seconds))
    L = a.cycle_seconds
    # Per cycle: normal 35%, fault 30% (Redis killed at its start, back at its middle), recovery 25%, idle 10%.
    phases = [("normal", 0.35), ("fault", 0.30), ("recovery", 0.25)]
    total = Tally()
    rows = []
    seq = itertools.count(1)  # next() on it is atomic; a generator shared by threads is not
    started = time.time()
    for c in range(cycles):
        fault = FAULTS[c % len(FAULTS)]
        rss0, fds0 = gw.resources()
        cyc = Tally()
        stop = threading.Event()

        class Both:
            def add(self, *args):
                cyc.add(*args)
                total.add(*args)

        both = Both()
        # 75% of the interactive rate from 3 threads, batch at a tenth, recovery at a twentieth.
        threads = [threading.Thread(target=driver, args=(gw, both, stop, a.rate / 4, "interactive", seq))
                   for _ in range(3)]
        threads.append(threading.Thread(target=driver, args=(gw, both, stop, a.rate / 10, "batch", seq)))
        threads.append(threading.Thread(target=driver, args=(gw, both, stop, a.rate / 20, "recovery", seq)))
        for t in threads:
            t.start()
        for name, share in phases:
            if name == "fault":
                gw.request("POST", "/admin/fault", {"kind": fault})
                redis(a.redis_script, a.redis_dir, "kill")
                time.sleep(L * share / 2)
                redis(a.redis_script, a.redis_dir, "restart")
                time.sleep(L * share / 2)
                gw.request("POST", "/admin/fault", {"kind": "none"})
            else:
                time.sleep(L * share)
        stop.set()
        for t in threads:
            t.join()
        gauges, health = await_idle(gw, max(5.0, L * 0.10 + 30))
        rss1, fds1 = gw.resources()
        nonzero = {k: v for k, v in gauges.items() if v != 0}
        rows.append({"cycle": c + 1, "fault": fault, "tally": cyc, "rss": (rss0, rss1), "fds": (fds0, fds1),
                     "nonzero": nonzero, "gauges": len(gauges), "slo": health.get("slo", {})})
        print(f"cycle {c + 1}/{cycles} ({fault}): {sum(cyc.outcomes.values())} requests, "
              f"RSS {rss0}->{rss1} kB, fds {fds0}->{fds1}, idle gauges not zero: {nonzero or 'none'}", flush=True)
    elapsed = time.time() - started
    _, health = await_idle(gw, 5)
    gw.stop()

    out = []
    out.append(f"### Soak: {cycles} cycles of {L:.0f} s ({elapsed / 60:.1f} min), "
               f"{a.rate:.0f} interactive requests/s")
    out.append("")
    out.append("Requests by class and outcome (client side):")
    out.append("")
    classes = sorted({k[0] for k in total.outcomes})
    kinds = sorted({k[1] for k in total.outcomes})
    out.append("| class | " + " | ".join(kinds) + " | p50 ms | p99 ms |")
    out.append("|---|" + "---|" * (len(kinds) + 2))
    for cls in classes:
        lat = total.latency.get(cls, [])
        out.append(f"| {cls} | " + " | ".join(str(total.outcomes.get((cls, k), 0)) for k in kinds) +
                   f" | {pct(lat, 0.5) * 1000:.0f} | {pct(lat, 0.99) * 1000:.0f} |")
    out.append("")
    out.append("Per cycle: the fault injected (Redis killed and restarted in the same phase), interactive p99, "
               "RSS and open fds at the cycle's start and end, gauges not back at zero at idle:")
    out.append("")
    out.append("| cycle | fault | requests | interactive p99 ms | RSS kB start → end | fds start → end "
               "| idle gauges not zero |")
    out.append("|---|---|---|---|---|---|---|")
    for r in rows:
        t = r["tally"]
        nonzero = ", ".join(f"{k}={v:g}" for k, v in r["nonzero"].items()) or f"none of {r['gauges']}"
        out.append(f"| {r['cycle']} | {r['fault']} | {sum(t.outcomes.values())} | "
                   f"{pct(t.latency.get('interactive', []), 0.99) * 1000:.0f} | {r['rss'][0]} → {r['rss'][1]} | "
                   f"{r['fds'][0]} → {r['fds'][1]} | {nonzero} |")
    out.append("")
    out.append("Error budget at the end (the gateway's /healthz, over its SLO window):")
    out.append("")
    out.append("| class | target | allowed | remaining | requests in window |")
    out.append("|---|---|---|---|---|")
    for cls, s in sorted(health.get("slo", {}).items()):
        out.append(f"| {cls} | {s['target']} | {s['error_budget_allowed']:.1f} | {s['error_budget_remaining']:.1f} | "
                   f"{s['requests']} |")
    q = health.get("batch_queue", {})
    out.append("")
    out.append(f"The batch queue at the end: {q.get('done', '?')} done, {q.get('failed', '?')} failed, "
               f"{q.get('expired', '?')} expired, {q.get('queued', '?')} queued, {q.get('running', '?')} running.")
    report = "\n".join(out) + "\n"
    print()
    print(report)
    if a.report:
        with open(a.report, "w") as f:
            f.write(report)
    # A gauge left above zero at idle, or a request without an HTTP answer, fails the soak.
    leaked = [r for r in rows if r["nonzero"]]
    unanswered = total.outcomes.get(("interactive", "transport_error"), 0)
    return 1 if leaked or unanswered else 0


if __name__ == "__main__":
    sys.exit(main())
