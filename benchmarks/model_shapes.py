"""The model shapes the benchmarks share, Llama-shaped (RMSNorm, RoPE, SwiGLU, GQA; embeddings
tied unless said), at the sizes of real checkpoints; and the device-memory peak they report.

    from model_shapes import SHAPES, peak_bytes
    cfg = ModelConfig(**SHAPES["qwen2.5-1.5b"], max_seq_len=1024)
"""
from __future__ import annotations

SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536),
    "qwen2.5-0.5b": dict(vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, d_ff=4864),
    "qwen2.5-1.5b": dict(vocab_size=151936, d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2, d_ff=8960),
    "llama3-8b": dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
                      tie_embeddings=False),
    # bf16 params 29.5 GB; with float32 Adam moments and gradients ~180 GB of training state, more
    # than one H100 or H200 holds (the 8-GPU part of benchmarks/gpu_check.sh)
    "qwen2.5-14b": dict(vocab_size=152064, d_model=5120, n_layers=48, n_heads=40, n_kv_heads=8, d_ff=13824,
                        tie_embeddings=False),
    "llama3-70b": dict(vocab_size=128256, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672,
                       tie_embeddings=False),
}


def peak_bytes(devices=None) -> int | None:
    """The largest peak_bytes_in_use of these devices (default: this process's); None where the
    backend keeps no count (XLA's CPU devices)."""
    import jax

    stats = [d.memory_stats() or {} for d in (jax.local_devices() if devices is None else devices)]
    peaks = [s["peak_bytes_in_use"] for s in stats if s.get("peak_bytes_in_use") is not None]
    return max(peaks) if peaks else None
