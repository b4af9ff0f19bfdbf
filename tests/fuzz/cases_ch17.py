"""Fuzz cases of chapter 17 (production inference math): FLOPs, latencies, KV memory, paged blocks, batching."""

from __future__ import annotations

from .cases import NONNEG, NONNEG_INT, POS, POS_INT, Float, add

IN = "llmbook.lm.inference:"
KV = "llmbook.lm.kv_cache:"
SV = "llmbook.lm.serving:"
BYTES = Float(0, lo_open=True)  # bytes per element: 0.5 (4-bit), 1, 2, 4 are all valid
AI = Float(0, inf_ok=True)  # an arithmetic intensity: inf means no memory traffic (the flat roof)

add(IN + "attention_flops", lambda m: dict(n=m.s.T, d=m.s.C, n_k=m.s.T + 3, B=m.s.B, n_layers=2),
    scalars=dict(n=NONNEG_INT, d=POS_INT, n_k=NONNEG_INT, B=NONNEG_INT, n_layers=NONNEG_INT))
add(IN + "mlp_flops", lambda m: dict(n=m.s.T, d=m.s.C, d_ff=m.s.F, B=m.s.B, n_matrices=3),
    scalars=dict(n=NONNEG_INT, d=POS_INT, d_ff=POS_INT, B=NONNEG_INT, n_matrices=POS_INT))
add(IN + "prefill_latency", lambda m: dict(FLOPs_prefill=2.9e13, peak_flops=989e12, T_overhead=1e-3),
    scalars=dict(FLOPs_prefill=NONNEG, peak_flops=POS, T_overhead=NONNEG))
add(IN + "decode_latency", lambda m: dict(FLOPs_decode=1.4e10, M_read=1.4e10, peak_flops=989e12, BW=4.8e12,
                                          T_overhead=1e-4),
    scalars=dict(FLOPs_decode=NONNEG, M_read=NONNEG, peak_flops=POS, BW=POS, T_overhead=NONNEG))
add(IN + "ttft", lambda m: dict(T_queue=0.05, T_prefill=0.03, T_schedule=0.002),
    scalars=dict(T_queue=NONNEG, T_prefill=NONNEG, T_schedule=NONNEG))
add(IN + "tpot", lambda m: dict(T_decode_total=0.9, N_generated=30),
    scalars=dict(T_decode_total=NONNEG, N_generated=POS_INT))
add(IN + "throughput", lambda m: dict(N_tokens=12000, T_wall=4.0), scalars=dict(N_tokens=NONNEG_INT, T_wall=POS))
add(IN + "arithmetic_intensity", lambda m: dict(FLOPs=3.3e7, bytes_moved=3.4e7),
    scalars=dict(FLOPs=NONNEG, bytes_moved=POS))
# in TFLOP/s and TB/s (the formula is unit-free): the result then fits the fp16 range of the low-precision check
add(IN + "roofline", lambda m: dict(AI=1.0, peak_flops=989.0, BW=4.8), scalars=dict(AI=AI, peak_flops=POS, BW=POS))

add(KV + "kv_cache_bytes", lambda m: dict(L=4, B=m.s.B, S=m.s.T, H_kv=m.s.H, d_h=m.s.D, bytes_per_elem=2),
    scalars=dict(L=NONNEG_INT, B=NONNEG_INT, S=NONNEG_INT, H_kv=POS_INT, d_h=POS_INT, bytes_per_elem=BYTES))
add(KV + "kv_memory_ratio", lambda m: dict(H_kv=2, H_q=8), scalars=dict(H_kv=POS_INT, H_q=POS_INT))

add(SV + "paged_kv_bytes", lambda m: dict(N_blocks=5, block_size=16, H_kv=m.s.H, d_h=m.s.D, bytes_per_elem=2,
                                          n_layers=3),
    scalars=dict(N_blocks=NONNEG_INT, block_size=POS_INT, H_kv=POS_INT, d_h=POS_INT, bytes_per_elem=BYTES,
                 n_layers=NONNEG_INT))
add(SV + "batching_utilization", lambda m: dict(tokens=[3, 10, 4, 7], B_max=2, steps=14),
    scalars=dict(B_max=POS_INT, steps=POS_INT))
