"""Ceilings and the fla peer for bench/gpu/kda.sh, in the same run as our kernels.

Prints one JSON object per line: the device-to-device copy bandwidth (bytes read + written), the bf16 GEMM rate
(torch.matmul 8192^3 on random data), fla-core's chunk_kda (safe_gate=True, lower_bound=-5, precomputed bounded
gate, fp32 initial/final state) on the prefill shapes, and fla's fused_recurrent_kda (gate, L2 norm and beta
sigmoid in kernel, in-place fp32 state, 20 layers replayed as one CUDA graph) on the decode shapes.
"""
import json
import sys

import torch

torch.backends.cuda.matmul.allow_tf32 = False


def median_ms(fn, warmup=3, iters=15):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    return times[len(times) // 2]


def emit(obj):
    print(json.dumps(obj), flush=True)


def ceilings():
    n = 1 << 30  # 2 GiB of bf16
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x), 3, 10)
    emit({"kind": "ceiling", "name": "copy", "value": 2 * n * 2 / (ms * 1e-3) / 1e12, "unit": "TB/s"})
    del x, y
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b, 3, 10)
    emit({"kind": "ceiling", "name": "gemm", "value": 2 * 8192**3 / (ms * 1e-3) / 1e12, "unit": "TFLOP/s"})


def fla_prefill(chunk_kda, H, lengths, name):
    T = sum(lengths)
    q = torch.nn.functional.normalize(torch.randn(1, T, H, 128, device="cuda"), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(1, T, H, 128, device="cuda"), dim=-1).bfloat16()
    v = torch.randn(1, T, H, 128, device="cuda").bfloat16()
    g = -5.0 * torch.sigmoid(torch.randn(1, T, H, 128, device="cuda"))
    beta = torch.sigmoid(torch.randn(1, T, H, device="cuda")).bfloat16()
    N = len(lengths)
    h0 = 0.05 * torch.randn(N, H, 128, 128, device="cuda")
    cu = None
    if N > 1:
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), device="cuda", dtype=torch.long)

    def run():
        kwargs = dict(initial_state=h0, output_final_state=True, safe_gate=True, lower_bound=-5.0)
        if cu is not None:
            kwargs["cu_seqlens"] = cu
            kwargs["cu_seqlens_cpu"] = cu.cpu()
        return chunk_kda(q, k, v, g, beta, **kwargs)

    ms = median_ms(run)
    emit({"kind": "prefill", "case": name, "ms": ms})
    del q, k, v, g, beta, h0
    torch.cuda.empty_cache()


def fla_decode(fused_recurrent_kda_fwd, H, B, layers=20):
    C = H * 128
    q = torch.randn(B, 1, H, 128, device="cuda").bfloat16()
    k = torch.randn(B, 1, H, 128, device="cuda").bfloat16()
    v = torch.randn(B, 1, H, 128, device="cuda").bfloat16()
    g = torch.randn(B, 1, H, 128, device="cuda").bfloat16()
    beta = torch.randn(B, 1, H, device="cuda").bfloat16()
    a_log = torch.randn(H, device="cuda")
    dt_bias = torch.randn(C, device="cuda")
    states = [0.05 * torch.randn(B, H, 128, 128, device="cuda") for _ in range(layers)]
    outs = [torch.empty_like(v) for _ in range(layers)]

    def step():
        for s, o in zip(states, outs):
            fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=a_log, dt_bias=dt_bias, initial_state=s,
                                    inplace_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                    use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, out=o)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            step()
    ms = median_ms(graph.replay, 3, 20)
    emit({"kind": "decode", "case": f"H={H},d=128,B={B}", "us": ms * 1000.0 / layers})


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    ceilings()
    if what == "ceilings":
        return
    import fla
    from fla.ops.kda import chunk_kda
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    emit({"kind": "peer", "name": "fla chunk_kda / fused_recurrent_kda " + getattr(fla, "__version__", "?")})
    varlen = [300, 1000, 2500, 4096, 8192, 16000]
    # "all", or a subset where a time limit cannot hold every case with Triton's first compilations:
    # "h32" / "h96" (prefill at H=32 / 96), "h96+decode" (prefill at H=96, then decode).
    subsets = {"all": (32, 96), "h32": (32,), "h96": (96,), "h96+decode": (96,)}
    if what not in subsets:
        sys.exit(f"kda_fla_peer.py: unknown case set {what!r}; use one of ceilings, {', '.join(subsets)}")
    heads = subsets[what]
    for H in heads:
        for T in (4096, 16384, 65536):
            fla_prefill(chunk_kda, H, [T], f"H={H},d=128,T={T},B=1,lb=-5")
        fla_prefill(chunk_kda, H, varlen, f"H={H},d=128,varlen=300+1000+2500+4096+8192+16000,lb=-5")
    if what in ("h32", "h96"):
        return
    for B in (1, 8, 64, 256):
        try:
            fla_decode(fused_recurrent_kda_fwd, 32, B)
        except Exception as e:  # report, keep going
            emit({"kind": "error", "case": f"decode B={B}", "error": repr(e)[:300]})


if __name__ == "__main__":
    main()
