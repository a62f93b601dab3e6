"""Parity of the C++ tokenizer with tiktoken built as tokenization_kimi.py builds it.

The tiktoken side: the checkpoint's tiktoken.model ranks, the Kimi pre-split pattern (copied from
tokenizer/pretokenizer.hpp) and the specials of tokenizer_config.json. The C++ side: the
`deltaserve tokenize` command (a JSON list of ids). With an older binary that lacks it, only the
prompt length that `deltaserve generate` reports on stderr can be compared (a weaker check).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kimi_reference as ref  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BINARY = os.environ.get("DELTASERVE_BINARY", os.path.join(REPO, "build", "release", "cli", "deltaserve"))

HANDWRITTEN = [
    "Hello, world!",
    "hello world",
    "  leading spaces and trailing   ",
    "tabs\tand\ttabs\t\t\tend",
    "line one\nline two\n\nline four\n",
    "windows\r\nline\r\nendings\r\n\r\n",
    "mixed \r\n \n\r  \t\n whitespace",
    " " * 1,
    " " * 7,
    " " * 200,
    "\n" * 50,
    "word" + " " * 64 + "word",
    "a\u00a0b\u2009c\u3000d\u2028e\u2029f\u0085g",
    "0",
    "12",
    "123",
    "1234",
    "1234567890123",
    "3.14159 2,718 1e-10 0x1F -42 +7 1_000_000",
    "Phone: +1 (555) 010-9999, 2024-05-17T12:34:56Z",
    "I'm you're he's we've they'll she'd isn't",
    "I'M YOU'RE HE'S WE'VE THEY'LL SHE'D ISN'T",
    "It'S wE'Ve 'tis 'twas rock'n'roll o'clock",
    "CamelCaseWordsAndALLCAPS and lowerUPPERlower",
    "HTTPServerError XMLHttpRequest iPhone eBay",
    "Привет, мир! Как дела? ПРИВЕТ мир",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "你好，世界！这是一个测试。",
    "中文English混合text测试123数字",
    "日本語のテキスト、カタカナとひらがな。",
    "한국어 텍스트 테스트입니다.",
    "Ελληνικά κείμενα και ΚΕΦΑΛΑΙΑ",
    "עברית מימין לשמאל",
    "العربية من اليمين إلى اليسار",
    "हिन्दी पाठ परीक्षण",
    "ภาษาไทยไม่มีช่องว่าง",
    "Emoji: 🙂🚀👍🏽 👨‍👩‍👧‍👦 🇺🇸🇩🇪 ❤️",
    "café naïve résumé Ångström Übermensch straße",
    "e\u0301 a\u0308 combining marks n\u0303",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "<html><body class=\"x\">Hi &amp; bye</body></html>",
    "https://example.com/path?q=1&r=2#frag",
    "email@example.org, @handle #hashtag $100 50% ^_^",
    "!!! ??? ... --- === +++ *** ~~~",
    "<|im_end|> looks special but is plain text",
    "[BOS] [EOS] <|im_user|>user<|im_middle|>hi",
    "a" * 300,
    "ab" * 150,
    "z",
    "\u200b\u200c\u200d zero width",
    "😀" * 20,
    "末尾の空白   \n",
]

# Code point ranges for the random strings: scripts the model family meets, plus punctuation,
# digits of other scripts, combining marks, odd whitespace and emoji.
RANGES = [
    (0x20, 0x7E), (0x20, 0x7E), (0x20, 0x7E), (0xA0, 0xFF), (0x100, 0x17F), (0x300, 0x36F),
    (0x391, 0x3C9), (0x400, 0x44F), (0x5D0, 0x5EA), (0x620, 0x64A), (0x660, 0x669), (0x905, 0x939),
    (0x966, 0x96F), (0xE01, 0xE3A), (0x2000, 0x200A), (0x2010, 0x2027), (0x3000, 0x3003),
    (0x3041, 0x3096), (0x30A1, 0x30FA), (0x4E00, 0x9FA5), (0x4E00, 0x9FA5), (0xAC00, 0xD7A3),
    (0xFF01, 0xFF5E), (0x1F300, 0x1F5FF), (0x1F600, 0x1F64F), (0x1F900, 0x1F9FF),
]
WHITESPACE = [" ", " ", " ", "  ", "\n", "\t", "\r\n", "\r", "   \n", " \n\n"]


def random_strings(count: int, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 12)):
            kind = rng.random()
            if kind < 0.25:
                parts.append(rng.choice(WHITESPACE))
            elif kind < 0.35:
                parts.append(str(rng.randint(0, 10**rng.randint(1, 9))))
            elif kind < 0.42:
                parts.append(rng.choice(["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "'"]))
            else:
                lo, hi = rng.choice(RANGES)
                parts.append("".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 8))))
        out.append("".join(parts))
    return out


RANDOM = random_strings(250)


def cli(*args: str) -> subprocess.CompletedProcess:
    if not os.path.exists(BINARY):
        pytest.fail(f"deltaserve binary not found at {BINARY} (set DELTASERVE_BINARY)")
    return subprocess.run([BINARY, *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tok") / "model")
    proc = cli("make-model", "--preset", "tiny-k3", "--out", out)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def enc(model):
    return ref.load_tiktoken(model)


@pytest.fixture(scope="module")
def has_tokenize():
    proc = cli("--help")
    return re.search(r"^\s+tokenize\b", proc.stdout, re.MULTILINE) is not None


def cli_ids(model: str, text: str, *flags: str) -> list[int]:
    proc = cli("tokenize", "--model", model, *flags, "--", text)
    assert proc.returncode == 0, f"tokenize {short(text)} failed: {proc.stderr}"
    return json.loads(proc.stdout)


def cli_prompt_len(model: str, text: str) -> int:
    proc = cli("generate", "--model", model, f"--prompt={text}", "--max-tokens", "0")
    assert proc.returncode == 0, f"generate {short(text)} failed: {proc.stderr}"
    m = re.search(r"prompt (\d+) tokens", proc.stderr)
    assert m, proc.stderr
    return int(m.group(1))


def short(value, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def check_all(model, enc, has_tokenize, texts):
    mismatches = []
    for text in texts:
        want = ref.encode_plain(enc, text)
        assert enc.decode(want) == text  # tiktoken itself is lossless on these
        if has_tokenize:
            got = cli_ids(model, text)
            if got != want:
                mismatches.append((text, got, want))
            elif enc.decode(got) != text:
                mismatches.append((text, got, "does not decode back"))
        else:
            got_len = cli_prompt_len(model, text) - 1  # minus the BOS
            if got_len != len(want):
                mismatches.append((text, got_len, len(want)))
    detail = "\n".join(f"{short(t)}:\n  deltaserve {short(g)}\n  tiktoken   {short(w)}" for t, g, w in mismatches[:10])
    assert not mismatches, f"{len(mismatches)} of {len(texts)} strings differ:\n{detail}"


def test_handwritten(model, enc, has_tokenize):
    check_all(model, enc, has_tokenize, HANDWRITTEN)


def test_random_unicode(model, enc, has_tokenize):
    check_all(model, enc, has_tokenize, RANDOM)


def test_long_runs_are_chunked(model, enc, has_tokenize):
    # Runs past 25,000 whitespace / non-whitespace characters are cut before the regex.
    if not has_tokenize:
        pytest.skip("needs `deltaserve tokenize` (generate would prefill ~25k tokens)")
    texts = ["x" + " " * 25_010 + "y", "ab" * 12_600, "word " + "é" * 25_001 + "\n"]
    check_all(model, enc, has_tokenize, texts)


def test_specials_and_chat(model, enc, has_tokenize):
    if not has_tokenize:
        pytest.skip("this deltaserve has no `tokenize` command")
    text = "Hello <|im_end|> and [BOS] plus <|im_user|> 你好"
    assert cli_ids(model, text, "--specials") == enc.encode(text, allowed_special="all")
    assert cli_ids(model, text) == ref.encode_plain(enc, text)
    # Kimi's chat template (model.md §1); without a system message it adds the default one.
    user = "Hi there, 你好 <|im_end|>"
    chat = ("<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
            f"<|im_user|>user<|im_middle|>{user}<|im_end|><|im_assistant|>assistant<|im_middle|>")
    assert cli_ids(model, user, "--chat") == enc.encode(chat, allowed_special="all")


def test_tokenize_command_present(has_tokenize):
    """The strong parity check needs `deltaserve tokenize`; without it only lengths are compared."""
    if not has_tokenize:
        pytest.skip("this deltaserve has no `tokenize` command: token counts compared only")
