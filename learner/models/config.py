"""Configuration of the Llama-style decoder (the learner's model, also run by the built-in engine)."""

import dataclasses
import os
from typing import Literal

DType = Literal["float32", "bfloat16"]
RopeScaling = Literal["none", "llama3"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-style decoder-only transformer.

    The default (d_model=64, 2 layers, vocab 64) has about 127k parameters; it is the reference
    model of the engine benchmark and the tests. With ``path`` set, the architecture fields are
    read from the Hugging Face checkpoint there (see ``hf_config.model_config_from_checkpoint``);
    only ``param_dtype`` and ``compute_dtype`` are taken from this config.
    """

    path: str = ""  # Hugging Face checkpoint directory to load ("" = the built-in random tiny model)

    vocab_size: int = 64  # number of token ids (embedding rows, logits columns)
    d_model: int = 64  # residual stream width
    n_layers: int = 2  # number of decoder layers
    n_heads: int = 4  # query heads
    n_kv_heads: int = 2  # key/value heads (grouped-query attention); must divide n_heads
    d_ff: int = 256  # SwiGLU hidden width
    max_seq_len: int = 64  # longest sequence (prompt + completion) the model is meant to see
    rope_theta: float = 10000.0  # RoPE base frequency
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = True  # lm_head reuses the token embedding matrix
    param_dtype: DType = "float32"  # dtype parameters are stored in
    compute_dtype: DType = "float32"  # dtype of matmuls and activations (norms/softmax stay fp32)
    head_dim_override: int = 0  # attention head width; 0 = d_model // n_heads (Qwen3 sets it)
    qkv_bias: bool = False  # q/k/v projections have biases (Qwen2)
    o_bias: bool = False  # the output projection has a bias (Llama/Qwen3 attention_bias=True)
    qk_norm: bool = False  # RMSNorm over each query/key head before RoPE (Qwen3)
    rope_scaling_type: RopeScaling = "none"  # RoPE frequency scaling: none, or Llama 3's
    rope_scaling_factor: float = 1.0  # llama3: long-wavelength frequencies are divided by this
    rope_low_freq_factor: float = 1.0  # llama3: wavelengths above original_len / this are scaled
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original_len / this are kept
    rope_original_max_position_embeddings: int = 8192  # llama3: context length before scaling

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.head_dim_override or self.d_model // self.n_heads

    def __post_init__(self) -> None:
        # "~/..." in a config file is the user's home, where cached checkpoints live
        if self.path.startswith("~"):
            object.__setattr__(self, "path", os.path.expanduser(self.path))

    def validate(self) -> None:
        """Raises ValueError("<field>: <problem>") on an inconsistent configuration."""
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.head_dim_override < 0:
            raise ValueError(f"head_dim_override: must be >= 0, got {self.head_dim_override}")
        if not self.head_dim_override and self.d_model % self.n_heads:
            raise ValueError(f"n_heads: must divide d_model={self.d_model}, got {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads: must divide n_heads={self.n_heads}, got {self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"n_heads: head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta: must be > 0, got {self.rope_theta}")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps: must be > 0, got {self.norm_eps}")
        for name in ("param_dtype", "compute_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16"):
                raise ValueError(f"{name}: must be 'float32' or 'bfloat16', got {getattr(self, name)!r}")
        if self.rope_scaling_type not in ("none", "llama3"):
            raise ValueError(f"rope_scaling_type: must be 'none' or 'llama3', got {self.rope_scaling_type!r}")
        if self.rope_scaling_type == "llama3":
            if self.rope_scaling_factor < 1:
                raise ValueError(f"rope_scaling_factor: must be >= 1, got {self.rope_scaling_factor}")
            if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
                raise ValueError(
                    f"rope_high_freq_factor: must exceed rope_low_freq_factor > 0, got "
                    f"{self.rope_high_freq_factor} and {self.rope_low_freq_factor}")
            if self.rope_original_max_position_embeddings < 1:
                raise ValueError(
                    "rope_original_max_position_embeddings: must be >= 1, got "
                    f"{self.rope_original_max_position_embeddings}")
