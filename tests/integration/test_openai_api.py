"""The OpenAI-compatible API end to end, driven by the official `openai` SDK and by raw HTTP, on both
topologies (single-process `serve`; router + 1 prefill + 2 decode processes).

Greedy output must equal `deltaserve generate` on the same checkpoint token by token (the P/D handoff
is exact); every stream goes through the token accounting of streamcheck.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import socket
import threading
import time

import openai
import pytest
import requests

from conftest import PROMPTS, Cluster, http_get
from streamcheck import (_diff, check_token_strings, check_tokens_match, collect_stream, expected_token_counts)

MAX_TOKENS = 24


def pid(prompt: str) -> str:
    return f"p{PROMPTS.index(prompt)}"


def user(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def assert_error(resp: requests.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    """An OpenAI error object with the given status (and param/code when given)."""
    assert resp.status_code == status, f"expected {status}, got {resp.status_code}: {resp.text[:500]}"
    try:
        body = resp.json()
    except ValueError:
        raise AssertionError(f"error body is not JSON: {resp.text[:500]!r}")
    err = body.get("error")
    assert isinstance(err, dict), f"no error object: {body}"
    for key in ("message", "type", "param", "code"):
        assert key in err, f"error object lacks {key!r}: {err}"
    assert isinstance(err["message"], str) and err["message"], err
    if param is not None:
        assert err["param"] == param, f"param {err['param']!r}, expected {param!r}: {err}"
    if code is not None:
        assert err["code"] == code, f"code {err['code']!r}, expected {code!r}: {err}"
    assert resp.headers.get("Content-Type", "").startswith("application/json"), resp.headers
    return err


# ---------------------------------------------------------------------------------------------
# Discovery and probes


def test_models(cluster: Cluster):
    client = cluster.client()
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids and ids[0] == cluster.model_id
    m = models.data[0]
    assert m.object == "model" and isinstance(m.created, int) and m.owned_by
    raw = requests.get(cluster.url + "/v1/models", timeout=10).json()
    assert raw["object"] == "list"


def test_health_and_ready(cluster: Cluster):
    for path in ("/health", "/ready"):
        status, _, body = http_get(cluster.url + path)
        assert status == 200, f"GET {path}: {status} {body[:200]!r}"


def test_unknown_route_is_404_error_object(cluster: Cluster):
    assert_error(requests.get(cluster.url + "/v1/nothing-here", timeout=10), 404)


# ---------------------------------------------------------------------------------------------
# Greedy exactness against `deltaserve generate`, non-streaming


@pytest.mark.parametrize("prompt", PROMPTS[:3], ids=pid)
def test_completion_greedy_equals_generate(cluster_with_ucx: Cluster, reference, prompt):
    cluster = cluster_with_ucx
    ref = reference.get(prompt, MAX_TOKENS)
    resp = cluster.client().completions.create(model=cluster.model_id, prompt=prompt, max_tokens=MAX_TOKENS,
                                               temperature=0, logprobs=1)
    assert resp.object == "text_completion" and resp.id
    assert len(resp.choices) == 1
    c = resp.choices[0]
    assert c.text == ref["text"], f"completion text differs from generate: {c.text!r} vs {ref['text']!r}"
    assert c.finish_reason == ref["finish_reason"]
    check_token_strings(c.logprobs.tokens, ref, "completions logprobs")
    assert resp.usage.completion_tokens == len(c.logprobs.tokens), (resp.usage, len(c.logprobs.tokens))
    assert resp.usage.prompt_tokens == reference.prompt_tokens(prompt)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


@pytest.mark.parametrize("prompt", PROMPTS[3:6], ids=pid)
def test_chat_greedy_equals_generate(cluster_with_ucx: Cluster, reference, prompt):
    cluster = cluster_with_ucx
    ref = reference.get(prompt, MAX_TOKENS, chat=True)
    resp = cluster.client().chat.completions.create(model=cluster.model_id, messages=user(prompt),
                                                    max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
                                                    top_logprobs=0)
    assert resp.object == "chat.completion" and resp.id
    c = resp.choices[0]
    assert c.message.role == "assistant"
    assert (c.message.content or "") == ref["text"], f"chat text differs: {c.message.content!r} vs {ref['text']!r}"
    assert c.finish_reason == ref["finish_reason"]
    got = [bytes(e.bytes) for e in c.logprobs.content]
    check_tokens_match(got, ref, "chat logprobs")
    assert resp.usage.completion_tokens == len(got)
    assert resp.usage.prompt_tokens == reference.prompt_tokens(prompt, chat=True)


def test_completion_ignore_eos_extension(cluster: Cluster, reference):
    prompt = PROMPTS[6]  # generate stops at <|im_end|> after ~97 tokens without --ignore-eos
    ref = reference.get(prompt, 160, ignore_eos=True)
    resp = cluster.client().completions.create(model=cluster.model_id, prompt=prompt, max_tokens=160, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert resp.choices[0].text == ref["text"]
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 160


# ---------------------------------------------------------------------------------------------
# Streaming with token accounting


@pytest.mark.parametrize("prompt", [PROMPTS[0], PROMPTS[7]], ids=pid)
def test_completion_stream_accounting(cluster_with_ucx: Cluster, reference, prompt):
    cluster = cluster_with_ucx
    ref = reference.get(prompt, MAX_TOKENS)
    stream = cluster.client().completions.create(model=cluster.model_id, prompt=prompt, max_tokens=MAX_TOKENS,
                                                 temperature=0, logprobs=1, stream=True,
                                                 stream_options={"include_usage": True})
    r = collect_stream(stream, "completion", expected_text={0: ref["text"]})
    c = r.choices[0]
    assert c.text == ref["text"]
    assert c.finish_reason == ref["finish_reason"]
    check_token_strings(c.token_strs, ref, "streamed completions logprobs")
    assert r.usage.completion_tokens == len(c.token_strs), "usage.completion_tokens != tokens delivered"
    assert r.usage.prompt_tokens == reference.prompt_tokens(prompt)


@pytest.mark.parametrize("prompt", [PROMPTS[1], PROMPTS[3]], ids=pid)
def test_chat_stream_accounting(cluster_with_ucx: Cluster, reference, prompt):
    cluster = cluster_with_ucx
    ref = reference.get(prompt, MAX_TOKENS, chat=True)
    stream = cluster.client().chat.completions.create(model=cluster.model_id, messages=user(prompt),
                                                      max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
                                                      top_logprobs=0, stream=True,
                                                      stream_options={"include_usage": True})
    r = collect_stream(stream, "chat", expected_text={0: ref["text"]})
    c = r.choices[0]
    assert c.text == ref["text"]
    assert c.finish_reason == ref["finish_reason"]
    check_tokens_match(c.token_bytes, ref, "streamed chat logprobs")
    assert r.usage.completion_tokens == len(c.token_bytes), "usage.completion_tokens != tokens delivered"
    assert r.usage.prompt_tokens == reference.prompt_tokens(prompt, chat=True)


def test_chat_stream_long_ignore_eos(cluster_with_ucx: Cluster, reference):
    """A longer stream (200 tokens, no early stop): every token checked, usage exact."""
    cluster = cluster_with_ucx
    prompt = PROMPTS[4]
    ref = reference.get(prompt, 200, chat=True, ignore_eos=True)
    stream = cluster.client().chat.completions.create(model=cluster.model_id, messages=user(prompt), max_tokens=200,
                                                      temperature=0, logprobs=True, stream=True,
                                                      stream_options={"include_usage": True},
                                                      extra_body={"ignore_eos": True})
    r = collect_stream(stream, "chat", expected_text={0: ref["text"]})
    check_tokens_match(r.choices[0].token_bytes, ref, "long chat stream")
    assert len(r.choices[0].token_bytes) == 200 == r.usage.completion_tokens
    assert r.choices[0].text == ref["text"] and r.choices[0].finish_reason == "length"


def test_stream_without_logprobs_or_usage(cluster: Cluster, reference):
    prompt = PROMPTS[2]
    ref = reference.get(prompt, MAX_TOKENS, chat=True)
    stream = cluster.client().chat.completions.create(model=cluster.model_id, messages=user(prompt),
                                                      max_completion_tokens=MAX_TOKENS, temperature=0, stream=True)
    r = collect_stream(stream, "chat", expected_text={0: ref["text"]}, include_usage=False)
    assert r.usage is None
    assert r.choices[0].text == ref["text"] and r.choices[0].finish_reason == ref["finish_reason"]


def test_raw_sse_framing(cluster: Cluster):
    """The wire format: text/event-stream, `data: {...}` events separated by blank lines, `data: [DONE]` last."""
    body = {"model": cluster.model_id, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stream": True}
    with requests.post(cluster.url + "/v1/completions", json=body, stream=True, timeout=30) as resp:
        assert resp.status_code == 200, resp.text
        assert resp.headers.get("Content-Type", "").startswith("text/event-stream"), resp.headers
        raw = resp.raw.read().decode("utf-8")
    events = [e for e in raw.replace("\r\n", "\n").split("\n\n") if e.strip()]
    assert events[-1].strip() == "data: [DONE]", events[-3:]
    for e in events[:-1]:
        assert e.startswith("data: "), repr(e)
        json.loads(e[len("data: "):])
    assert raw.count("[DONE]") == 1


# ---------------------------------------------------------------------------------------------
# n, seeds, stop, max_tokens


def _completion_tokens_by_choice(resp) -> dict[int, int]:
    return {c.index: len(c.logprobs.tokens) for c in resp.choices}


def test_n2_seeded_is_deterministic_and_stream_matches(cluster: Cluster):
    client = cluster.client()
    kw = dict(model=cluster.model_id, prompt=PROMPTS[5], max_tokens=12, temperature=1.0, seed=1234, n=2, logprobs=1)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    ta = {c.index: c.text for c in a.choices}
    tb = {c.index: c.text for c in b.choices}
    assert ta == tb, f"same seed, different output: {ta} vs {tb}"
    assert ta[0] != ta[1], f"n=2 with one seed gave two identical samples: {ta}"
    assert a.usage.completion_tokens == sum(_completion_tokens_by_choice(a).values())
    s = collect_stream(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}),
                       "completion", expected_text=ta)
    assert {i: r.text for i, r in s.choices.items()} == ta, "stream and non-stream differ for the same seed"
    assert {i: r.finish_reason for i, r in s.choices.items()} == {c.index: c.finish_reason for c in a.choices}
    assert s.usage.completion_tokens == sum(len(r.token_strs) for r in s.choices.values())


def test_n2_greedy_both_equal_reference(cluster_with_ucx: Cluster, reference):
    cluster = cluster_with_ucx
    prompt = PROMPTS[6]
    ref = reference.get(prompt, 16, chat=True)
    resp = cluster.client().chat.completions.create(model=cluster.model_id, messages=user(prompt), max_tokens=16,
                                                    temperature=0, n=2)
    assert len(resp.choices) == 2
    for c in resp.choices:
        assert c.message.content == ref["text"] and c.finish_reason == ref["finish_reason"]
    assert resp.usage.completion_tokens in {2 * k for k in expected_token_counts(ref)}


def _stop_case(reference, chat: bool) -> tuple[str, str, str]:
    """A (prompt, stop, expected text) triple: the stop string first occurs mid-text in the greedy output."""
    for prompt in PROMPTS:
        text = reference.get(prompt, 40, chat=chat, ignore_eos=True)["text"]
        for k in range(3, len(text) - 2):
            s = text[k:k + 2]
            if s.isascii() and s.isalnum() and text.find(s) == k:
                return prompt, s, text[:k]
    pytest.fail("no usable stop string in the reference transcripts")


@pytest.mark.parametrize("stream", [False, True], ids=["nonstream", "stream"])
@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stop_string(cluster: Cluster, reference, kind, stream):
    prompt, stop, want = _stop_case(reference, chat=(kind == "chat"))
    client = cluster.client()
    common = dict(model=cluster.model_id, max_tokens=40, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    if kind == "chat":
        call = lambda **kw: client.chat.completions.create(messages=user(prompt), **common, **kw)  # noqa: E731
    else:
        call = lambda **kw: client.completions.create(prompt=prompt, **common, **kw)  # noqa: E731
    if stream:
        r = collect_stream(call(stream=True, stream_options={"include_usage": True}), kind, expected_text={0: want})
        text, finish, usage = r.choices[0].text, r.choices[0].finish_reason, r.usage
    else:
        resp = call()
        c = resp.choices[0]
        text = c.message.content if kind == "chat" else c.text
        finish, usage = c.finish_reason, resp.usage
    assert text == want, f"stop {stop!r}: got {text!r}, expected {want!r}"
    assert stop not in text
    assert finish == "stop"
    assert 1 <= usage.completion_tokens < 40


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_max_tokens_gives_length(cluster: Cluster, reference, kind):
    client = cluster.client()
    if kind == "chat":
        ref = reference.get(PROMPTS[7], 5, chat=True, ignore_eos=True)
        resp = client.chat.completions.create(model=cluster.model_id, messages=user(PROMPTS[7]),
                                              max_completion_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        text = resp.choices[0].message.content
    else:
        ref = reference.get(PROMPTS[7], 5, ignore_eos=True)
        resp = client.completions.create(model=cluster.model_id, prompt=PROMPTS[7], max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})
        text = resp.choices[0].text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 5
    assert text == ref["text"]


def test_completion_default_max_tokens_is_16(cluster: Cluster):
    resp = cluster.client().completions.create(model=cluster.model_id, prompt=PROMPTS[7], temperature=0,
                                               extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 16 and resp.choices[0].finish_reason == "length"


# ---------------------------------------------------------------------------------------------
# logprobs shapes


def test_chat_logprobs_shape(cluster: Cluster, reference):
    prompt = PROMPTS[0]
    ref = reference.get(prompt, 8, chat=True, ignore_eos=True)
    resp = cluster.client().chat.completions.create(model=cluster.model_id, messages=user(prompt), max_tokens=8,
                                                    temperature=0, logprobs=True, top_logprobs=3,
                                                    extra_body={"ignore_eos": True})
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == 8
    for i, (e, r) in enumerate(zip(content, ref["tokens"])):
        assert bytes(e.bytes) == bytes(r["bytes"]), f"token {i}"
        assert e.logprob <= 0 and math.isfinite(e.logprob)
        assert abs(e.logprob - r["logprob"]) < 1e-3, f"token {i}: logprob {e.logprob} vs generate {r['logprob']}"
        assert len(e.top_logprobs) == 3, e.top_logprobs
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True), tops
        assert bytes(e.top_logprobs[0].bytes) == bytes(e.bytes), "greedy: the chosen token is the best one"
        assert abs(tops[0] - e.logprob) < 1e-6
    # Without logprobs: none reported.
    resp = cluster.client().chat.completions.create(model=cluster.model_id, messages=user(prompt), max_tokens=4,
                                                    temperature=0)
    assert resp.choices[0].logprobs is None


def test_completion_logprobs_shape(cluster: Cluster):
    resp = cluster.client().completions.create(model=cluster.model_id, prompt=PROMPTS[1], max_tokens=8,
                                               temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    n = resp.usage.completion_tokens
    assert n == 8
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(x <= 0 for x in lp.token_logprobs)
    for i, top in enumerate(lp.top_logprobs):
        assert 1 <= len(top) <= 3, top  # a dict: token strings that collide merge
        assert max(top.values()) >= lp.token_logprobs[i] - 1e-6
    assert lp.text_offset == sorted(lp.text_offset), lp.text_offset


# ---------------------------------------------------------------------------------------------
# Validation and errors (raw HTTP)


def test_validation_errors(cluster: Cluster):
    u = cluster.url
    chat = u + "/v1/chat/completions"
    comp = u + "/v1/completions"
    m = cluster.model_id
    hdr = {"Content-Type": "application/json"}
    assert_error(requests.post(chat, data=b'{"model": "x", "messages": [', headers=hdr, timeout=10), 400)
    assert_error(requests.post(chat, data=b'{"model": "' + m.encode() + b'", "messages": [{"role": "user", '
                               b'"content": "\xff\xfe"}], "max_tokens": 4}', headers=hdr, timeout=10), 400)
    assert_error(requests.post(chat, json={"model": m, "messages": user("hi"), "max_tokens": "ten"}, timeout=10),
                 400, param="max_tokens")
    assert_error(requests.post(chat, json={"model": m, "messages": "hi"}, timeout=10), 400, param="messages")
    assert_error(requests.post(chat, json={"model": m}, timeout=10), 400, param="messages")
    assert_error(requests.post(chat, json={"model": m, "messages": user("hi"), "temperature": 5, "max_tokens": 4}, timeout=10),
                 400, param="temperature")
    assert_error(requests.post(chat, json={"model": m, "messages": user("hi"), "top_p": 1.5, "max_tokens": 4}, timeout=10),
                 400, param="top_p")
    assert_error(requests.post(comp, json={"model": m, "prompt": "hi", "n": 0}, timeout=10), 400, param="n")
    assert_error(requests.post(comp, json={"model": m, "prompt": "hi", "max_tokens": 0}, timeout=10),
                 400, param="max_tokens")
    assert_error(requests.post(comp, json={"model": m, "prompt": "hi", "logprobs": 99}, timeout=10),
                 400, param="logprobs")
    assert_error(requests.post(comp, json={"model": m, "prompt": [999999999]}, timeout=10), 400)
    assert_error(requests.post(comp, json={"model": "no-such-model", "prompt": "hi"}, timeout=10), 404,
                 code="model_not_found")
    cluster.check_alive()


def test_errors_through_the_sdk(cluster: Cluster):
    client = cluster.client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=user("hi"))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=cluster.model_id, messages=user("hi"), temperature=3.5, max_tokens=4)
    assert e.value.param == "temperature"


def test_context_length_exceeded(cluster: Cluster):
    m = cluster.model_id
    comp = cluster.url + "/v1/completions"
    # max_tokens beyond the context (model_max_length of the tiny model is 65536)
    assert_error(requests.post(comp, json={"model": m, "prompt": "hi", "max_tokens": 10_000_000}, timeout=30), 400,
                 code="context_length_exceeded")
    # a prompt alone longer than the context (~100k tokens, ~300 KB body)
    long_prompt = "1 2 3 " * 35_000
    assert_error(requests.post(comp, json={"model": m, "prompt": long_prompt, "max_tokens": 1}, timeout=60), 400,
                 code="context_length_exceeded")
    assert_error(requests.post(cluster.url + "/v1/chat/completions",
                               json={"model": m, "messages": user(long_prompt), "max_tokens": 4}, timeout=60), 400,
                 code="context_length_exceeded")
    cluster.check_alive()


def _raw_exchange(cluster: Cluster, head: bytes, timeout: float = 15.0) -> tuple[int, dict, bytes, float]:
    """Sends raw bytes, reads one response; returns (status, headers, body, seconds to the status line)."""
    t0 = time.monotonic()
    with socket.create_connection((cluster.host, cluster.port), timeout=timeout) as s:
        s.sendall(head)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        elapsed = time.monotonic() - t0
        head_part, _, body = data.partition(b"\r\n\r\n")
        lines = head_part.decode("latin-1").split("\r\n")
        assert lines and lines[0].startswith("HTTP/1."), f"no HTTP response: {data[:300]!r}"
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        n = int(headers.get("content-length", "0") or 0)
        s.settimeout(5)
        try:
            while len(body) < n:
                chunk = s.recv(65536)
                if not chunk:
                    break
                body += chunk
        except OSError:
            pass
    return status, headers, body, elapsed


def test_413_body_too_large_checked_before_reading(cluster: Cluster):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {cluster.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {10**12}\r\n\r\n").encode()
    status, headers, body, elapsed = _raw_exchange(cluster, head)
    assert status == 413, f"huge Content-Length without a body: {status} {body[:300]!r}"
    assert elapsed < 10, "the 413 came only after a timeout: the body limit is not checked before reading"
    assert json.loads(body)["error"]["code"] == "request_too_large"
    cluster.check_alive()


def test_431_header_too_large(cluster: Cluster):
    head = (f"GET /health HTTP/1.1\r\nHost: {cluster.host}\r\nX-Big: {'a' * 200_000}\r\n\r\n").encode()
    try:
        status, _, body, _ = _raw_exchange(cluster, head)
    except (ConnectionResetError, BrokenPipeError) as e:
        pytest.fail(f"oversized header: connection dropped ({e!r}) instead of a 431 response")
    assert status == 431, f"oversized header: {status} {body[:300]!r}"
    cluster.check_alive()


def test_long_prompt_under_the_limit_is_accepted(cluster: Cluster):
    """The body limit is sized for long prompts, not Beast's 1 MiB default: a ~1.2 MB body that
    tokenizes within the context is accepted."""
    prompt = "é " * 400_000  # 1.2 MB of UTF-8, short words (no giant BPE word)
    r = requests.post(cluster.url + "/v1/completions",
                      json={"model": cluster.model_id, "prompt": prompt, "max_tokens": 1}, timeout=120)
    assert r.status_code in (200, 400), r.text[:300]
    if r.status_code == 400:
        assert r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]


# ---------------------------------------------------------------------------------------------
# API keys (built-in model, no --model: also checks the embedded default and DELTASERVE_HOME)


def test_api_keys(make_cluster, tmp_path, ds_env):
    from conftest import Reference

    key = "sk-acme-0123456789abcdef"
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"tenants": [{"name": "acme", "api_key_sha256": hashlib.sha256(key.encode()).hexdigest()}]}))
    c = make_cluster("serve", model_dir=None, serve_flags=["--api-keys", str(keys)], api_key=key)
    url = c.url + "/v1/completions"
    body = {"model": c.model_id, "prompt": "Hello world", "max_tokens": 4, "temperature": 0}
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Basic Zm9vOmJhcg=="},
                    {"Authorization": "Bearer " + key[:-1]}):
        r = requests.post(url, json=body, headers=headers, timeout=10)
        assert_error(r, 401)
        assert r.headers.get("WWW-Authenticate", "").startswith("Bearer"), r.headers
    r = requests.get(c.url + "/v1/models", timeout=10)
    assert r.status_code == 401 and "WWW-Authenticate" in r.headers
    with pytest.raises(openai.AuthenticationError):
        c.client(api_key="sk-wrong").completions.create(**body)
    # Probes stay open for kubelets.
    assert http_get(c.url + "/health")[0] == 200
    assert http_get(c.url + "/ready")[0] == 200
    ok = c.client(api_key=key).completions.create(**body)
    ref = Reference(ds_env, None).get("Hello world", 4)
    assert ok.choices[0].text == ref["text"], "built-in model: server and generate disagree"
    # Keys are never logged.
    for p in c.procs:
        with open(p.stderr_path, "rb") as f:
            err = f.read()
        with open(p.stdout_path, "rb") as f:
            out = f.read()
        for secret in (key.encode(), b"sk-wrong"):
            assert secret not in err and secret not in out, f"{p.name} logged an API key"


# ---------------------------------------------------------------------------------------------
# SIGTERM drain


@pytest.mark.parametrize("topology", ["serve", "multi"])
def test_sigterm_drains(make_cluster, reference, topology):
    c = make_cluster(topology)
    prompts = [PROMPTS[1], PROMPTS[7]]
    n_tok = 1500
    refs = {p: reference.get(p, n_tok, ignore_eos=True) for p in prompts}
    results: dict[str, object] = {}
    started = threading.Barrier(len(prompts) + 1)

    def run(p):
        try:
            stream = c.client().completions.create(model=c.model_id, prompt=p, max_tokens=n_tok, temperature=0,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True})
            it = iter(stream)
            first = [next(it), next(it)]
            started.wait(30)

            def rest():
                yield from first
                yield from it

            results[p] = collect_stream(rest(), "completion", expected_text={0: refs[p]["text"]})
        except BaseException as e:  # noqa: BLE001
            results[p] = e
            try:
                started.abort()
            except Exception:  # noqa: BLE001
                pass

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    try:
        started.wait(60)
    except threading.BrokenBarrierError:
        pytest.fail(f"streams did not start before SIGTERM: {results}")
    c.front.signal(signal.SIGTERM)
    t_sig = time.monotonic()
    ready = None
    in_flight_at_probe = None
    while time.monotonic() - t_sig < 5:
        try:
            in_flight_at_probe = any(t.is_alive() for t in threads)
            ready = http_get(c.url + "/ready", timeout=2)[0]
            if ready == 503:
                break
        except OSError as e:
            ready = repr(e)
            break
        time.sleep(0.01)
    # A new request during the drain is not admitted.
    try:
        r = requests.post(c.url + "/v1/completions", json={"model": c.model_id, "prompt": "x", "max_tokens": 2},
                          timeout=10)
        new_status = r.status_code
    except requests.RequestException as e:
        new_status = repr(e)
    for t in threads:
        t.join(120)
    rc = c.front.wait(60)
    for p in prompts:
        res = results.get(p)
        assert not isinstance(res, BaseException), f"stream in flight during SIGTERM failed: {repr(res)[:1500]}"
        ch = res.choices[0]
        assert ch.text == refs[p]["text"], f"in-flight stream changed by the drain: {_diff(ch.text, refs[p]['text'])}"
        assert ch.finish_reason == "length"
        assert res.usage.completion_tokens == n_tok
    assert ready == 503, f"/ready after SIGTERM: {ready} (streams still in flight at the probe: {in_flight_at_probe})"
    assert new_status != 200, "a new request was admitted during the drain"
    assert rc == 0, f"{c.front.name} exit code {rc} after SIGTERM (None = still running after 60 s)"


# ---------------------------------------------------------------------------------------------
# Back-pressure


def test_queue_full_gives_503_with_retry_after(make_cluster):
    """One decode slot and a queue of one: while a long stream holds the slot, a burst of requests
    gets some 503s with Retry-After (shed early), the admitted ones complete, nothing crashes."""
    c = make_cluster("serve", serve_flags=["--max-batch", "1", "--max-queue", "1", "--decode-workers", "1",
                                           "--prefill-workers", "1"])
    body = {"model": c.model_id, "prompt": PROMPTS[7], "max_tokens": 3000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    holder = requests.post(c.url + "/v1/completions", json=body, stream=True, timeout=60)
    assert holder.status_code == 200, holder.text[:300]
    lines = holder.iter_lines()
    for _ in range(3):  # the long stream is decoding
        next(lines)
    results = []

    def burst():
        try:
            r = requests.post(c.url + "/v1/completions", json={"model": c.model_id, "prompt": "hi", "max_tokens": 2,
                                                               "temperature": 0}, timeout=60)
            results.append((r.status_code, r.headers.get("Retry-After"), r.text[:300]))
        except requests.RequestException as e:
            results.append((None, None, repr(e)))

    threads = [threading.Thread(target=burst) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for _ in lines:  # drain the long stream
        pass
    holder.close()
    statuses = [r[0] for r in results]
    print(f"\nqueue-full burst statuses: {statuses}")
    assert all(s in (200, 503) for s in statuses), results
    shed = [r for r in results if r[0] == 503]
    assert shed, f"6 requests against 1 busy slot and a queue of 1: none was shed with 503 ({results})"
    for s, retry_after, text in shed:
        assert retry_after is not None and retry_after.strip().isdigit(), f"503 without a numeric Retry-After: {text}"
        assert json.loads(text)["error"]["type"], text
    c.check_alive()
    assert http_get(c.url + "/ready")[0] == 200
