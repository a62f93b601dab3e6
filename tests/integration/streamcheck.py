"""Token accounting for streamed and non-streamed OpenAI responses (reliability.md, "Token accounting").

Every stream is checked chunk by chunk: per choice, tokens arrive in order with nothing lost,
duplicated or reordered (the token bytes from logprobs equal the reference transcript position by
position), text already sent is never rewritten (the accumulated text is a prefix of the reference
after every chunk), exactly one finish_reason and nothing after it, usage.completion_tokens equals
the tokens delivered, and the include_usage chunk is the last one with no choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ChoiceResult:
    text: str = ""
    token_bytes: list[bytes] = field(default_factory=list)  # from logprobs (chat: bytes; completions: utf-8 of token)
    token_strs: list[str] = field(default_factory=list)  # completions: logprobs.tokens
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    chunks: int = 0


@dataclass
class StreamResult:
    choices: dict[int, ChoiceResult]
    usage: object | None
    chunk_count: int
    ttft_s: float | None = None


def ref_bytes(ref: dict) -> list[bytes]:
    return [bytes(t["bytes"]) for t in ref["tokens"]]


def expected_token_counts(ref: dict) -> set[int]:
    """Completion token counts the server may report for this reference: all of generate's tokens, or,
    when generate stopped on an end-of-turn token, possibly without that token (it is a stop token)."""
    n = len(ref["tokens"])
    return {n, n - 1} if ref["finish_reason"] == "stop" else {n}


def check_tokens_match(got: list[bytes], ref: dict, what: str) -> None:
    want = ref_bytes(ref)
    if got == want or (ref["finish_reason"] == "stop" and got == want[:-1]):
        return
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    raise AssertionError(f"{what}: token sequence differs from `deltaserve generate` at position {first}: "
                         f"got {len(got)} tokens {got[max(0, first - 2):first + 3]!r}..., "
                         f"reference {len(want)} tokens {want[max(0, first - 2):first + 3]!r}... "
                         f"(reference finish_reason {ref['finish_reason']})")


def _diff(got: str, want: str) -> str:
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return (f"first difference at character {i} of {len(got)} (reference {len(want)}): "
            f"got ...{got[max(0, i - 20):i + 20]!r}, reference ...{want[max(0, i - 20):i + 20]!r}")


def check_token_strings(got: list[str], ref: dict, what: str) -> None:
    """Completions logprobs carry token strings only: compare the count, and the string wherever the
    reference token is valid UTF-8 on its own (a token holding part of a character has no exact text)."""
    want = ref["tokens"]
    ok_counts = expected_token_counts(ref)
    assert len(got) in ok_counts, f"{what}: {len(got)} logprobs tokens, reference has {sorted(ok_counts)}"
    for i, (g, w) in enumerate(zip(got, want)):
        try:
            text = bytes(w["bytes"]).decode("utf-8")
        except UnicodeDecodeError:
            continue
        assert g == text, f"{what}: token {i} is {g!r}, reference {text!r} (id {w['token_id']})"


def collect_stream(stream, kind: str, expected_text: dict[int, str] | None = None, t0: float | None = None,
                   include_usage: bool = True) -> StreamResult:
    """Consumes an openai SDK stream (kind 'chat' or 'completion') and checks its framing as it goes.

    expected_text: choice index -> the full text that must eventually arrive (checked as a prefix
    after every chunk: text already sent is never rewritten)."""
    import time

    choices: dict[int, ChoiceResult] = {}
    usage = None
    ids = set()
    created = set()
    count = 0
    usage_seen_at = None
    ttft = None
    for chunk in stream:
        count += 1
        ids.add(chunk.id)
        created.add(chunk.created)
        want_object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        assert chunk.object == want_object, f"chunk {count}: object {chunk.object!r}, expected {want_object!r}"
        assert usage_seen_at is None, f"chunk {count} arrived after the usage chunk (chunk {usage_seen_at})"
        if chunk.usage is not None:
            usage = chunk.usage
            usage_seen_at = count
            assert include_usage, f"usage in chunk {count} without stream_options.include_usage"
            assert chunk.choices == [], f"the usage chunk must have no choices, got {chunk.choices}"
            continue
        assert chunk.choices, f"chunk {count} has no choices and no usage"
        for c in chunk.choices:
            r = choices.setdefault(c.index, ChoiceResult())
            assert r.finish_reason is None, f"choice {c.index}: chunk {count} after finish_reason {r.finish_reason!r}"
            r.chunks += 1
            if kind == "chat":
                piece = c.delta.content or ""
                if c.delta.role is not None:
                    assert c.delta.role == "assistant", c.delta.role
                if c.logprobs is not None and c.logprobs.content:
                    for e in c.logprobs.content:
                        assert e.bytes is not None, f"chat logprobs entry without bytes: {e}"
                        r.token_bytes.append(bytes(e.bytes))
                        r.token_logprobs.append(e.logprob)
                        r.top_logprobs.append(e.top_logprobs)
            else:
                piece = c.text or ""
                lp = c.logprobs
                if lp is not None and lp.tokens:
                    assert len(lp.tokens) == len(lp.token_logprobs or []), f"completions logprobs lengths differ: {lp}"
                    for tok, tlp in zip(lp.tokens, lp.token_logprobs):
                        r.token_strs.append(tok)
                        r.token_logprobs.append(tlp)
                    r.top_logprobs.extend(lp.top_logprobs or [])
            if piece and ttft is None and t0 is not None:
                ttft = time.monotonic() - t0
            r.text += piece
            if expected_text is not None and c.index in expected_text:
                assert expected_text[c.index].startswith(r.text), (
                    f"choice {c.index}: streamed text is not a prefix of the reference after chunk {count}: "
                    f"{_diff(r.text, expected_text[c.index])}")
            if c.finish_reason is not None:
                r.finish_reason = c.finish_reason
    assert count > 0, "empty stream"
    assert len(ids) == 1, f"chunk ids differ within one stream: {ids}"
    assert len(created) == 1, f"`created` differs within one stream: {created}"
    for i, r in choices.items():
        assert r.finish_reason is not None, f"choice {i}: stream ended without finish_reason"
    if include_usage:
        assert usage is not None, "stream_options.include_usage set but no usage chunk arrived"
        assert usage_seen_at == count, "the usage chunk is not the last one"
    return StreamResult(choices=choices, usage=usage, chunk_count=count, ttft_s=ttft)
