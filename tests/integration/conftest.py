"""Process fixtures for the integration suite: the real `deltaserve` binary on loopback.

Topologies:
  serve  -- `deltaserve serve` (all roles in one process, the embedded default)
  multi  -- `deltaserve router` + 1 `prefill` + 2 `decode`, each its own process, joined over CAF
  multi_ucx -- `router` + 1 `prefill` + 1 `decode` with `--transport ucx` (request states over UCX, tcp on lo;
           envelopes over CAF); used by the streaming accounting tests (fixture `cluster_with_ucx`)

Every process is started with --port 0 / --cluster-port 0; the real ports are parsed from the startup
lines on stdout. Every process is always stopped (SIGTERM, then SIGKILL after a grace period) and the
router/serve process must exit 0 after SIGTERM. stderr of every process is kept in a file and its tail
is attached to the report of any failing test.

The suite skips (with a reason) only when the binary has no `serve` command; a binary with `serve` but
without router/prefill/decode fails the multi-process tests.

Environment: DELTASERVE_BINARY (default build/release/cli/deltaserve), DELTASERVE_THREADS (default 1
per process: the multi topology runs four processes on a 2-core machine).
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BINARY = os.environ.get("DELTASERVE_BINARY", os.path.join(REPO, "build", "release", "cli", "deltaserve"))

STARTUP_DEADLINE_S = 60.0  # the built-in model is generated on first use; tiny, but leave room
STOP_GRACE_S = 30.0  # SIGTERM -> exit; then SIGKILL

HTTP_RE = re.compile(r"deltaserve: http listening on http://([^\s:]+|\[[^\]]+\]):(\d+)")
CLUSTER_RE = re.compile(r"deltaserve: cluster listening on ([^\s:]+|\[[^\]]+\]):(\d+)")
PREFILL_JOINED_RE = re.compile(r"deltaserve: prefill worker joined (\S+)")
DECODE_JOINED_RE = re.compile(r"deltaserve: decode worker joined (\S+)")

_LIVE: list["DsProcess"] = []  # every process started in this session (stderr tails go into failure reports)


# ---------------------------------------------------------------------------------------------
# The binary


def require_binary() -> None:
    if not os.path.exists(BINARY):
        pytest.fail(f"deltaserve binary not found at {BINARY} (build it, or set DELTASERVE_BINARY)")


@functools.lru_cache(maxsize=None)
def binary_commands() -> frozenset[str]:
    """Subcommand names listed by `deltaserve --help`."""
    if not os.path.exists(BINARY):
        return frozenset()
    out = subprocess.run([BINARY, "--help"], capture_output=True, text=True, timeout=30)
    text = out.stdout + out.stderr
    names = set()
    in_sub = False
    for line in text.splitlines():
        if line.strip().lower().startswith("subcommands"):
            in_sub = True
            continue
        if in_sub:
            m = re.match(r"^\s+([a-z][a-z0-9-]*)\b", line)
            if m:
                names.add(m.group(1))
    return frozenset(names)


def require_serve() -> None:
    require_binary()
    if "serve" not in binary_commands():
        pytest.skip(f"{BINARY} has no `serve` command yet (the cluster slice has not landed): "
                    "integration tests skipped")


def require_multi() -> None:
    require_serve()
    missing = {"router", "prefill", "decode"} - binary_commands()
    if missing:
        pytest.fail(f"{BINARY} has `serve` but lacks {sorted(missing)}: the multi-process topology cannot start")


def base_env(home: str) -> dict[str, str]:
    env = dict(os.environ)
    env["DELTASERVE_HOME"] = home
    env.setdefault("DELTASERVE_THREADS", "1")
    return env


def run_cli(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    require_binary()
    proc = subprocess.run([BINARY, *args], capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, f"deltaserve {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}"
    return proc


# ---------------------------------------------------------------------------------------------
# One process


class DsProcess:
    """A running `deltaserve` subcommand: stdout lines collected by a thread, stderr in a file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], logdir: str):
        self.name = name
        self.args = [BINARY, *args]
        self.stderr_path = os.path.join(logdir, f"{name}.stderr")
        self.stdout_path = os.path.join(logdir, f"{name}.stdout")
        self._stderr = open(self.stderr_path, "wb")
        self._stdout_log = open(self.stdout_path, "w", encoding="utf-8", errors="replace")
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=self._stderr, env=env,
                                     stdin=subprocess.DEVNULL)
        self.returncode: int | None = None
        self._reader = threading.Thread(target=self._read, name=f"{name}-stdout", daemon=True)
        self._reader.start()
        _LIVE.append(self)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self._stdout_log.write(line + "\n")
            self._stdout_log.flush()
            with self._cond:
                self.lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_line(self, pattern: re.Pattern, deadline: float, count: int = 1) -> list[re.Match]:
        """Waits until `count` stdout lines match; fails with the process's output at the deadline."""
        with self._cond:
            while True:
                found = [m for m in (pattern.search(line) for line in self.lines) if m]
                if len(found) >= count:
                    return found
                if self.proc.poll() is not None and not self._reader.is_alive():
                    pytest.fail(f"deltaserve {self.name} exited ({self.proc.returncode}) before printing "
                                f"{pattern.pattern!r}\n{self.describe()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.fail(f"deltaserve {self.name}: no {pattern.pattern!r} on stdout within the startup "
                                f"deadline\n{self.describe()}")
                self._cond.wait(min(left, 0.2))

    def count_lines(self, pattern: re.Pattern) -> int:
        with self._cond:
            return sum(1 for line in self.lines if pattern.search(line))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        try:
            self.returncode = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        return self.returncode

    def stop(self, grace: float = STOP_GRACE_S) -> tuple[int, bool]:
        """SIGTERM, wait up to `grace`, then SIGKILL. Returns (exit code, killed)."""
        killed = False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            if self.wait(grace) is None:
                killed = True
                self.proc.kill()
                self.wait(10)
        self.returncode = self.proc.returncode
        self._reader.join(timeout=5)
        self._stderr.close()
        return self.returncode, killed

    def stderr_tail(self, limit: int = 6000) -> str:
        try:
            with open(self.stderr_path, "rb") as f:
                data = f.read()
        except OSError:
            return "<no stderr file>"
        return data[-limit:].decode("utf-8", errors="replace")

    def describe(self) -> str:
        with self._cond:
            out = "\n".join(self.lines[-40:])
        return (f"command: {' '.join(self.args)}\n--- stdout (tail) ---\n{out}\n"
                f"--- stderr (tail) ---\n{self.stderr_tail()}")


# Prompts shared by the API and load tests: multilingual, digits, code, contractions.
PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Привет, мир! Как дела?",
    "你好，世界！这是一个测试。",
    "def f(x): return x * 2",
    "1 2 3 4 5 6 7 8 9 10",
    "Kimi Delta Attention keeps a fixed-size state per head.",
    "It's 2024-05-17; they'll say we've done it.",
]


def http_get(url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def wait_ready(url: str, deadline: float, procs: list[DsProcess]) -> None:
    last = None
    while time.monotonic() < deadline:
        for p in procs:
            if not p.alive():
                pytest.fail(f"deltaserve {p.name} exited ({p.proc.returncode}) during startup\n{p.describe()}")
        try:
            status, _, body = http_get(url + "/ready", timeout=2)
            if status == 200:
                return
            last = f"{status} {body[:200]!r}"
        except OSError as e:
            last = repr(e)
        time.sleep(0.1)
    pytest.fail(f"{url}/ready not 200 within the deadline (last: {last})\n" +
                "\n".join(p.describe() for p in procs))


# ---------------------------------------------------------------------------------------------
# A cluster (one topology)


class Cluster:
    def __init__(self, topology: str, env: dict[str, str], logdir: str, model_dir: str | None,
                 serve_flags: list[str] | None = None, router_flags: list[str] | None = None,
                 prefill_flags: list[str] | None = None, decode_flags: list[str] | None = None,
                 decode_workers: int = 2, tag: str = "", api_key: str | None = None):
        self.topology = topology
        self.env = env
        self.model_dir = model_dir
        self.procs: list[DsProcess] = []
        self.front: DsProcess | None = None  # serve or router: asserted to exit 0 after SIGTERM
        self.api_key = api_key
        self.url = ""
        self.host = ""
        self.port = 0
        self._stopped = False
        model = ["--model", model_dir] if model_dir else []
        deadline = time.monotonic() + STARTUP_DEADLINE_S
        name = f"{topology}{tag}"
        try:
            if topology == "serve":
                require_serve()
                self.front = DsProcess(f"{name}-serve", ["serve", *model, "--host", "127.0.0.1", "--port", "0",
                                                         *(serve_flags or [])], env, logdir)
                self.procs.append(self.front)
                self._parse_http(deadline)
            elif topology in ("multi", "multi_ucx"):
                require_multi()
                if topology == "multi_ucx":
                    ucx = ["--transport", "ucx", "--ucx-tls", "tcp,self", "--ucx-net-devices", "lo"]
                    prefill_flags = [*ucx, *(prefill_flags or [])]
                    decode_flags = [*ucx, *(decode_flags or [])]
                self.front = DsProcess(f"{name}-router",
                                       ["router", *model, "--host", "127.0.0.1", "--port", "0",
                                        "--cluster-host", "127.0.0.1", "--cluster-port", "0",
                                        *(router_flags or [])], env, logdir)
                self.procs.append(self.front)
                m = self.front.wait_line(CLUSTER_RE, deadline)[0]
                join = f"{m.group(1)}:{m.group(2)}"
                self._parse_http(deadline)
                workers = [DsProcess(f"{name}-prefill0", ["prefill", *model, "--join", join,
                                                          *(prefill_flags or [])], env, logdir)]
                for i in range(decode_workers):
                    workers.append(DsProcess(f"{name}-decode{i}", ["decode", *model, "--join", join,
                                                                   *(decode_flags or [])], env, logdir))
                self.procs.extend(workers)
                # The "joined" lines may be printed by the worker or by the router: accept either.
                self._wait_joined(PREFILL_JOINED_RE, [workers[0]], deadline)
                self._wait_joined(DECODE_JOINED_RE, workers[1:], deadline)
            else:
                raise ValueError(topology)
            wait_ready(self.url, deadline, self.procs)
            self.model_id = self._model_id()
        except BaseException:
            self.stop(check=False)
            raise

    def _parse_http(self, deadline: float) -> None:
        assert self.front is not None
        m = self.front.wait_line(HTTP_RE, deadline)[0]
        self.host = m.group(1).strip("[]")
        self.port = int(m.group(2))
        assert self.port > 0, f"http port parsed as {self.port}"
        self.url = f"http://{m.group(1)}:{self.port}"

    def _wait_joined(self, pattern: re.Pattern, workers: list[DsProcess], deadline: float) -> None:
        assert self.front is not None
        while True:
            on_router = self.front.count_lines(pattern)
            on_workers = sum(1 for w in workers if w.count_lines(pattern) > 0)
            if max(on_router, on_workers) >= len(workers):
                return
            for p in self.procs:
                if not p.alive():
                    pytest.fail(f"deltaserve {p.name} exited ({p.proc.returncode}) during startup\n{p.describe()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{len(workers)} x {pattern.pattern!r} not printed within the startup deadline\n" +
                            "\n".join(p.describe() for p in self.procs))
            time.sleep(0.05)

    def _model_id(self) -> str:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        status, _, body = http_get(self.url + "/v1/models", headers=auth)
        assert status == 200, f"GET /v1/models: {status} {body[:300]!r}"
        data = json.loads(body)
        assert data.get("data"), f"GET /v1/models lists no model: {data}"
        return data["data"][0]["id"]

    def client(self, **kw):
        import openai

        kw.setdefault("api_key", "sk-no-key")
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 30.0)
        return openai.OpenAI(base_url=self.url + "/v1", **kw)

    def async_client(self, **kw):
        import openai

        kw.setdefault("api_key", "sk-no-key")
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 120.0)
        return openai.AsyncOpenAI(base_url=self.url + "/v1", **kw)

    def check_alive(self) -> None:
        for p in self.procs:
            assert p.alive(), f"deltaserve {p.name} died (exit {p.proc.returncode})\n{p.describe()}"

    def stop(self, check: bool = True) -> list[str]:
        """Stops the front first (it drains), then the workers. Returns problems found."""
        if self._stopped:
            return []
        self._stopped = True
        problems = []
        ordered = ([self.front] if self.front else []) + [p for p in self.procs if p is not self.front]
        for p in ordered:
            rc, killed = p.stop()
            if p is self.front and (rc != 0 or killed):
                problems.append(f"deltaserve {p.name}: exit {rc}{' (SIGKILLed after the grace period)' if killed else ''}"
                                f" after SIGTERM, expected 0\n{p.describe()}")
            elif rc != 0 or killed:
                # Workers: reported, not asserted (the brief asserts exit 0 for serve/router only).
                print(f"\nnote: deltaserve {p.name} exited {rc}{' (killed)' if killed else ''} after SIGTERM")
        if check and problems:
            pytest.fail("\n\n".join(problems))
        return problems


# ---------------------------------------------------------------------------------------------
# The reference: `deltaserve generate` on the same checkpoint


class Reference:
    """Greedy transcripts from `deltaserve generate` (same checkpoint, same N-1 prefill split)."""

    def __init__(self, env: dict[str, str], model_dir: str | None):
        self.env = env
        self.model_dir = model_dir
        self._cache: dict[tuple, dict] = {}
        self._lock = threading.Lock()

    def get(self, prompt: str, max_tokens: int, chat: bool = False, ignore_eos: bool = False) -> dict:
        """{'tokens': [{token_id, bytes, logprob, token}], 'text': str, 'finish_reason': 'stop'|'length'}.

        Without --ignore-eos, as the server stops at <|im_end|>/eos; the stop token, when hit, is the
        last entry of 'tokens' (generate reports it) and is not part of 'text'.
        """
        key = (prompt, max_tokens, chat, ignore_eos)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        model = ["--model", self.model_dir] if self.model_dir else []
        flags = [*model, "--prompt", prompt, "--max-tokens", str(max_tokens), *(["--chat"] if chat else []),
                 *(["--ignore-eos"] if ignore_eos else [])]
        ids = run_cli(self.env, "generate", *flags, "--logprobs", "0")
        tokens = [json.loads(line) for line in ids.stdout.splitlines() if line.strip()]
        m = re.search(r"finish_reason (\w+)", ids.stderr)
        assert m, ids.stderr
        # Bytes, not text mode: universal newlines would turn a generated "\r\n" into "\n".
        raw = subprocess.run([BINARY, "generate", *flags], capture_output=True, env=self.env, timeout=120)
        assert raw.returncode == 0, raw.stderr.decode(errors="replace")
        out = raw.stdout.decode("utf-8")
        assert out.endswith("\n"), repr(out[-20:])
        ref = {"tokens": tokens, "text": out[:-1], "finish_reason": m.group(1)}
        with self._lock:
            self._cache[key] = ref
        return ref

    def prompt_tokens(self, prompt: str, chat: bool = False) -> int:
        """Prompt length as the server counts it: tokenize (no BOS) + BOS for completions."""
        model = ["--model", self.model_dir] if self.model_dir else []
        out = run_cli(self.env, "tokenize", *model, *(["--chat"] if chat else []), prompt)
        n = len(json.loads(out.stdout))
        return n if chat else n + 1


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="session")
def ds_home():
    with tempfile.TemporaryDirectory(prefix="deltaserve-it-home-") as d:
        yield d


@pytest.fixture(scope="session")
def ds_env(ds_home):
    return base_env(ds_home)


@pytest.fixture(scope="session")
def logdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("logs"))


@pytest.fixture(scope="session")
def model_dir(ds_env, tmp_path_factory):
    require_serve()
    d = str(tmp_path_factory.mktemp("model") / "tiny-linear")
    run_cli(ds_env, "make-model", "--preset", "tiny-linear", "--out", d)
    return d


@pytest.fixture(scope="session")
def reference(ds_env, model_dir):
    return Reference(ds_env, model_dir)


@pytest.fixture(scope="session")
def serve_cluster(ds_env, logdir, model_dir):
    c = Cluster("serve", ds_env, logdir, model_dir)
    yield c
    c.stop()


@pytest.fixture(scope="session")
def multi_cluster(ds_env, logdir, model_dir):
    c = Cluster("multi", ds_env, logdir, model_dir)
    yield c
    c.stop()


@pytest.fixture(scope="module")  # not kept for the whole session: the UCX engines poll while idle
def multi_ucx_cluster(ds_env, logdir, model_dir):
    c = Cluster("multi_ucx", ds_env, logdir, model_dir, decode_workers=1)
    yield c
    c.stop()


@pytest.fixture(params=["serve", "multi", "multi_ucx"])
def cluster_with_ucx(request) -> Cluster:
    """`cluster` plus the UCX handoff topology (for the streaming correctness tests only: CI time)."""
    c = request.getfixturevalue(f"{request.param}_cluster")
    c.check_alive()
    return c


@pytest.fixture(params=["serve", "multi"])
def cluster(request) -> Cluster:
    c = request.getfixturevalue(f"{request.param}_cluster")
    c.check_alive()
    return c


@pytest.fixture
def make_cluster(ds_env, logdir, model_dir):
    """Starts extra clusters for one test; stops them (asserting exit 0) at its end unless already stopped."""
    made: list[Cluster] = []

    def make(topology: str, **kw) -> Cluster:
        kw.setdefault("tag", f"-x{len(_LIVE)}")
        kw.setdefault("model_dir", model_dir)
        c = Cluster(topology, ds_env, logdir, **kw)
        made.append(c)
        return c

    yield make
    problems = []
    for c in made:
        problems += c.stop(check=False)
    if problems:
        pytest.fail("\n\n".join(problems))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _LIVE:
        for p in _LIVE[-12:]:
            report.sections.append((f"deltaserve {p.name} stderr (tail)", p.stderr_tail(3000)))
