"""A plain NumPy (float64) reference of the Kimi Linear / Kimi K3 model family.

Written from docs in /work/shared/spec/model.md only, independently of the C++ engine: every op is
the textbook form (token-by-token KDA recurrence, naive MLA with materialised per-head keys and
values, dense expert loops). It is slow and meant for the tiny checkpoints `deltaserve make-model`
writes.

    logits(model_dir, token_ids) -> np.ndarray [T, vocab] float64
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np

# ---------------------------------------------------------------------------------------------
# Checkpoint loading (raw safetensors: 8-byte LE header length, JSON header, raw little-endian data)
# ---------------------------------------------------------------------------------------------


def _e4m3fn_table() -> np.ndarray:
    """float64 value of every float8 e4m3fn byte (bias 7, no infinities, S.1111.111 = NaN)."""
    table = np.empty(256, dtype=np.float64)
    for byte in range(256):
        sign = -1.0 if byte & 0x80 else 1.0
        exp = (byte >> 3) & 0xF
        man = byte & 0x7
        if exp == 0xF and man == 0x7:
            table[byte] = np.nan
        elif exp == 0:
            table[byte] = sign * (man / 8.0) * 2.0**-6
        else:
            table[byte] = sign * (1.0 + man / 8.0) * 2.0 ** (exp - 7)
    return table


_E4M3FN = _e4m3fn_table()

_PLAIN_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as float64 (integers as their own type)."""
    with open(path, "rb") as f:
        blob = f.read()
    (header_len,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + header_len])
    data = memoryview(blob)[8 + header_len:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = data[begin:end]
        shape = tuple(info["shape"])
        dtype = info["dtype"]
        if dtype == "BF16":
            bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = bits.view(np.float32).astype(np.float64)
        elif dtype == "F8_E4M3":
            arr = _E4M3FN[np.frombuffer(raw, dtype=np.uint8)]
        elif dtype in _PLAIN_DTYPES:
            arr = np.frombuffer(raw, dtype=_PLAIN_DTYPES[dtype])
            if arr.dtype.kind == "f":
                arr = arr.astype(np.float64)
        else:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {dtype}")
        out[name] = arr.reshape(shape)
    return out


def load_tensors(model_dir: str) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory, fp8 block-scaled weights dequantized."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        tensors.update(read_safetensors(os.path.join(model_dir, name)))
    for name in [n for n in tensors if n.endswith(".weight_scale_inv")]:
        scale = tensors.pop(name)
        wname = name[: -len("_scale_inv")]
        w = tensors[wname]
        rows, cols = w.shape
        # One scale per 128x128 block (DeepSeek-V3 / Kimi convention): w = q * scale_inv.
        full = np.repeat(np.repeat(scale, 128, axis=0), 128, axis=1)[:rows, :cols]
        tensors[wname] = w * full
    return tensors


def load_config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    return cfg.get("text_config", cfg)


# ---------------------------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------------------------


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def l2_normalize(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def linear(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """y = x W^T, W stored [out, in] as in PyTorch."""
    return x @ w.T


class KimiReference:
    def __init__(self, model_dir: str):
        self.cfg = load_config(model_dir)
        self.t = load_tensors(model_dir)
        cfg = self.cfg
        if "language_model.model.embed_tokens.weight" in self.t:
            self.prefix = "language_model.model."
            self.lm_head_name = "language_model.lm_head.weight"
        else:
            self.prefix = "model."
            self.lm_head_name = "lm_head.weight"
        self.eps = float(cfg["rms_norm_eps"])
        self.num_layers = int(cfg["num_hidden_layers"])
        lac = cfg.get("linear_attn_config") or {}
        self.mla_layers = {i - 1 for i in lac.get("full_attn_layers", [])}  # 1-based in config
        self.kda_layers = {i - 1 for i in lac.get("kda_layers", [])}
        self.kda_heads = lac.get("num_heads")
        self.kda_head_dim = lac.get("head_dim")
        self.gate_lower_bound = lac.get("gate_lower_bound")
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "situ"):
            raise ValueError(f"unsupported hidden_act {act}")
        self.situ = act == "situ"
        self.situ_beta = float(cfg.get("activation_situ_beta", 4.0))
        self.situ_lin_beta = float(cfg.get("activation_situ_linear_beta", 25.0))
        self.attn_res_block = cfg.get("attn_res_block_size")
        if int(cfg.get("num_expert_group") or 1) > 1:
            raise NotImplementedError("group-limited routing (num_expert_group > 1)")

    def w(self, name: str) -> np.ndarray:
        return self.t[self.prefix + name]

    def has(self, name: str) -> bool:
        return (self.prefix + name) in self.t

    # ---- FFN -----------------------------------------------------------------------------------

    def glu(self, x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, w_down: np.ndarray) -> np.ndarray:
        g = linear(x, w_gate)
        u = linear(x, w_up)
        if self.situ:
            b, bl = self.situ_beta, self.situ_lin_beta
            h = (b * np.tanh(g / b) * sigmoid(g)) * (bl * np.tanh(u / bl))
        else:
            h = silu(g) * u
        return linear(h, w_down)

    def is_moe_layer(self, layer: int) -> bool:
        cfg = self.cfg
        return (
            int(cfg.get("num_experts") or 0) > 0
            and layer >= int(cfg.get("first_k_dense_replace", 0))
            and layer % int(cfg.get("moe_layer_freq", 1)) == 0
        )

    def ffn(self, layer: int, x: np.ndarray) -> np.ndarray:
        p = f"layers.{layer}."
        if not self.is_moe_layer(layer):
            return self.glu(x, self.w(p + "mlp.gate_proj.weight"), self.w(p + "mlp.up_proj.weight"),
                            self.w(p + "mlp.down_proj.weight"))
        cfg = self.cfg
        m = p + "block_sparse_moe."
        num_experts = int(cfg["num_experts"])
        top_k = int(cfg.get("num_experts_per_token", cfg.get("num_experts_per_tok")))
        scale = float(cfg.get("routed_scaling_factor", 1.0))
        renorm = bool(cfg.get("moe_renormalize", True))
        # Router: fp32 logits in the real model; float64 here.
        scores = sigmoid(linear(x, self.w(m + "gate.weight")))  # [T, E]
        bias = self.w(m + "gate.e_score_correction_bias") if self.has(m + "gate.e_score_correction_bias") \
            else np.zeros(num_experts)
        latent = self.has(m + "routed_expert_down_proj.weight")
        h = linear(x, self.w(m + "routed_expert_down_proj.weight")) if latent else x
        routed = np.zeros((x.shape[0], h.shape[1]))
        for t in range(x.shape[0]):
            choice = np.argsort(-(scores[t] + bias), kind="stable")[:top_k]
            weights = scores[t, choice]
            if renorm:
                weights = weights / (weights.sum() + 1e-20)
            weights = weights * scale
            for e, wt in zip(choice, weights):
                q = f"{m}experts.{e}."
                routed[t] += wt * self.glu(h[t], self.w(q + "w1.weight"), self.w(q + "w3.weight"),
                                           self.w(q + "w2.weight"))
        if latent:
            if cfg.get("latent_moe_use_norm", False):
                routed = rms_norm(routed, self.w(m + "routed_expert_norm.weight"), self.eps)
            routed = linear(routed, self.w(m + "routed_expert_up_proj.weight"))
        out = routed
        if int(cfg.get("num_shared_experts") or 0) > 0:
            s = m + "shared_experts."
            out = out + self.glu(x, self.w(s + "gate_proj.weight"), self.w(s + "up_proj.weight"),
                                 self.w(s + "down_proj.weight"))
        return out

    # ---- KDA (recurrent form) ------------------------------------------------------------------

    def kda(self, layer: int, x: np.ndarray) -> np.ndarray:
        a = f"layers.{layer}.self_attn."
        T = x.shape[0]
        H, d = int(self.kda_heads), int(self.kda_head_dim)

        def conv_silu(name: str) -> np.ndarray:
            y = linear(x, self.w(a + name + "_proj.weight"))  # [T, H*d]
            w = self.w(a + name + "_conv1d.weight")[:, 0, :]  # [C, K]
            K = w.shape[1]
            padded = np.concatenate([np.zeros((K - 1, y.shape[1])), y], axis=0)  # zero initial tail
            out = np.zeros_like(y)
            for j in range(K):
                out += padded[j:j + T] * w[:, j]
            return silu(out)

        q = l2_normalize(conv_silu("q").reshape(T, H, d)) * d**-0.5
        k = l2_normalize(conv_silu("k").reshape(T, H, d))
        v = conv_silu("v").reshape(T, H, d)

        A = np.exp(self.w(a + "A_log").reshape(H))[None, :, None]  # exp(A_log_h)
        f = linear(linear(x, self.w(a + "f_a_proj.weight")), self.w(a + "f_b_proj.weight"))
        f = (f + self.w(a + "dt_bias").reshape(-1)).reshape(T, H, d)
        if self.gate_lower_bound is not None:
            g = float(self.gate_lower_bound) * sigmoid(A * f)
        else:
            g = -A * softplus(f)
        beta = sigmoid(linear(x, self.w(a + "b_proj.weight")))  # [T, H]

        o = np.zeros((T, H, d))
        for h in range(H):
            S = np.zeros((d, d))  # [d_k, d_v]
            for t in range(T):
                S = np.exp(g[t, h])[:, None] * S
                u = beta[t, h] * (v[t, h] - S.T @ k[t, h])
                S = S + np.outer(k[t, h], u)
                o[t, h] = S.T @ q[t, h]

        if self.has(a + "g_proj.weight"):
            gate = linear(x, self.w(a + "g_proj.weight"))
        else:
            gate = linear(linear(x, self.w(a + "g_a_proj.weight")), self.w(a + "g_b_proj.weight"))
        o = rms_norm(o, self.w(a + "o_norm.weight"), self.eps) * sigmoid(gate.reshape(T, H, d))
        return linear(o.reshape(T, H * d), self.w(a + "o_proj.weight"))

    # ---- MLA with NoPE (naive form) ------------------------------------------------------------

    def mla(self, layer: int, x: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        a = f"layers.{layer}.self_attn."
        T = x.shape[0]
        H = int(cfg["num_attention_heads"])
        nope, rope, dv = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"]), int(cfg["v_head_dim"])
        rank = int(cfg["kv_lora_rank"])
        if self.has(a + "q_a_proj.weight"):
            qa = rms_norm(linear(x, self.w(a + "q_a_proj.weight")), self.w(a + "q_a_layernorm.weight"), self.eps)
            q = linear(qa, self.w(a + "q_b_proj.weight"))
        else:
            q = linear(x, self.w(a + "q_proj.weight"))
        q = q.reshape(T, H, nope + rope)
        kv = linear(x, self.w(a + "kv_a_proj_with_mqa.weight"))  # [T, rank + rope]
        c = rms_norm(kv[:, :rank], self.w(a + "kv_a_layernorm.weight"), self.eps)
        k_rot = kv[:, rank:]  # NoPE: never rotated
        kvb = self.w(a + "kv_b_proj.weight").reshape(H, nope + dv, rank)
        scale = (nope + rope) ** -0.5
        out = np.zeros((T, H, dv))
        mask = np.triu(np.ones((T, T), dtype=bool), k=1)
        for h in range(H):
            w_uk, w_uv = kvb[h, :nope], kvb[h, nope:]
            k_h = np.concatenate([c @ w_uk.T, k_rot], axis=1)  # [T, nope+rope]
            v_h = c @ w_uv.T  # [T, dv]
            s = (q[:, h] @ k_h.T) * scale
            s[mask] = -np.inf
            s = s - s.max(axis=1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(axis=1, keepdims=True)
            out[:, h] = p @ v_h
        out = out.reshape(T, H * dv)
        if cfg.get("mla_use_output_gate", False):
            out = out * sigmoid(linear(x, self.w(a + "g_proj.weight")))
        return linear(out, self.w(a + "o_proj.weight"))

    # ---- Model -----------------------------------------------------------------------------------

    def attention(self, layer: int, x: np.ndarray) -> np.ndarray:
        if layer in self.mla_layers:
            return self.mla(layer, x)
        if layer in self.kda_layers or not self.mla_layers:
            return self.kda(layer, x)
        raise ValueError(f"layer {layer} is neither KDA nor MLA")

    def mix(self, sources: list[np.ndarray], norm_w: np.ndarray, proj_w: np.ndarray) -> np.ndarray:
        """Block Attention Residuals mixing, per token, over sources [blocks..., prefix]."""
        if len(sources) == 1:
            return sources[0]
        v = np.stack(sources)  # [N, T, D]
        normed = v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + self.eps)
        logit = np.sum(proj_w.reshape(-1) * norm_w * normed, axis=-1)  # [N, T]
        logit = logit - logit.max(axis=0, keepdims=True)
        p = np.exp(logit)
        p /= p.sum(axis=0, keepdims=True)
        return np.sum(p[:, :, None] * v, axis=0)

    def mix_named(self, blocks: list[np.ndarray], prefix: np.ndarray, name: str) -> np.ndarray:
        return self.mix(blocks + [prefix], self.w(name + "_norm.weight"), self.w(name + "_proj.weight"))

    def logits(self, token_ids) -> np.ndarray:
        ids = np.asarray(token_ids, dtype=np.int64)
        emb = self.w("embed_tokens.weight")[ids]
        if self.attn_res_block:
            B = int(self.attn_res_block)
            blocks: list[np.ndarray] = []
            prefix = emb
            for layer in range(self.num_layers):
                p = f"layers.{layer}."
                x_in = self.mix_named(blocks, prefix, p + "self_attention_res") if blocks else prefix
                if layer % B == 0:  # seal the running sum as a new block
                    blocks.append(prefix)
                    prefix = np.zeros_like(prefix)
                x = rms_norm(x_in, self.w(p + "input_layernorm.weight"), self.eps)
                prefix = prefix + self.attention(layer, x)
                m_in = self.mix_named(blocks, prefix, p + "mlp_res")
                x = rms_norm(m_in, self.w(p + "post_attention_layernorm.weight"), self.eps)
                prefix = prefix + self.ffn(layer, x)
            h = self.mix_named(blocks, prefix, "output_attn_res")
        else:
            h = emb
            for layer in range(self.num_layers):
                p = f"layers.{layer}."
                h = h + self.attention(layer, rms_norm(h, self.w(p + "input_layernorm.weight"), self.eps))
                h = h + self.ffn(layer, rms_norm(h, self.w(p + "post_attention_layernorm.weight"), self.eps))
        h = rms_norm(h, self.w("norm.weight"), self.eps)
        if self.lm_head_name in self.t:
            head = self.t[self.lm_head_name]
        else:  # tied embeddings
            head = self.w("embed_tokens.weight")
        return linear(h, head)


def logits(model_dir: str, token_ids) -> np.ndarray:
    """[T, vocab] float64 logits of every position of `token_ids` (a causal forward pass)."""
    return KimiReference(model_dir).logits(token_ids)


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


# ---------------------------------------------------------------------------------------------
# Tokenizer (tiktoken with the Kimi pre-split pattern, as tokenization_kimi.py builds it)
# ---------------------------------------------------------------------------------------------

# The same string as tokenizer/pretokenizer.hpp kKimiPattern (tokenization_kimi.py's pattern).
_LETTERS_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LETTERS_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?" + _LETTERS_UPPER + "*" + _LETTERS_LOWER + "+" + _CONTRACTIONS,
    r"[^\r\n\p{L}\p{N}]?" + _LETTERS_UPPER + "+" + _LETTERS_LOWER + "*" + _CONTRACTIONS,
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

NUM_RESERVED_SPECIAL_TOKENS = 256
MAX_ENCODE_CHARS = 400_000
MAX_CONSECUTIVE_RUN_CHARS = 25_000


def load_tiktoken(model_dir: str):
    """A tiktoken.Encoding for a checkpoint: BPE ranks from tiktoken.model (base64 token + rank
    per line), the Kimi pattern, specials from tokenizer_config.json `added_tokens_decoder`, and
    `<|reserved_token_ID|>` for the unnamed ids of the 256 reserved after the BPE ranks."""
    import base64

    import tiktoken

    ranks: dict[bytes, int] = {}
    with open(os.path.join(model_dir, "tiktoken.model"), "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        added = json.load(f).get("added_tokens_decoder", {})
    n = len(ranks)
    specials = {f"<|reserved_token_{i}|>": i for i in range(n, n + NUM_RESERVED_SPECIAL_TOKENS)}
    named = {int(i): entry["content"] for i, entry in added.items()}
    for i, content in named.items():
        specials.pop(f"<|reserved_token_{i}|>", None)
    specials.update({content: i for i, content in named.items()})
    return tiktoken.Encoding(name=os.path.basename(model_dir.rstrip("/")), pat_str=KIMI_PATTERN,
                             mergeable_ranks=ranks, special_tokens=specials)


def split_encode_chunks(text: str) -> list[str]:
    """tokenization_kimi.py's chunking before tiktoken (from Llama 3): cut every MAX_ENCODE_CHARS
    characters, then wherever a run of whitespace or of non-whitespace would exceed
    MAX_CONSECUTIVE_RUN_CHARS characters."""
    out = []
    for i in range(0, len(text), MAX_ENCODE_CHARS):
        s = text[i:i + MAX_ENCODE_CHARS]
        if not s:
            continue
        run_len, run_space, start = 0, s[0].isspace(), 0
        for j, ch in enumerate(s):
            space = ch.isspace()
            if space != run_space:
                run_len, run_space = 1, space
            else:
                run_len += 1
                if run_len > MAX_CONSECUTIVE_RUN_CHARS:
                    out.append(s[start:j])
                    start, run_len = j, 1
        out.append(s[start:])
    return out


def encode_plain(enc, text: str) -> list[int]:
    """Token ids of `text` with special-token text treated as plain text (no BOS)."""
    ids: list[int] = []
    for chunk in split_encode_chunks(text):
        ids.extend(enc.encode(chunk, disallowed_special=()))
    return ids
