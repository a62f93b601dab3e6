"""Prefix cache through the real binary: tenant isolation (paired: the owner hits, another tenant with the
same prompt gets 0) in one process, across two routers sharing one set of workers, and after a router
and its RocksDB index restart; cached_tokens equals the depth the policy allows; output equals the cold
`deltaserve generate` transcript.

With the default policy (checkpoint every 4th boundary + the last full block of each prompt's first N-1
tokens), a repeat of an N-token prompt is served from the cache up to floor((N-1)/512)*512 tokens.
"""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from conftest import CLUSTER_RE, HTTP_RE, STARTUP_DEADLINE_S, DsProcess, wait_ready

BLOCK = 512
MAX_TOKENS = 8
CACHE_KEY = "000102030405060708090a0b0c0d0e0f"
TENANTS = {  # tenant -> (api key, cache namespace or None = its own)
    "acme": ("sk-acme", None),
    "globex": ("sk-globex", None),
    "initech": ("sk-initech", "partners"),
    "umbrella": ("sk-umbrella", "partners"),
}


def long_prompt(seed: int, words: int = 900) -> str:
    """A deterministic text of a few blocks of tokens (different seeds differ from the first words)."""
    vocab = ["river", "stone", "lantern", "orbit", "copper", "meadow", "signal", "harbor", "quartz", "ember",
             "falcon", "willow", "cipher", "tundra", "violet", "anchor"]
    return " ".join(f"{vocab[(i * 7 + seed * 13) % len(vocab)]}{(i * seed) % 31}" for i in range(words))


def write_keys(path) -> str:
    tenants = []
    for name, (key, ns) in TENANTS.items():
        entry = {"name": name, "api_key_sha256": hashlib.sha256(key.encode()).hexdigest()}
        if ns:
            entry["cache_namespace"] = ns
        tenants.append(entry)
    path.write_text(json.dumps({"tenants": tenants}))
    return str(path)


def complete(url: str, tenant: str, prompt: str, model: str = "tiny-linear") -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key=TENANTS[tenant][0], max_retries=0, timeout=60.0)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                  extra_body={"ignore_eos": True})
    details = r.usage.prompt_tokens_details
    return {"text": r.choices[0].text, "prompt_tokens": r.usage.prompt_tokens,
            "cached": details.cached_tokens if details else 0}


def expected_hit(prompt_tokens: int) -> int:
    return (prompt_tokens - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def prompts(reference):
    out = {}
    for seed in (3, 5, 7):
        p = long_prompt(seed)
        n = reference.prompt_tokens(p)
        assert n >= 2 * BLOCK + 1, f"prompt of {n} tokens: too short to hit at more than one block"
        out[seed] = (p, n, reference.get(p, MAX_TOKENS, ignore_eos=True)["text"])
    return out


def check(result: dict, prompt_info, cached: int, who: str) -> None:
    _, n, cold_text = prompt_info
    assert result["prompt_tokens"] == n, who
    assert result["cached"] == cached, f"{who}: cached_tokens {result['cached']}, expected {cached}"
    assert result["text"] == cold_text, f"{who}: output differs from the cold transcript"


def test_tenant_isolation_in_one_process(make_cluster, tmp_path, prompts):
    keys = write_keys(tmp_path / "keys.json")
    c = make_cluster("serve", serve_flags=["--api-keys", keys, "--index-dir", str(tmp_path / "index")],
                     api_key="sk-acme")
    p = prompts[3]
    check(complete(c.url, "acme", p[0]), p, 0, "acme, first")
    check(complete(c.url, "acme", p[0]), p, expected_hit(p[1]), "acme, repeat")  # paired: the owner hits
    check(complete(c.url, "globex", p[0]), p, 0, "globex, same prompt")
    check(complete(c.url, "globex", p[0]), p, expected_hit(p[1]), "globex, repeat")
    # Tenants configured into one namespace share; the others still do not.
    check(complete(c.url, "initech", p[0]), p, 0, "initech, first")
    check(complete(c.url, "umbrella", p[0]), p, expected_hit(p[1]), "umbrella, shared namespace")


def start_second_router(make_cluster_env, logdir, model_dir, join: str, keys: str, index_dir: str,
                        tag: str) -> tuple[DsProcess, str]:
    proc = DsProcess(f"router2{tag}", ["router", "--model", model_dir, "--host", "127.0.0.1", "--port", "0",
                                       "--join", join, "--api-keys", keys, "--index-dir", index_dir,
                                       "--cache-key", CACHE_KEY], make_cluster_env, logdir)
    deadline = time.monotonic() + STARTUP_DEADLINE_S
    m = proc.wait_line(HTTP_RE, deadline)[0]
    url = f"http://{m.group(1)}:{m.group(2)}"
    wait_ready(url, deadline, [proc])
    return proc, url


def test_tenant_isolation_across_two_routers_and_after_index_restart(make_cluster, tmp_path, prompts, ds_env,
                                                                     logdir, model_dir):
    keys = write_keys(tmp_path / "keys.json")
    key_flags = ["--cache-key", CACHE_KEY]
    c = make_cluster("multi", router_flags=["--api-keys", keys, "--index-dir", str(tmp_path / "index1"), *key_flags],
                     prefill_flags=key_flags, decode_workers=1, api_key="sk-acme")
    m = c.front.wait_line(CLUSTER_RE, time.monotonic() + 5)[0]
    join = f"{m.group(1)}:{m.group(2)}"
    index2 = str(tmp_path / "index2")
    router2, url2 = start_second_router(ds_env, logdir, model_dir, join, keys, index2, "-a")
    try:
        # Across routers: acme's prompt, computed through router 1, is a hit through router 2; not for globex.
        p = prompts[5]
        check(complete(c.url, "acme", p[0]), p, 0, "acme via router 1")
        check(complete(url2, "acme", p[0]), p, expected_hit(p[1]), "acme via router 2")
        check(complete(url2, "globex", p[0]), p, 0, "globex via router 2")

        # Router 2 and its index restart (workers keep their caches); the index reopens from disk and is
        # reconciled against the live workers.
        q = prompts[7]
        check(complete(c.url, "acme", q[0]), q, 0, "acme via router 1, new prompt")
        rc, killed = router2.stop()
        assert rc == 0 and not killed, f"router 2 exit {rc} (killed: {killed})\n{router2.describe()}"
        router2, url2 = start_second_router(ds_env, logdir, model_dir, join, keys, index2, "-b")
        check(complete(url2, "acme", q[0]), q, expected_hit(q[1]), "acme via restarted router 2")
        check(complete(url2, "globex", q[0]), q, 0, "globex via restarted router 2")
        c.check_alive()
    finally:
        router2.stop()
