#!/usr/bin/env python3
"""The soak's driver (scripts/soak builds the gateway and starts Redis, then
runs this). It starts `gateway --serve` with the fleet's Redis and drives it
in one of three modes.

closed (the default): cycles of normal load, a provider fault (slowdown,
outage, rate limit, stall, invalid output in turn) during which the Redis
server is killed and restarted, recovery, then idle; client threads wait for
each answer, so fast (degraded) phases send more. At the start and end of
each cycle it reads the gateway's RSS and open file descriptors from /proc,
and at idle it checks that every permit, in-flight and queue gauge is back
at zero.

open: a fixed arrival rate per class (feedback, batch, chat, stream), each
request sent at its time whether or not earlier ones have been answered, so
the offered load is the same in every phase. The same cycle of faults runs
(unless --no-faults). Every --sample-seconds it records RSS, anonymous RSS,
threads, open descriptors and the size of the SQLite files; at the end,
every gauge is checked back at zero.

burst: a short warm-up, then N concurrent 64 KB JSON bodies, deeply nested
(the shape a JSON DOM spends the most memory on) or wide (thousands of
empty arrays side by side), then RSS for --burst-watch seconds.

It prints a Markdown report: requests by outcome, p50/p99 per class, the
error budget, the resources over time and the gauges.

--wrap runs the gateway under a command (heaptrack, valgrind --tool=massif):
resources are read from the gateway's own process, found below the wrapper.

Standard library only. Usage (normally through scripts/soak):
  soak.py --gateway PATH --redis-script tests/servers/redis.sh --redis-dir DIR
          [--mode closed|open|burst] [--minutes 10] [--cycle-seconds 60] [--rate 30]
          [--feedback-rate 10] [--batch-rate 2] [--chat-rate 1] [--stream-rate 1]
          [--sample-seconds 30] [--no-faults] [--burst 96] [--burst-shape nested|wide]
          [--wrap CMD] [--report FILE]
"""
import argparse
import itertools
import json
import os
import re
import shlex
import signal
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


def descendants(pid):
    """The processes below pid (a wrapper's children, theirs...)."""
    kids = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for k in kids.get(p, []):
            out.append(k)
            todo.append(k)
    return out


class Gateway:
    def __init__(self, binary, redis, data_dir, wrap=""):
        self.port = free_port()
        self.data_dir = data_dir
        self.log = open(os.path.join(data_dir, "gateway.log"), "w")
        cmd = shlex.split(wrap) + [binary, "--serve", str(self.port), data_dir, "--redis", redis]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.binary = os.path.realpath(binary)
        self.pid = self.proc.pid if not wrap else None
        end = time.time() + (300 if wrap else 30)  # under a profiler, start-up is slow
        while time.time() < end:
            try:
                self.get("/healthz")
                break
            except OSError:
                if self.proc.poll() is not None:
                    sys.exit(f"soak: the gateway exited with {self.proc.returncode}; see {self.log.name}")
                time.sleep(0.1)
        else:
            sys.exit("soak: the gateway did not answer /healthz in time")
        if self.pid is None:  # the gateway itself, below the wrapper (heaptrack runs it as a child)
            for p in [self.proc.pid] + descendants(self.proc.pid):
                try:
                    if os.path.realpath(f"/proc/{p}/exe") == self.binary:
                        self.pid = p
                        break
                except OSError:
                    pass
            if self.pid is None:  # valgrind keeps the gateway's pid but runs as its own executable
                self.pid = self.proc.pid

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
        with open(f"/proc/{self.pid}/status") as f:
            rss = int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1))
        fds = len(os.listdir(f"/proc/{self.pid}/fd"))
        return rss, fds

    def sample(self):
        """RSS, its anonymous part (the heap; the rest is mapped files), threads,
        open descriptors (kB, kB, count, count) and the data directory's bytes."""
        with open(f"/proc/{self.pid}/status") as f:
            st = f.read()

        def kb(field):
            m = re.search(field + r":\s+(\d+)", st)
            return int(m.group(1)) if m else -1

        fds = len(os.listdir(f"/proc/{self.pid}/fd"))
        files = 0
        for name in os.listdir(self.data_dir):
            try:
                files += os.path.getsize(os.path.join(self.data_dir, name))
            except OSError:
                pass
        return {"rss": kb("VmRSS"), "anon": kb("RssAnon"), "threads": kb("Threads"), "fds": fds, "files": files}

    def stop(self, timeout=20):
        # SIGTERM to the gateway itself: it stops cleanly (a profiler around it
        # then writes its data); the wrapper exits after it.
        try:
            os.kill(self.pid, signal.SIGTERM)
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
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


def outcome_table(tally, classes, sent=None):
    """Markdown rows: per class, each outcome's count (and what was sent, when given), p50 and p99."""
    kinds = sorted({k[1] for k in tally.outcomes})
    head = "| class | " + ("sent | " if sent is not None else "")
    rows = [head + " | ".join(kinds) + " | p50 ms | p99 ms |",
            "|---|" + ("---|" if sent is not None else "") + "---|" * (len(kinds) + 2)]
    for cls in classes:
        lat = tally.latency.get(cls, [])
        sent_cell = f"{sent[cls]} | " if sent is not None else ""
        rows.append(f"| {cls} | {sent_cell}" + " | ".join(str(tally.outcomes.get((cls, k), 0)) for k in kinds) +
                    f" | {pct(lat, 0.5) * 1000:.0f} | {pct(lat, 0.99) * 1000:.0f} |")
    return rows


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


def closed_loop(a, gw):
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
    out.append(f"### Soak (closed loop): {cycles} cycles of {L:.0f} s ({elapsed / 60:.1f} min), "
               f"{a.rate:.0f} interactive requests/s")
    out.append("")
    out.append("Requests by class and outcome (client side):")
    out.append("")
    out.extend(outcome_table(total, sorted({k[0] for k in total.outcomes})))
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
    emit(a, out)
    # A gauge left above zero at idle, or a request without an HTTP answer, fails the soak.
    leaked = [r for r in rows if r["nonzero"]]
    unanswered = total.outcomes.get(("interactive", "transport_error"), 0)
    return 1 if leaked or unanswered else 0


def emit(a, lines):
    report = "\n".join(lines) + "\n"
    print()
    print(report)
    if a.report:
        with open(a.report, "w") as f:
            f.write(report)


# --- open loop -------------------------------------------------------------

OPEN_CLASSES = ["feedback", "batch", "chat", "stream"]


def open_request(gw, cls, n, run):
    """One request of an open-loop class; returns (status, outcome)."""
    tenant = f"t{n % 8}"
    key = f"soak-{run}-{cls}-{n}"
    try:
        if cls == "feedback":
            status, body = gw.request("POST", "/v1/feedback", {"tenant": tenant, "question_id": "q-timeouts",
                                                               "answer": "one deadline, stages get what remains",
                                                               "class": "interactive"}, key=key, timeout=60)
        elif cls == "batch":
            status, body = gw.request("POST", "/v1/batch", {"tenant": tenant, "learner": f"l{n % 50}",
                                                            "sessions": ["session one", "session two"]},
                                      key=key, timeout=60)
        else:
            req = {"tenant": tenant, "max_tokens": 24,
                   "messages": [{"role": "system", "content": "You review interview answers."},
                                {"role": "user", "content": f"Review answer {n}: one deadline, stages get what remains."}]}
            if cls == "stream":
                req["stream"] = True
            status, body = gw.request("POST", "/v1/chat/completions", req, key=key, timeout=60)
    except OSError:
        return 0, "transport_error"
    if status == 200 and cls == "stream":
        whole = b"[DONE]" in body and b'"finish_reason":"partial"' not in body
        return status, "complete" if whole else "partial"
    return status, outcome_of("interactive" if cls in ("feedback", "chat") else cls, status, body)


class Arrivals:
    """Sends one class at a fixed rate: request k at start + k / rate, each on
    its own thread, whether or not earlier ones have been answered. Past
    `cap` requests in flight it counts a client overflow instead of sending
    (the client's limit, reported, so that an open loop stays open)."""

    def __init__(self, gw, tally, cls, rate, run, start, stop, inflight, cap=400):
        self.gw, self.tally, self.cls, self.rate, self.run = gw, tally, cls, rate, run
        self.start, self.stop, self.inflight, self.cap = start, stop, inflight, cap
        self.sent = 0
        self.threads = []
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def one(self, n):
        t0 = time.time()
        status, outcome = open_request(self.gw, self.cls, n, self.run)
        self.tally.add(self.cls, outcome, time.time() - t0)
        with self.inflight[0]:
            self.inflight[1] -= 1

    def loop(self):
        if self.rate <= 0:
            return
        k = 0
        while not self.stop.is_set():
            at = self.start + k / self.rate
            delay = at - time.time()
            if delay > 0 and self.stop.wait(delay):
                break
            k += 1
            with self.inflight[0]:
                full = self.inflight[1] >= self.cap
                if not full:
                    self.inflight[1] += 1
            if full:
                self.tally.add(self.cls, "client_overflow", 0.0)
                continue
            self.sent += 1
            t = threading.Thread(target=self.one, args=(k,), daemon=True)
            t.start()
            self.threads.append(t)
            if len(self.threads) > 256:
                self.threads = [x for x in self.threads if x.is_alive()]


def fmt_mb(kb):
    return f"{kb / 1024:.1f}"


def open_loop(a, gw):
    rates = {"feedback": a.feedback_rate, "batch": a.batch_rate, "chat": a.chat_rate, "stream": a.stream_rate}
    run = f"{int(time.time())}"
    tally = Tally()
    stop = threading.Event()
    inflight = [threading.Lock(), 0]
    start = time.time() + 0.5
    senders = [Arrivals(gw, tally, cls, rates[cls], run, start + i * 0.01, stop, inflight)
               for i, cls in enumerate(OPEN_CLASSES)]
    samples = []

    def take(label=""):
        s = gw.sample()
        with tally.mu:
            s["answered"] = sum(tally.outcomes.values())
        s["t"] = time.time() - start
        s["label"] = label
        samples.append(s)
        print(f"{s['t'] / 60:6.1f} min  RSS {s['rss']} kB (anon {s['anon']})  threads {s['threads']}  "
              f"fds {s['fds']}  files {s['files'] / 1e6:.1f} MB  answered {s['answered']}  "
              f"in flight {inflight[1]}{'  ' + label if label else ''}", flush=True)

    def sampler():
        k = 1
        while not stop.wait(max(0.0, start + k * a.sample_seconds - time.time())):
            take()
            k += 1

    take("start")
    for s in senders:
        s.thread.start()
    st = threading.Thread(target=sampler, daemon=True)
    st.start()
    duration = a.minutes * 60
    faults = []
    c = 0
    # The same fault cycle as the closed loop (normal 35%, fault 30% with Redis
    # killed at its start and back at its middle, normal again), at the same offered load.
    while time.time() - start < duration:
        L = a.cycle_seconds
        cyc0 = start + c * L
        if a.faults and cyc0 + L <= start + duration:
            fault = FAULTS[c % len(FAULTS)]
            time.sleep(max(0.0, cyc0 + 0.35 * L - time.time()))
            gw.request("POST", "/admin/fault", {"kind": fault})
            redis(a.redis_script, a.redis_dir, "kill")
            time.sleep(max(0.0, cyc0 + 0.50 * L - time.time()))
            redis(a.redis_script, a.redis_dir, "restart")
            time.sleep(max(0.0, cyc0 + 0.65 * L - time.time()))
            gw.request("POST", "/admin/fault", {"kind": "none"})
            faults.append(fault)
        time.sleep(max(0.0, min(cyc0 + L, start + duration) - time.time()))
        c += 1
    stop.set()
    for s in senders:
        s.thread.join()
    for s in senders:
        for t in s.threads:
            t.join(120)
    elapsed = time.time() - start
    gauges, health = await_idle(gw, 60)
    take("end, idle")
    gw.stop(300 if a.wrap else 20)

    nonzero = {k: v for k, v in gauges.items() if v != 0}
    sent = {s.cls: s.sent for s in senders}
    out = []
    out.append(f"### Soak (open loop): {elapsed / 60:.1f} min at a fixed {a.feedback_rate:g} feedback, "
               f"{a.batch_rate:g} batch, {a.chat_rate:g} chat and {a.stream_rate:g} stream requests/s"
               + (f", a provider fault and a Redis kill every {a.cycle_seconds:.0f} s" if a.faults else ""))
    out.append("")
    out.append("Requests by class and outcome (client side):")
    out.append("")
    out.extend(outcome_table(tally, OPEN_CLASSES, sent))
    out.append("")
    out.append(f"Resources every {a.sample_seconds:.0f} s (RSS and its anonymous part from /proc, the SQLite "
               "files' bytes in the data directory):")
    out.append("")
    out.append("| min | RSS MB | anon MB | threads | fds | SQLite MB | answered |")
    out.append("|---|---|---|---|---|---|---|")
    for s in samples:
        out.append(f"| {s['t'] / 60:.1f}{' ' + s['label'] if s['label'] else ''} | {fmt_mb(s['rss'])} | "
                   f"{fmt_mb(s['anon'])} | {s['threads']} | {s['fds']} | {s['files'] / 1048576:.1f} | "
                   f"{s['answered']} |")
    out.append("")
    # Growth per 10 minutes over each third of the run (the first sample, before
    # any load, left out): a plateau shows as the last third's near zero.
    run_samples = [s for s in samples[1:] if not s["label"]]
    if len(run_samples) >= 6:
        third = len(run_samples) // 3
        parts = [run_samples[:third + 1], run_samples[third:2 * third + 1], run_samples[2 * third:]]
        slopes = []
        for part in parts:
            dt = (part[-1]["t"] - part[0]["t"]) / 600
            slopes.append((part[-1]["rss"] - part[0]["rss"]) / 1024 / dt if dt > 0 else float("nan"))
        out.append("RSS growth per 10 minutes over the first, middle and last third: " +
                   ", ".join(f"{x:+.2f} MB" for x in slopes) + ".")
        out.append("")
    out.append("Gauges at the end, after the load stopped: " +
               (", ".join(f"{k}={v:g}" for k, v in nonzero.items()) if nonzero else f"all {len(gauges)} at zero") + ".")
    q = health.get("batch_queue", {})
    out.append("")
    out.append(f"The batch queue at the end: {q.get('done', '?')} done, {q.get('failed', '?')} failed, "
               f"{q.get('expired', '?')} expired, {q.get('queued', '?')} queued, {q.get('running', '?')} running.")
    emit(a, out)
    unanswered = sum(v for (cls, k), v in tally.outcomes.items() if k == "transport_error")
    return 1 if nonzero or unanswered else 0


# --- burst -----------------------------------------------------------------

def burst_body(size, shape):
    """A JSON object of `size` bytes whose one field is an array nested as deep
    as the size allows ([[[[...]]]], shape "nested"), or as many empty arrays
    side by side ([[],[],...], shape "wide": shallow, but as many values)."""
    head, tail = '{"tenant":"t0","messages":', "}"
    room = size - len(head) - len(tail)
    if shape == "wide":
        n = (room - 1) // 3
        return (head + "[" + ",".join(["[]"] * n) + "]" + tail).encode()
    depth = room // 2
    return (head + "[" * depth + "]" * depth + tail).encode()


def burst(a, gw):
    run = f"{int(time.time())}"
    tally = Tally()
    # Warm up: a little of every class, so the baseline has its pools and caches.
    for n in range(40):
        for cls in OPEN_CLASSES:
            open_request(gw, cls, n, run)
    time.sleep(2)
    before = gw.sample()
    body = burst_body(a.burst_bytes, a.burst_shape)
    peak = [before["rss"]]
    done = threading.Event()

    def watch():
        while not done.wait(0.05):
            try:
                peak[0] = max(peak[0], gw.sample()["rss"])
            except OSError:
                return

    barrier = threading.Barrier(a.burst)

    def one():
        req = urllib.request.Request(f"http://127.0.0.1:{gw.port}{a.burst_path}", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        barrier.wait()
        t0 = time.time()
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                status = r.status
                r.read()
        except urllib.error.HTTPError as e:
            status = e.code
        except OSError:
            status = 0
        tally.add("burst", str(status) if status else "transport_error", time.time() - t0)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    threads = [threading.Thread(target=one) for _ in range(a.burst)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    w.join()
    after = []
    t_end = time.time()
    for sec in range(1, int(a.burst_watch) + 1):
        time.sleep(max(0.0, t_end + sec - time.time()))
        if sec in (1, 5, 10, 30, 60) or sec == int(a.burst_watch):
            after.append((sec, gw.sample()))
    gauges, _ = await_idle(gw, 30)
    gw.stop(300 if a.wrap else 20)
    lat = tally.latency.get("burst", [])
    out = [f"### Burst: {a.burst} concurrent {len(body)}-byte {a.burst_shape} JSON bodies to {a.burst_path}", ""]
    out.append("Answers: " + ", ".join(f"{k[1]}: {v}" for k, v in sorted(tally.outcomes.items())) +
               f"; p50 {pct(lat, 0.5) * 1000:.0f} ms, p99 {pct(lat, 0.99) * 1000:.0f} ms.")
    out.append("")
    out.append("| when | RSS MB | anon MB | threads |")
    out.append("|---|---|---|---|")
    out.append(f"| before | {fmt_mb(before['rss'])} | {fmt_mb(before['anon'])} | {before['threads']} |")
    out.append(f"| peak (sampled every 50 ms) | {fmt_mb(peak[0])} | | |")
    for sec, s in after:
        out.append(f"| {sec} s after | {fmt_mb(s['rss'])} | {fmt_mb(s['anon'])} | {s['threads']} |")
    nonzero = {k: v for k, v in gauges.items() if v != 0}
    out.append("")
    out.append("Gauges after: " + (", ".join(f"{k}={v:g}" for k, v in nonzero.items()) if nonzero
                                   else f"all {len(gauges)} at zero") + ".")
    emit(a, out)
    return 1 if nonzero or tally.outcomes.get(("burst", "transport_error"), 0) else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gateway", required=True)
    ap.add_argument("--redis-script", required=True)
    ap.add_argument("--redis-dir", required=True)
    ap.add_argument("--mode", choices=["closed", "open", "burst"], default="closed")
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--cycle-seconds", type=float, default=60)
    ap.add_argument("--rate", type=float, default=30, help="closed loop: interactive requests a second")
    ap.add_argument("--feedback-rate", type=float, default=10, help="open loop: feedback requests a second")
    ap.add_argument("--batch-rate", type=float, default=2, help="open loop: batch jobs a second")
    ap.add_argument("--chat-rate", type=float, default=1, help="open loop: chat completions a second")
    ap.add_argument("--stream-rate", type=float, default=1, help="open loop: streamed chat completions a second")
    ap.add_argument("--sample-seconds", type=float, default=30, help="open loop: resources sampled this often")
    ap.add_argument("--no-faults", dest="faults", action="store_false", help="open loop: steady, no faults")
    ap.add_argument("--burst", type=int, default=96, help="burst: concurrent requests")
    ap.add_argument("--burst-bytes", type=int, default=64 * 1024 - 16, help="burst: each body's size")
    ap.add_argument("--burst-path", default="/v1/chat/completions")
    ap.add_argument("--burst-shape", choices=["nested", "wide"], default="nested", help="burst: the bodies' shape")
    ap.add_argument("--burst-watch", type=float, default=60, help="burst: seconds of RSS after it")
    ap.add_argument("--wrap", default="", help="run the gateway under this command (heaptrack -o FILE ...)")
    ap.add_argument("--data-dir", default="", help="the gateway's data directory (default: a new temporary one)")
    ap.add_argument("--report", default="")
    a = ap.parse_args()

    with open(os.path.join(a.redis_dir, "port")) as f:
        redis_addr = "127.0.0.1:" + f.read().strip()
    data_dir = a.data_dir or tempfile.mkdtemp(prefix="keel-soak-")
    os.makedirs(data_dir, exist_ok=True)
    print(f"soak: {a.mode} loop, the gateway's data and log in {data_dir}", flush=True)
    gw = Gateway(a.gateway, redis_addr, data_dir, a.wrap)
    return {"closed": closed_loop, "open": open_loop, "burst": burst}[a.mode](a, gw)


if __name__ == "__main__":
    sys.exit(main())
