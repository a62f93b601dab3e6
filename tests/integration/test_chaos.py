"""Chaos under load (issue 33; reliability.md "Faults survived"): two routers, two prefill and two decode workers
joined to both, 64 concurrent greedy streams, and every kind of process killed or stalled while they run.

Topology (all on loopback, each its own process): routers R1 and R2; prefill-1, prefill-2, decode-1, decode-2, each
with `--join R1,R2`. The routers' HTTP and cluster ports are ephemeral at first and fixed from then on, so R1 can be
started again on the same ports.

1. Twins: each of the 64 prompts (eight families of lengths from a few tokens to ~4 blocks; the members of a family
   share a prefix) is completed without streaming on the calm cluster (greedy, ignore_eos, MAX_TOKENS), half
   through each router. Two of them are also checked against `deltaserve generate`.
2. Wave 1: the 64 prompts as concurrent streams, even ones through R1, odd ones through R2. Faults, each placed
   by what is observed (tokens streamed, a worker's /metrics, the routers' worker counts), never by a sleep:
   a. SIGSTOP decode-1 once 5 % of the wave's tokens arrived and it holds requests; SIGCONT once both routers
      declared it lost (their decode worker count fell to 1), i.e. after the lost-worker bound (ten missed
      500 ms heartbeats); it must join both routers again.
   b. SIGKILL decode-2 (it holds requests by then: those moved off decode-1 among them) once decode-1 is back.
   c. SIGKILL R1 while R2's streams still run; start it again on the same HTTP and cluster ports; every live
      worker must join it again (it reports ready with both prefill workers and decode-1).
3. Wave 2: 32 streams of the longest prompts, alternately through the restarted R1 and R2; SIGKILL prefill-1
   while it has prompts queued or prefilling.
4. Every stream through R2 and through the restarted R1 ends with exactly its twin's tokens and text, finish
   `length`, usage = MAX_TOKENS, and no error event. Streams through R1 before its kill either completed the same
   way or were cut by the kill (text so far a prefix of the twin, no error event). Each fault must have landed:
   the routers' logs show requests moved off each lost worker. At the end both routers list exactly the live
   workers, and every live process is back to idle: no request running, waiting or queued, no state slot used,
   no decode slot used (router view), /health 200. Every process is stopped.

Retry budget: a request is prefilled at most 3 times (router max_attempts), and a lost worker's requests take one
attempt each. The order above keeps every request within it: a wave-1 request sees at most the two decode faults
(3 attempts), a wave-2 request only the prefill fault (2 attempts). Piling all four worker faults on one request
would end it with "gave up after 3 attempts", which is the documented bound, not a failure of this test's claim.

Not observable here: UCX transfer-engine counters (regions, pending transfers) are not exported to /metrics, and
MLA pages held by the prefix cache are indistinguishable from leaked ones; slots and requests are checked.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest
import requests

from conftest import CLUSTER_RE, DECODE_JOINED_RE, HTTP_RE, PREFILL_JOINED_RE, DsProcess, http_get, require_multi

STREAMS = 64
WAVE2_STREAMS = 32
MAX_TOKENS = 256
CACHE_KEY = "00112233445566778899aabbccddeeff"
DEADLINE_S = 120.0  # any single wait on an observable state (a loaded 2-core machine)
STREAM_TIMEOUT_S = 120.0  # one stream, start to [DONE] (each takes well under 30 s)
METRICS_RE = re.compile(r"deltaserve: metrics listening on (http://\S+)/metrics")
SAMPLE_RE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)$")
LABEL_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
DECODE_LOST = "a decode worker was lost"
PREFILL_LOST = "a prefill worker was lost"


# ---------------------------------------------------------------------------------------------
# Prompts: 8 families x 8 members; a family's members share its first part (from a few words to a few 512-token
# blocks, so the prefix caches hit), then differ.

FAMILY_WORDS = [0, 3, 12, 40, 120, 260, 420, 640]
VOCAB = ["river", "stone", "lantern", "orbit", "copper", "meadow", "signal", "harbor", "quartz", "ember", "falcon",
         "willow", "cipher", "tundra", "violet", "anchor"]


def words(seed: int, n: int) -> str:
    return " ".join(f"{VOCAB[(i * 7 + seed * 13) % len(VOCAB)]}{(i * seed + 3) % 31}" for i in range(n))


def make_prompts() -> list[str]:
    prompts = []
    for family, n in enumerate(FAMILY_WORDS):
        shared = words(family + 1, n)
        for member in range(8):
            tail = f"Question {member}: what comes after {VOCAB[(family + member) % len(VOCAB)]} {member * family}?"
            if member % 3 == 2:
                tail += " " + words(100 + member, 5 + 9 * member)
            prompts.append(f"{shared}\n{tail}" if shared else tail)
    assert len(prompts) == STREAMS and len(set(prompts)) == STREAMS
    return prompts


# ---------------------------------------------------------------------------------------------
# /metrics


def scrape(url: str) -> list[tuple[str, dict[str, str], float]]:
    status, _, body = http_get(url + "/metrics", timeout=10)
    assert status == 200, f"{url}/metrics: {status} {body[:200]!r}"
    out = []
    for line in body.decode("utf-8", "replace").splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE_RE.match(line.strip())
        if m:
            out.append((m.group(1), dict(LABEL_RE.findall(m.group(2) or "")), float(m.group(3))))
    return out


def sample(samples, name: str, **labels) -> float:
    """Sum of the series of `name` whose labels include `labels` (0 when none)."""
    return sum(v for n, ls, v in samples if n == name and all(ls.get(k) == w for k, w in labels.items()))


def label_values(samples, name: str, label: str) -> set[str]:
    return {ls[label] for n, ls, _ in samples if n == name and label in ls}


# ---------------------------------------------------------------------------------------------
# Streams


@dataclass
class Stream:
    index: int  # prompt index
    router: str  # "R1" (first incarnation), "R1'" (restarted) or "R2"
    url: str
    wave: int
    tokens: list[str] = field(default_factory=list)
    text: str = ""
    finish: str | None = None
    usage: dict | None = None
    errors: list[dict] = field(default_factory=list)
    status: int | None = None
    exception: str | None = None
    done_seen: bool = False
    finished: bool = False
    ended_at: float | None = None


class Load:
    """Runs streams in threads and counts the tokens they received."""

    def __init__(self, model: str, prompts: list[str]):
        self.model = model
        self.prompts = prompts
        self.lock = threading.Lock()
        self.tokens = {1: 0, 2: 0}  # per wave
        self.streams: list[Stream] = []
        self.threads: list[threading.Thread] = []

    def start(self, s: Stream) -> None:
        self.streams.append(s)
        t = threading.Thread(target=self._run, args=(s,), name=f"stream-{s.wave}-{s.index}", daemon=True)
        self.threads.append(t)
        t.start()

    def _run(self, s: Stream) -> None:
        body = {"model": self.model, "prompt": self.prompts[s.index], "max_tokens": MAX_TOKENS, "temperature": 0,
                "logprobs": 1, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with requests.post(s.url + "/v1/completions", json=body, stream=True,
                               timeout=(10, STREAM_TIMEOUT_S)) as r:
                s.status = r.status_code
                if r.status_code != 200:
                    s.exception = f"HTTP {r.status_code}: {r.text[:300]}"
                    return
                for line in r.iter_lines():
                    if not line.startswith(b"data: "):
                        continue
                    data = line[len(b"data: "):]
                    if data == b"[DONE]":
                        s.done_seen = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        s.errors.append(event["error"])
                        continue
                    if event.get("usage"):
                        s.usage = event["usage"]
                    for choice in event.get("choices", []):
                        lp = choice.get("logprobs") or {}
                        got = lp.get("tokens") or []
                        s.tokens.extend(got)
                        s.text += choice.get("text") or ""
                        if choice.get("finish_reason"):
                            s.finish = choice["finish_reason"]
                        with self.lock:
                            self.tokens[s.wave] += len(got)
        except Exception as e:  # noqa: BLE001 (a stream cut by a killed router ends here)
            s.exception = f"{type(e).__name__}: {e}"
        finally:
            s.finished = True
            s.ended_at = time.monotonic()

    def received(self, wave: int) -> int:
        with self.lock:
            return self.tokens[wave]

    def running(self, router: str) -> int:
        return sum(1 for s in self.streams if s.router == router and not s.finished)

    def join(self, deadline: float) -> None:
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [f"{s.router} wave {s.wave} prompt {s.index}: {len(s.tokens)} tokens" for s in self.streams
                 if not s.finished]
        assert not stuck, f"{len(stuck)} streams still running at the deadline: {stuck[:8]}"


# ---------------------------------------------------------------------------------------------
# The cluster


class Chaos:
    def __init__(self, env, logdir: str, model_dir: str, transport: list[str], tag: str):
        self.env = env
        self.logdir = logdir
        self.model = ["--model", model_dir]
        self.transport = transport
        self.tag = tag
        self.procs: list[DsProcess] = []
        self.routers: dict[str, tuple[DsProcess, str]] = {}  # "R1"/"R2" -> (process, http url)
        self.router_ports: dict[str, tuple[int, int]] = {}  # -> (http port, cluster port)
        self.workers: dict[str, tuple[DsProcess, str]] = {}  # "prefill-1"... -> (process, metrics url)
        self.log_marks: dict[str, int] = {}

    def _start(self, name: str, args: list[str]) -> DsProcess:
        p = DsProcess(f"chaos{self.tag}-{name}", args, self.env, self.logdir)
        self.procs.append(p)
        return p

    def start_router(self, name: str, http_port: int = 0, cluster_port: int = 0) -> None:
        p = self._start(name + ("-restarted" if name in self.routers else ""), ["router", *self.model, "--host", "127.0.0.1", "--port", str(http_port),
                               "--cluster-host", "127.0.0.1", "--cluster-port", str(cluster_port),
                               "--cache-key", CACHE_KEY])
        deadline = time.monotonic() + DEADLINE_S
        c = p.wait_line(CLUSTER_RE, deadline)[0]
        m = p.wait_line(HTTP_RE, deadline)[0]
        ports = (int(m.group(2)), int(c.group(2)))
        if http_port:
            assert ports == (http_port, cluster_port), f"{name} restarted on {ports}, wanted {(http_port, cluster_port)}"
        self.routers[name] = (p, f"http://127.0.0.1:{ports[0]}")
        self.router_ports[name] = ports

    def start_worker(self, name: str) -> None:
        role = name.split("-")[0]
        join = ",".join(f"127.0.0.1:{self.router_ports[r][1]}" for r in ("R1", "R2"))
        extra = ["--max-batch", str(STREAMS)] if role == "decode" else ["--cache-key", CACHE_KEY]
        p = self._start(name, [role, *self.model, "--join", join, "--metrics-listen", "127.0.0.1:0", *extra,
                               *self.transport])
        deadline = time.monotonic() + DEADLINE_S
        p.wait_line(DECODE_JOINED_RE if role == "decode" else PREFILL_JOINED_RE, deadline)
        self.workers[name] = (p, p.wait_line(METRICS_RE, deadline)[0].group(1))

    def live_workers(self) -> dict[str, tuple[DsProcess, str]]:
        return {n: w for n, w in self.workers.items() if w[0].alive()}

    def check_alive(self) -> None:
        for name, (p, _) in {**self.routers, **self.live_workers()}.items():
            assert p.alive(), f"{name} died (exit {p.proc.returncode})\n{p.describe()}"

    def wait(self, what: str, cond, deadline_s: float = DEADLINE_S, poll: float = 0.05):
        """Polls cond() until it returns a true value; fails with `what` and the last value at the deadline."""
        deadline = time.monotonic() + deadline_s
        last = None
        while time.monotonic() < deadline:
            try:
                last = cond()
            except (OSError, AssertionError) as e:  # a process between states
                last = e
            else:
                if last:
                    return last
            time.sleep(poll)
        pytest.fail(f"not within {deadline_s:.0f} s: {what} (last: {last!r})\n" +
                    "\n".join(p.describe() for p in self.procs if p.alive()))

    def router_workers(self, name: str) -> dict[str, set[str]]:
        """Router `name`'s live workers by role, by their names' pids (worker names end in ':<pid>')."""
        samples = scrape(self.routers[name][1])
        out: dict[str, set[str]] = {"prefill": set(), "decode": set()}
        for n, ls, _ in samples:
            if n == "deltaserve_router_worker_load" and "worker" in ls:
                out.setdefault(ls.get("role", "?"), set()).add(ls["worker"].rsplit(":", 1)[-1])
        counts = {role: sample(samples, "deltaserve_router_workers", role=role) for role in ("prefill", "decode")}
        assert counts == {role: len(out[role]) for role in counts}, f"{name}: counts {counts} vs series {out}"
        return out

    def expected_workers(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {"prefill": set(), "decode": set()}
        for name, (p, _) in self.live_workers().items():
            out[name.split("-")[0]].add(str(p.proc.pid))
        return out

    def joined_everywhere(self) -> bool:
        want = self.expected_workers()
        return all(self.router_workers(r) == want for r in self.routers)

    def worker_active(self, name: str) -> float:
        samples = scrape(self.workers[name][1])
        return sample(samples, "deltaserve_worker_requests", state="active")

    def worker_queued(self, name: str) -> float:
        return sample(scrape(self.workers[name][1]), "deltaserve_worker_requests", state="queued")

    def log_count(self, router: str, text: str) -> int:
        return self.routers[router][0].stderr_tail(50_000_000).count(text)

    def idle_report(self) -> list[str]:
        """What is not idle on the live processes (empty when everything is)."""
        busy = []
        for name, (_, url) in self.routers.items():
            s = scrape(url)
            for metric, labels in (("vllm:num_requests_running", {}), ("vllm:num_requests_waiting", {}),
                                   ("deltaserve_router_decode_slots", {"state": "used"})):
                v = sample(s, metric, **labels)
                if v != 0:
                    busy.append(f"{name} {metric}{labels} = {v}")
            if sample(s, "deltaserve_http_requests_in_flight") > 1:  # this scrape
                busy.append(f"{name} deltaserve_http_requests_in_flight = "
                            f"{sample(s, 'deltaserve_http_requests_in_flight')}")
            status, _, body = http_get(url + "/ready")
            ready = json.loads(body) if status == 200 else {"status": status}
            if not (status == 200 and ready.get("running") == 0 and ready.get("waiting") == 0 and
                    ready.get("worker_requests") == 0 and ready.get("decode_slots_free") == ready.get(
                        "decode_slots_total")):
                busy.append(f"{name} /ready {status} {ready}")
        for name, (_, url) in self.live_workers().items():
            s = scrape(url)
            for state in ("active", "queued"):
                if sample(s, "deltaserve_worker_requests", state=state) != 0:
                    busy.append(f"{name} requests {state} = {sample(s, 'deltaserve_worker_requests', state=state)}")
            used = sample(s, "deltaserve_kda_state_slots", state="used")
            if used != 0:
                busy.append(f"{name} kda_state_slots used = {used}")
            if "ucx" in self.transport:  # no transfer, reservation or UCX request left behind
                kinds = label_values(s, "deltaserve_ucx_transfers", "what")
                if kinds != {"pending", "requests_in_flight", "region_uses"}:
                    busy.append(f"{name} deltaserve_ucx_transfers reports {sorted(kinds)}")
                for what in sorted(kinds):
                    v = sample(s, "deltaserve_ucx_transfers", what=what)
                    if v != 0:
                        busy.append(f"{name} ucx transfers {what} = {v}")
            pages_used = sample(s, "deltaserve_mla_pages", state="used")
            if pages_used > 0 and sample(s, "deltaserve_prefix_cache_entries") == 0:
                busy.append(f"{name} {pages_used} MLA page groups used with no prefix-cache entry")
            status, _, body = http_get(url + "/health")
            if status != 200:
                busy.append(f"{name} /health {status} {body[:100]!r}")
        return busy

    def wait_idle(self, what: str, deadline_s: float = DEADLINE_S) -> None:
        deadline = time.monotonic() + deadline_s
        while True:
            busy = self.idle_report()
            if not busy:
                return
            if time.monotonic() > deadline:
                pytest.fail(f"not idle within {deadline_s:.0f} s {what}:\n" + "\n".join(busy))
            time.sleep(0.2)

    def stop(self) -> list[str]:
        problems = []
        ordered = [p for p, _ in self.routers.values()] + [p for p in self.procs]
        seen = set()
        for p in ordered:
            if id(p) in seen:
                continue
            seen.add(id(p))
            was_alive = p.alive()
            rc, killed = p.stop()
            if was_alive and (rc != 0 or killed):
                problems.append(f"{p.name}: exit {rc}{' (SIGKILLed after the grace period)' if killed else ''} "
                                f"after SIGTERM\n{p.describe()}")
        return problems


def completion(url: str, model: str, prompt: str) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 1,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=STREAM_TIMEOUT_S) as resp:
        assert resp.status == 200
        out = json.loads(resp.read())
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == MAX_TOKENS, out["usage"]
    return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"]}


def check_stream(s: Stream, twin: dict, cut_allowed: bool) -> str | None:
    """None when the stream is right; else what is wrong. `cut_allowed`: it may end early without an error event
    (its router was killed), as long as what it got is the twin's beginning."""
    where = f"{s.router} wave {s.wave} prompt {s.index}"
    if s.errors:
        return f"{where}: error event(s) {s.errors[:2]} after {len(s.tokens)} tokens"
    if s.tokens != twin["tokens"][:len(s.tokens)] or not twin["text"].startswith(s.text):
        first = next((i for i, (a, b) in enumerate(zip(s.tokens, twin["tokens"])) if a != b), len(s.tokens))
        return (f"{where}: tokens differ from the twin's at {first}: got {s.tokens[max(0, first - 2):first + 3]}, "
                f"twin {twin['tokens'][max(0, first - 2):first + 3]}")
    complete = s.done_seen and s.finish is not None
    if complete:
        if s.text != twin["text"] or len(s.tokens) != MAX_TOKENS:
            return f"{where}: {len(s.tokens)} tokens, text differs from the twin's"
        if s.finish != "length" or not s.usage or s.usage.get("completion_tokens") != MAX_TOKENS:
            return f"{where}: finish {s.finish}, usage {s.usage}"
        return None
    if cut_allowed:
        return None
    return f"{where}: ended after {len(s.tokens)} tokens (status {s.status}, {s.exception}, [DONE] {s.done_seen})"


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["caf", "ucx"])
def test_chaos_under_load(ds_env, logdir, model_dir, reference, transport):
    require_multi()
    flags = [] if transport == "caf" else ["--transport", "ucx", "--ucx-tls", "tcp,self", "--ucx-net-devices", "lo"]
    prompts = make_prompts()
    c = Chaos(ds_env, logdir, model_dir, flags, f"-{transport}")
    t_start = time.monotonic()
    timings: dict[str, float] = {}
    try:
        c.start_router("R1")
        c.start_router("R2")
        for name in ("prefill-1", "prefill-2", "decode-1", "decode-2"):
            c.start_worker(name)
        c.wait("every worker joined to both routers", c.joined_everywhere)
        for name in c.routers:
            c.wait(f"{name} ready", lambda: http_get(c.routers[name][1] + "/ready")[0] == 200)
        status, _, body = http_get(c.routers["R1"][1] + "/v1/models")
        model = json.loads(body)["data"][0]["id"]

        # 1. Twins, on the calm cluster; two checked against the engine alone.
        with ThreadPoolExecutor(max_workers=16) as pool:
            twins = list(pool.map(lambda i: completion(c.routers["R1" if i % 2 == 0 else "R2"][1], model, prompts[i]),
                                  range(STREAMS)))
        for i in (5, STREAMS - 1):
            ref = reference.get(prompts[i], MAX_TOKENS, ignore_eos=True)
            assert twins[i]["text"] == ref["text"], f"prompt {i}: the cluster's completion differs from generate"
        c.wait_idle("after the twins")
        timings["twins"] = time.monotonic() - t_start

        # 2. Wave 1.
        load = Load(model, prompts)
        wave1_total = STREAMS * MAX_TOKENS
        for i in range(STREAMS):
            r = "R1" if i % 2 == 0 else "R2"
            load.start(Stream(index=i, router=r, url=c.routers[r][1], wave=1))
        t_wave1 = time.monotonic()

        # 2a. decode-1 stalls past the lost-worker bound, then comes back.
        lost_before = c.log_count("R2", DECODE_LOST)
        c.wait("5 % of wave 1 streamed with decode-1 holding requests",
               lambda: load.received(1) >= wave1_total // 20 and c.worker_active("decode-1") > 0)
        d1 = c.workers["decode-1"][0]
        d1.signal(signal.SIGSTOP)
        t_stop = time.monotonic()
        at_stop = load.received(1)
        try:
            c.wait("both routers declared the stopped decode-1 lost",
                   lambda: all(len(c.router_workers(r)["decode"]) == 1 for r in c.routers), poll=0.1)
        finally:
            d1.signal(signal.SIGCONT)
        timings["decode-1 stopped for"] = time.monotonic() - t_stop
        c.wait("decode-1 joined both routers again", c.joined_everywhere, poll=0.1)
        assert c.log_count("R2", DECODE_LOST) > lost_before, "R2 moved no request off the stopped decode-1"
        assert load.received(1) > at_stop, "no token arrived while decode-1 was stopped"

        # 2b. decode-2 killed while it holds requests (decode-1 is back: one decode worker stays live).
        lost_before = c.log_count("R2", DECODE_LOST)
        c.wait("decode-2 holding requests", lambda: c.worker_active("decode-2") > 0)
        c.workers["decode-2"][0].proc.kill()
        c.workers["decode-2"][0].wait(30)
        c.wait("both routers lost decode-2", c.joined_everywhere, poll=0.1)
        c.wait("R2 moved requests off decode-2", lambda: c.log_count("R2", DECODE_LOST) > lost_before)
        timings["decode-2 killed at"] = time.monotonic() - t_wave1

        # 2c. R1 killed while R2 streams; started again on the same ports; the workers join it again.
        running_on_r2 = load.running("R2")
        assert running_on_r2 > 0, "every R2 stream finished before R1's kill: raise MAX_TOKENS"
        r1, _ = c.routers["R1"]
        t_kill = time.monotonic()
        r1.proc.kill()
        r1.wait(30)
        http_port, cluster_port = c.router_ports["R1"]
        c.start_router("R1", http_port, cluster_port)
        c.wait("every live worker joined the restarted R1", c.joined_everywhere, poll=0.1)
        c.wait("the restarted R1 ready", lambda: http_get(c.routers["R1"][1] + "/ready")[0] == 200)
        timings["R1 back after"] = time.monotonic() - t_kill
        r1_cut = [s for s in load.streams if s.router == "R1" and (s.ended_at is None or s.ended_at >= t_kill)]

        # 3. Wave 2 through the restarted R1 and R2; prefill-1 killed with prompts queued or prefilling. Wave 1's
        # requests are past their prefill first (none waiting, both prefill workers idle), so that the kill costs
        # an attempt to wave 2's requests only (the retry budget, above).
        def wave1_decoding():
            busy = [f"{n} {sample(scrape(u), 'deltaserve_worker_requests', state='queued')}"
                    for n, (_, u) in c.live_workers().items() if n.startswith("prefill")]
            waiting = {r: sample(scrape(u), "vllm:num_requests_waiting") for r, (_, u) in c.routers.items()}
            return busy == [f"{n} 0.0" for n in c.live_workers() if n.startswith("prefill")] and not any(
                waiting.values())
        c.wait("wave 1 past its prefills", wave1_decoding)
        by_length = sorted(range(STREAMS), key=lambda i: len(prompts[i]), reverse=True)[:WAVE2_STREAMS]
        lost_before = c.log_count("R1", PREFILL_LOST) + c.log_count("R2", PREFILL_LOST)
        for k, i in enumerate(by_length):
            r = "R1" if k % 2 == 0 else "R2"
            load.start(Stream(index=i, router="R1'" if r == "R1" else r, url=c.routers[r][1], wave=2))
        c.wait("prefill-1 with prompts queued", lambda: c.worker_queued("prefill-1") >= 2, poll=0.01)
        c.workers["prefill-1"][0].proc.kill()
        c.workers["prefill-1"][0].wait(30)
        c.wait("both routers lost prefill-1", c.joined_everywhere, poll=0.1)
        c.wait("a router moved requests off prefill-1",
               lambda: c.log_count("R1", PREFILL_LOST) + c.log_count("R2", PREFILL_LOST) > lost_before)

        # 4. Every stream ends; the cluster returns to idle with every live worker joined to both routers.
        load.join(time.monotonic() + STREAM_TIMEOUT_S)
        timings["streams done at"] = time.monotonic() - t_wave1
        c.check_alive()
        c.wait_idle("after the faults", deadline_s=30)
        assert c.joined_everywhere()

        problems = []
        for s in load.streams:
            cut_allowed = s.router == "R1" and s in r1_cut
            why = check_stream(s, twins[s.index], cut_allowed)
            if why:
                problems.append(why)
        completed = {r: sum(1 for s in load.streams if s.router == r and s.done_seen) for r in ("R1", "R1'", "R2")}
        totals = {r: sum(1 for s in load.streams if s.router == r) for r in ("R1", "R1'", "R2")}
        moved = {r: {"decode": c.log_count(r, DECODE_LOST), "prefill": c.log_count(r, PREFILL_LOST)}
                 for r in ("R1", "R2")}
        cut = sum(1 for s in r1_cut if not s.done_seen)
        print(f"\nchaos ({transport}): {len(load.streams)} streams x {MAX_TOKENS} tokens; completed exactly "
              f"{completed} of {totals} ({cut} R1 streams cut by its kill); requests moved off lost workers (router "
              f"log lines, R1 since its restart): {moved}; R2 streams running at R1's kill: {running_on_r2}; "
              + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())
              + f"; total {time.monotonic() - t_start:.1f} s")
        assert not problems, f"{len(problems)} bad streams:\n" + "\n".join(problems[:20])
        assert completed["R2"] == totals["R2"] and completed["R1'"] == totals["R1'"]
    finally:
        problems = c.stop()
        if problems:
            print("\nchaos: processes that did not stop cleanly:\n" + "\n\n".join(problems))
    assert not problems, "\n\n".join(problems)
