"""Cross-checks `deltaserve generate` against the NumPy reference (kimi_reference.py).

For each generated checkpoint the CLI decodes greedily with --logprobs 5; the reference then
teacher-forces the prompt plus the generated ids and must agree on every position: the argmax
(unless the reference's top two logits are a near tie), the chosen token's logprob and the five
best logprobs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kimi_reference as ref  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BINARY = os.environ.get("DELTASERVE_BINARY", os.path.join(REPO, "build", "release", "cli", "deltaserve"))

LOGPROB_TOL = 2e-3
NEAR_TIE = 1e-3
MAX_TOKENS = 12
TOP = 5

SHORT_PROMPT = "The quick brown fox, 你好世界 and привет! It's 2024-05-17."
LONG_PROMPT = (
    "Kimi Delta Attention keeps a fixed-size state per head; MLA keeps a latent cache.\r\n"
    "Числа: 1234567 и 89. 中文测试，混合 text with emoji 🙂🚀 and   spaces.\n\n"
    "They'll say we've done it — don't they?"
)

CASES = {
    # id: (make-model flags, prompt, extra generate flags)
    "tiny-linear": (["--preset", "tiny-linear"], SHORT_PROMPT, []),
    "tiny-linear-chunked": (["--preset", "tiny-linear", "--dtype", "f32"], LONG_PROMPT, ["--prefill-chunk", "7"]),
    "tiny-k3": (["--preset", "tiny-k3"], SHORT_PROMPT, []),
    "tiny-k3-chunked": (["--preset", "tiny-k3", "--seed", "7"], LONG_PROMPT, ["--prefill-chunk", "16"]),
    "tiny-k3-fp8-sharded": (["--preset", "tiny-k3", "--dtype", "fp8", "--shard-bytes", "100000"], SHORT_PROMPT, []),
}

_max_errors: dict[str, float] = {}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    if not os.path.exists(BINARY):
        pytest.fail(f"deltaserve binary not found at {BINARY} (set DELTASERVE_BINARY)")
    env = dict(os.environ)
    env.setdefault("DELTASERVE_THREADS", "2")
    proc = subprocess.run([BINARY, *args], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, f"deltaserve {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}"
    return proc


def token_bytes_to_id(enc) -> dict[bytes, int]:
    table = {}
    for i in range(enc.n_vocab):
        try:
            table[enc.decode_single_token_bytes(i)] = i
        except KeyError:  # an id with no token
            pass
    return table


@pytest.mark.parametrize("case", list(CASES))
def test_generate_matches_reference(case, tmp_path):
    make_flags, prompt, gen_flags = CASES[case]
    model = str(tmp_path / "model")
    run_cli("make-model", "--out", model, *make_flags)

    proc = run_cli("generate", "--model", model, "--prompt", prompt, "--max-tokens", str(MAX_TOKENS),
                   "--ignore-eos", "--logprobs", str(TOP), *gen_flags)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == MAX_TOKENS, proc.stdout
    assert [line["index"] for line in lines] == list(range(MAX_TOKENS))

    cfg = ref.load_config(model)
    enc = ref.load_tiktoken(model)
    bos = int(cfg["vocab_size"]) - 256
    prompt_ids = [bos] + ref.encode_plain(enc, prompt)
    m = re.search(r"prompt (\d+) tokens", proc.stderr)
    assert m, proc.stderr
    assert int(m.group(1)) == len(prompt_ids), f"CLI prompt length {m.group(1)} != reference {len(prompt_ids)}"

    generated = [int(line["token_id"]) for line in lines]
    logp = ref.log_softmax(ref.logits(model, prompt_ids + generated[:-1]))
    logp = logp[len(prompt_ids) - 1:]
    by_bytes = token_bytes_to_id(enc)

    max_err = 0.0
    for pos, line in enumerate(lines):
        row = logp[pos]
        tok = generated[pos]
        order = np.argsort(-row, kind="stable")
        best, second = order[0], order[1]
        if tok != best:
            assert row[best] - row[second] < NEAR_TIE, (
                f"{case} position {pos}: CLI chose {tok} (ref logprob {row[tok]:.6f}), reference argmax {best} "
                f"({row[best]:.6f}), margin {row[best] - row[second]:.2e}")
        err = abs(line["logprob"] - row[tok])
        max_err = max(max_err, err)
        assert err <= LOGPROB_TOL, f"{case} position {pos}: logprob {line['logprob']} vs reference {row[tok]}"

        top = line["top_logprobs"]
        assert len(top) == TOP
        cli_values = np.array([entry["logprob"] for entry in top])
        assert np.all(np.diff(cli_values) <= 0), f"{case} position {pos}: top_logprobs not sorted"
        ref_values = row[order[:TOP]]
        errs = np.abs(cli_values - ref_values)
        max_err = max(max_err, float(errs.max()))
        assert errs.max() <= LOGPROB_TOL, f"{case} position {pos}: top logprobs {cli_values} vs {ref_values}"
        for entry in top:  # each named alternative carries the reference's logprob of that token
            tid = by_bytes.get(bytes(entry["bytes"]))
            assert tid is not None, f"{case} position {pos}: unknown token bytes {entry['bytes']}"
            err = abs(entry["logprob"] - row[tid])
            max_err = max(max_err, err)
            assert err <= LOGPROB_TOL, f"{case} position {pos}: token {tid} logprob {entry['logprob']} vs {row[tid]}"

    _max_errors[case] = max_err
    print(f"\n{case}: {len(prompt_ids)} prompt + {MAX_TOKENS} generated tokens, max |logprob error| = {max_err:.3e}")


def test_report_max_errors():
    """Prints the max error per case (runs after the cases in this file)."""
    if not _max_errors:
        pytest.skip("no reference case ran in this session")
    worst = max(_max_errors.values())
    print("\nmax |logprob error| per case: " + ", ".join(f"{k} {v:.3e}" for k, v in _max_errors.items()))
    print(f"overall max |logprob error| = {worst:.3e} (tolerance {LOGPROB_TOL})")
