"""The fault table of scripts/bench-gateway: the same scenarios through
HAProxy, Portkey and keel's gateway, each in front of two mock upstreams
(the primary, where the fault is switched on, and a fallback).

Every (scenario, system) pair gets a freshly started system and reset
mocks, so no breaker, health check or learned delay carries over from one
row to the next. Per row: what the client saw, the share of requests that
succeeded (a 200; for a stream, one that ended with [DONE]), the p99 (the
slowest of few), and the upstream calls per client request (both mocks'
chat requests).

Configuration given to each, as a user would write it:
  HAProxy  retries 3, retry-on conn-failure empty-response response-timeout
           500 502 503 504 (2.6 has no 429), redispatch, the fallback as a
           backup server, health checks every second, timeout server 1 s
  Portkey  fallback strategy over the two on 429/5xx/408, retry 2 attempts
           on 429/5xx with use_retry_after_header, request_timeout 1000 ms
  keel     bench/gateway/faults.toml: first token 1 s, stall 400 ms,
           2 attempts, failover to the second deployment, the hedge
"""
import json
import os
import subprocess
import time

import common
from common import log

SYSTEMS = ["haproxy", "portkey", "keel"]
# A non-streamed answer takes as long as the same 20 tokens streamed (20 ms
# to the first, then 10 ms each), as a model server's would: keel's gateway
# serves a non-streamed request from a streamed upstream call, the others
# ask the upstream for the whole answer, and both must cost the same.
WHOLE_MS = 20 + 19 * 10


def haproxy_cfg(port, a, b):
    return f"""global
    maxconn 4000
defaults
    mode http
    option http-no-delay
    timeout connect 500ms
    timeout client 60s
    timeout server 1s
frontend llm
    bind 127.0.0.1:{port}
    default_backend llm
backend llm
    retries 3
    retry-on conn-failure empty-response response-timeout 500 502 503 504
    option redispatch 1
    server primary 127.0.0.1:{a} check inter 1s fall 2 rise 2
    server fallback 127.0.0.1:{b} backup check inter 1s
"""


def portkey_config(a, b):
    target = lambda port, retry: {"provider": "openai", "api_key": "bench", "custom_host": f"http://127.0.0.1:{port}/v1",
                                  "request_timeout": 1000, **({"retry": retry} if retry else {})}
    retry = {"attempts": 2, "on_status_codes": [429, 500, 502, 503, 504], "use_retry_after_header": True}
    return {"strategy": {"mode": "fallback", "on_status_codes": [408, 429, 500, 502, 503, 504]},
            "targets": [target(a, retry), target(b, None)]}


class Faults:
    def __init__(self, args, bench):
        self.a = args
        self.b = bench
        self.run_dir = os.path.join(bench.run_dir, "faults")
        os.makedirs(self.run_dir, exist_ok=True)
        self.procs = bench.procs
        self.mock = os.path.join(args.build, "examples", "mock_upstream")
        self.ports = {"a": common.free_port(), "b": common.free_port()}
        self.bodies = {}
        for name, body in {
            "whole": {"model": "chat", "messages": [{"role": "user", "content": common.PROMPT}], "max_tokens": 20},
            "stream": {"model": "chat", "messages": [{"role": "user", "content": common.PROMPT}], "max_tokens": 20,
                       "stream": True},
            "long": {"model": "chat", "messages": [{"role": "user", "content": common.PROMPT}], "max_tokens": 200,
                     "stream": True},
            "hedged": {"model": "chat-hedged", "messages": [{"role": "user", "content": common.PROMPT}],
                       "max_tokens": 20, "stream": True},
        }.items():
            path = os.path.join(self.run_dir, f"body-{name}.json")
            open(path, "w").write(json.dumps(body))
            self.bodies[name] = path

    # ---------------------------------------------------------- processes ---

    def start_mock(self, which):
        port = self.ports[which]
        p = self.procs.start(f"fault-mock-{which}", [self.mock, "--port", str(port), "--name", f"fault-{which}",
                                                     "--tokens", "200", "--first-token-ms", "20", "--token-gap-ms", "10",
                                                     "--latency-ms", str(WHOLE_MS)])
        common.wait_port(port, proc=p)

    def mock_url(self, which, path):
        return f"http://127.0.0.1:{self.ports[which]}{path}"

    def reset_mocks(self):
        for w in ("a", "b"):
            if f"fault-mock-{w}" in self.procs.procs:
                common.http_json(self.mock_url(w, "/control/reset"), {}, method="POST")

    def set_fault(self, fault):
        common.http_json(self.mock_url("a", "/control/fault"), fault)

    def calls(self):
        n = 0
        for w in ("a", "b"):
            if f"fault-mock-{w}" in self.procs.procs:
                n += common.http_json(self.mock_url(w, "/control/stats"))["requests"]["chat"]
        return n

    def start_system(self, system):
        """Starts `system` fresh; returns (url, headers)."""
        a, b = self.ports["a"], self.ports["b"]
        auth = [f"Authorization: Bearer {common.BENCH_KEY}"]
        if system == "haproxy":
            port = common.free_port()
            cfg = os.path.join(self.run_dir, "haproxy.cfg")
            open(cfg, "w").write(haproxy_cfg(port, a, b))
            p = self.procs.start("fault-haproxy", ["haproxy", "-f", cfg, "-db"])
            common.wait_port(port, proc=p)
            time.sleep(0.3)  # its first health checks
            return f"http://127.0.0.1:{port}/v1/chat/completions", auth
        if system == "portkey":
            port = common.free_port()
            script = os.path.join(self.a.portkey, "node_modules", "@portkey-ai", "gateway", "build", "start-server.js")
            p = self.procs.start("fault-portkey", ["node", script, f"--port={port}", "--headless"], cwd=self.a.portkey)
            common.wait_port(port, timeout=60, proc=p)
            return (f"http://127.0.0.1:{port}/v1/chat/completions",
                    auth + ["x-portkey-config: " + json.dumps(portkey_config(a, b), separators=(",", ":"))])
        if system == "keel":
            data = os.path.join(self.run_dir, f"keel-data-{time.monotonic_ns()}")
            cfg = common.keel_conf(self.run_dir, "faults.toml", data_dir=data)
            env = dict(os.environ, FAULT_A_PORT=str(a), FAULT_B_PORT=str(b))
            gw = os.path.join(self.a.build, "examples", "gateway")
            p = self.procs.start("fault-keel", [gw, "--config", cfg], env=env)
            port = common.read_serving_port(os.path.join(self.run_dir, "..", "fault-keel.log"), proc=p)
            return f"http://127.0.0.1:{port}/v1/chat/completions", auth
        raise ValueError(system)

    def stop_system(self, system):
        self.procs.stop(f"fault-{system}")

    def client(self, target, body, extra):
        url, headers = target
        args = [self.b.loadgen, "--url", url, "--body", self.bodies[body], "--detail"] + (["--stream"] if body != "whole" else [])
        for h in headers:
            args += ["-H", h]
        out = subprocess.run(args + extra, capture_output=True, text=True, timeout=180)
        if out.returncode != 0:
            raise RuntimeError(f"keel_loadgen failed: {out.stderr}")
        return json.loads(out.stdout)

    # ----------------------------------------------------------- the rows ---

    def rows(self):
        seq = lambda n, t=10: ["--concurrency", "1", "--requests", str(n), "--timeout", str(t)]
        return [
            # name, body, how the client runs, the fault (None: healthy), re-armed before each request
            ("429 once, retry-after-ms: 300 and Retry-After: 1, then 200", "whole", seq(1),
             {"kind": "rate_limit", "retry_after_ms": 300, "count": 1}, 5),
            ("429 once, Retry-After: 1 only, then 200", "whole", seq(1),
             {"kind": "rate_limit", "retry_after_ms": 1000, "count": 1, "hint_headers": "retry-after"}, 3),
            ("every answer 503", "whole", seq(10), {"kind": "server_error", "status": 503}, 1),
            ("30% random 503", "whole", ["--concurrency", "4", "--requests", "60", "--timeout", "10"],
             {"kind": "server_error", "status": 503, "ratio": 0.3}, 1),
            ("primary dead (connection refused), fallback alive", "whole",
             ["--rate", "10", "--duration", "5", "--timeout", "10"], "dead", 1),
            ("upstream hangs (non-streamed)", "whole", seq(2, 15), {"kind": "hang"}, 1),
            ("stream stalls after 5 tokens", "stream", seq(2, 15), {"kind": "stall", "after_tokens": 5}, 1),
            ("connection closed after 10 tokens (no [DONE])", "stream", seq(4), {"kind": "cut", "after_tokens": 10}, 1),
            ("client leaves after 5 of 200 tokens", "long", ["--concurrency", "1", "--requests", "1",
                                                              "--leave-after-tokens", "5"], "leave", 3),
            ("slow first token (2 s) on the primary of two", "hedged", seq(5),
             {"kind": "slow_first_token", "first_token_ms": 2000}, 1),
        ]

    def run_row(self, system, target, row):
        name, body, extra, fault, repeat = row
        results, upstream_calls, stop_ms = [], 0, []
        for _ in range(repeat):
            self.reset_mocks()
            if isinstance(fault, dict):
                self.set_fault(fault)
            if fault == "dead":
                self.procs.stop("fault-mock-a")
            res = self.client(target, body, extra)
            if fault == "leave":
                stop_ms.append(self.upstream_stop_ms(res["left_unix_ms"]))
            if fault == "dead":
                upstream_calls += self.calls()
                self.start_mock("a")
            else:
                time.sleep(0.05)
                upstream_calls += self.calls()
            results.append(res)
        each = [e for r in results for e in r["each"]]
        return summarize_row(name, system, each, upstream_calls, body != "whole", stop_ms, fault)

    def upstream_stop_ms(self, left_unix_ms):
        """How long after the client left the primary's transfer stopped (the
        mock notices a hang-up within a few ms), or None if it ran on."""
        end = time.monotonic() + 5
        while time.monotonic() < end:
            st = common.http_json(self.mock_url("a", "/control/stats"))
            if st["client_gone"]["count"] > 0:
                return st["client_gone"]["last_unix_ms"] - left_unix_ms
            if st["chat"]["streams_completed"] > 0:
                return None  # the upstream stream ran to its end
            time.sleep(0.02)
        return None

    def run(self):
        self.start_mock("a")
        self.start_mock("b")
        systems = [s for s in SYSTEMS if s in self.b.systems]
        rows = []
        for row in self.rows():
            for s in systems:
                target = self.start_system(s)
                try:
                    r = self.run_row(s, target, row)
                finally:
                    self.stop_system(s)
                rows.append(r)
                log(f"  fault: {row[0][:44]:44} {s:8} {r['saw'][:60]:60} success {r['success']:.0%}  "
                    f"p99 {r['p99_ms']} ms  calls/request {r['calls_per_request']}")
        self.procs.stop("fault-mock-a")
        self.procs.stop("fault-mock-b")
        return rows


def summarize_row(name, system, each, calls, stream, stop_ms, fault):
    n = len(each)
    ok = 0
    saw = {}
    times = []
    for e in each:
        if e["status"] == -1:
            label = f"left after {e['tokens']} tokens"
            good = True
        elif e["error"]:
            label = {"timeout": "no answer (client timeout)", "closed_mid_body": "connection closed mid-answer",
                     "closed": "connection closed", "reset": "connection reset"}.get(e["error"], e["error"])
            if stream and e["tokens"]:
                label += f" after {e['tokens']} tokens"
            good = False
        elif stream:
            good = e["status"] == 200 and e["done"]
            label = (f"{e['status']} stream with [DONE], {e['tokens']} tokens" if good else
                     f"{e['status']} stream without [DONE], {e['tokens']} tokens")
        else:
            good = e["status"] == 200
            label = str(e["status"])
        ok += good
        saw[label] = saw.get(label, 0) + 1
        if e["ms"] >= 0:
            times.append(e["ms"])
    times.sort()
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))] if times else None
    r = {"scenario": name, "system": system, "requests": n,
         "saw": "; ".join(f"{k} x{v}" for k, v in sorted(saw.items(), key=lambda kv: -kv[1])),
         "success": ok / n if n else 0.0, "p99_ms": round(p99, 1) if p99 is not None else None,
         "calls_per_request": round(calls / n, 2) if n else None}
    if fault == "dead" and each:
        r["first_ms"] = round(each[0]["ms"], 1)
        tail = [e["ms"] for e in each[-10:] if e["ms"] >= 0]
        r["steady_p50_ms"] = round(common.median(tail), 2) if tail else None
        r["saw"] += f" (first request {r['first_ms']} ms, last 10 p50 {r['steady_p50_ms']} ms)"
    if fault == "hedged" or name.startswith("slow first token"):
        ttfts = sorted(e["ttft_ms"] for e in each if e["ttft_ms"] >= 0)
        r["ttft_p50_ms"] = round(common.median(ttfts), 1) if ttfts else None
        r["saw"] += f" (time to first token p50 {r['ttft_p50_ms']} ms)"
    if fault == "leave":
        r["upstream_stop_ms"] = stop_ms
        r["saw"] += "; upstream stopped " + ", ".join("ran to its end" if s is None else f"{s} ms" for s in stop_ms) + \
            " after the client left"
    return r


def markdown(rows):
    lines = ["| scenario | system | what the client saw | success | p99 (ms) | upstream calls / request |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['scenario']} | {r['system']} | {r['saw']} | {r['success']:.0%} | {r['p99_ms']} | "
                     f"{r['calls_per_request']} |")
    return "\n".join(lines) + "\n"


def figures(rows):
    """Flat keys for results.json: <system>.fault.<scenario slug>.<figure>."""
    out = {}
    for r in rows:
        slug = "".join(c if c.isalnum() else "_" for c in r["scenario"].lower()).strip("_")
        while "__" in slug:
            slug = slug.replace("__", "_")
        base = f"{r['system']}.fault.{slug[:48]}"
        out[f"{base}.success"] = r["success"]
        out[f"{base}.p99_ms"] = r["p99_ms"]
        out[f"{base}.calls_per_request"] = r["calls_per_request"]
        for k in ("first_ms", "steady_p50_ms", "ttft_p50_ms"):
            if k in r:
                out[f"{base}.{k}"] = r[k]
        if "upstream_stop_ms" in r:
            stops = [s for s in r["upstream_stop_ms"] if s is not None]
            out[f"{base}.upstream_stop_ms"] = common.median(stops) if len(stops) == len(r["upstream_stop_ms"]) else None
    return out


def run(args, bench):
    log("fault table")
    f = Faults(args, bench)
    rows = f.run()
    return {"rows": rows, "figures": figures(rows), "markdown": "### Faults\n\n" + markdown(rows)}
