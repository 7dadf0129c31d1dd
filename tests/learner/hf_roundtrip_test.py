"""Load -> export -> load is exact; exports load in transformers; bad checkpoints fail clearly."""

import json
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from cadence.learner.models import hf_config, hf_export, hf_load, llama
from cadence.learner.models.config import ModelConfig
from cadence.learner.models.hf_random import write_random_checkpoint

TINY = ModelConfig(vocab_size=80, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64)
QWEN2 = ModelConfig(**{**TINY.__dict__, "qkv_bias": True, "tie_embeddings": False})
QWEN3 = ModelConfig(**{**TINY.__dict__, "qk_norm": True, "head_dim_override": 16})
LLAMA3 = ModelConfig(**{**TINY.__dict__, "tie_embeddings": False, "rope_scaling_type": "llama3",
                        "rope_scaling_factor": 8.0, "rope_original_max_position_embeddings": 16})


def _leaves(params):
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}


def _assert_bitwise_equal(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert la.keys() == lb.keys()
    for key in la:
        assert la[key].dtype == lb[key].dtype, key
        assert la[key].tobytes() == lb[key].tobytes(), key


@pytest.mark.parametrize("cfg, dtype", [(QWEN2, "float32"), (QWEN3, "bfloat16"),
                                        pytest.param(LLAMA3, "bfloat16", marks=pytest.mark.slow)],
                         ids=["qwen2-fp32", "qwen3-bf16", "llama3-bf16"])
def test_load_export_load_is_bitwise_identical(tmp_path, cfg, dtype):
    cfg = ModelConfig(**{**cfg.__dict__, "param_dtype": dtype, "compute_dtype": dtype})
    src, out = tmp_path / "src", tmp_path / "out"
    # Small shards so the index and several files are exercised.
    write_random_checkpoint(str(src), cfg, seed=1, tokenizer=False, max_shard_bytes=20_000)
    base = ModelConfig(param_dtype=dtype, compute_dtype=dtype)
    cfg1, _, params1 = hf_load.load_checkpoint(str(src), base)
    files = hf_export.export_checkpoint(cfg1, params1, str(out), source=str(src), max_shard_bytes=20_000)
    assert len(files) > 1
    cfg2, _, params2 = hf_load.load_checkpoint(str(out), base)
    assert {**cfg1.__dict__, "path": ""} == {**cfg2.__dict__, "path": ""}
    _assert_bitwise_equal(params1, params2)
    index = json.loads((out / hf_load.INDEX_FILE).read_text())
    assert sorted(set(index["weight_map"].values())) == files
    assert index["metadata"]["total_size"] == llama.count_params(params1) * (4 if dtype == "float32" else 2)


def test_export_writes_hf_layout(tmp_path):
    _, params = llama.init_params(QWEN2, 0)
    hf_export.export_checkpoint(QWEN2, params, str(tmp_path))
    tensors = load_file(str(tmp_path / "model-00001-of-00001.safetensors"))
    q = np.asarray(params["layers"][0]["self_attn"]["q_proj"]["kernel"][...])
    np.testing.assert_array_equal(tensors["model.layers.0.self_attn.q_proj.weight"], q.T)  # [out, in]
    assert "model.layers.0.self_attn.q_proj.bias" in tensors
    assert "model.layers.0.self_attn.o_proj.bias" not in tensors
    assert "lm_head.weight" in tensors
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["Qwen2ForCausalLM"] and hf["tie_word_embeddings"] is False


def test_tied_export_omits_lm_head(tmp_path):
    _, params = llama.init_params(TINY, 0)
    hf_export.export_checkpoint(TINY, params, str(tmp_path))
    names = load_file(str(tmp_path / "model-00001-of-00001.safetensors")).keys()
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_plan_shards_respects_limit_and_order():
    sizes = [("a", 40), ("b", 40), ("c", 30), ("d", 200), ("e", 10)]
    shards = hf_export.plan_shards(sizes, 100)
    assert shards == [["a", "b"], ["c"], ["d"], ["e"]]
    assert [n for s in shards for n in s] == [n for n, _ in sizes]


def test_export_refuses_to_overwrite_its_source(tmp_path):
    write_random_checkpoint(str(tmp_path), TINY, tokenizer=False)
    cfg, _, params = hf_load.load_checkpoint(str(tmp_path))
    with pytest.raises(ValueError, match="source checkpoint"):
        hf_export.export_checkpoint(cfg, params, str(tmp_path), source=str(tmp_path))


def test_export_copies_tokenizer_files(tmp_path):
    src, out = tmp_path / "src", tmp_path / "out"
    write_random_checkpoint(str(src), ModelConfig(vocab_size=320, d_model=32, n_layers=1, n_heads=2,
                                                  n_kv_heads=1, d_ff=64))
    cfg, _, params = hf_load.load_checkpoint(str(src))
    hf_export.export_checkpoint(cfg, params, str(out), source=str(src))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    # Keys the model config does not own (token ids) survive from the source config.json.
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == \
        json.loads((src / "config.json").read_text())["pad_token_id"]


# ---- clear errors ---------------------------------------------------------------------------


def _single_file_ckpt(tmp_path, cfg=TINY):
    write_random_checkpoint(str(tmp_path), cfg, tokenizer=False)
    (tmp_path / hf_load.INDEX_FILE).unlink()
    shard = tmp_path / "model-00001-of-00001.safetensors"
    tensors = load_file(str(shard))
    shard.unlink()
    return tensors, tmp_path / "model.safetensors"


def test_missing_tensor_is_named(tmp_path):
    tensors, file = _single_file_ckpt(tmp_path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        hf_load.load_checkpoint(str(tmp_path))


def test_shape_mismatch_is_named_with_both_shapes(tmp_path):
    tensors, file = _single_file_ckpt(tmp_path)
    tensors["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight'.*\(8, 32\).*\(16, 32\)"):
        hf_load.load_checkpoint(str(tmp_path))


def test_unexpected_tensor_is_named(tmp_path):
    tensors, file = _single_file_ckpt(tmp_path)
    tensors["model.layers.0.mlp.gate_proj.bias"] = np.zeros((64,), np.float32)
    save_file(tensors, str(file))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate_proj\.bias'"):
        hf_load.load_checkpoint(str(tmp_path))


def test_unknown_architecture_is_named(tmp_path):
    write_random_checkpoint(str(tmp_path), TINY, tokenizer=False)
    hf = json.loads((tmp_path / "config.json").read_text())
    hf.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="unsupported architecture.*MistralForCausalLM"):
        hf_load.load_checkpoint(str(tmp_path))


@pytest.mark.parametrize("key, value, message", [
    ("use_sliding_window", True, "use_sliding_window"),
    ("hidden_act", "gelu", "hidden_act 'gelu'"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "'yarn'"),
])
def test_unsupported_options_are_named(key, value, message):
    hf = hf_config.hf_from_model_config(TINY)
    hf[key] = value
    with pytest.raises(ValueError, match=message):
        hf_config.model_config_from_hf(hf)


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        hf_load.load_checkpoint(str(tmp_path))
    write_random_checkpoint(str(tmp_path), TINY, tokenizer=False)
    for f in os.listdir(tmp_path):
        if f.endswith(".safetensors"):
            os.remove(tmp_path / f)
    with pytest.raises(FileNotFoundError, match="missing shard"):
        hf_load.load_checkpoint(str(tmp_path))


# ---- exported directories in transformers ------------------------------------------------------


@pytest.mark.parametrize("cfg", [pytest.param(QWEN2, marks=pytest.mark.slow), QWEN3,
                                 pytest.param(LLAMA3, marks=pytest.mark.slow)], ids=["qwen2", "qwen3", "llama3"])
def test_export_loads_in_transformers_with_same_logits(tmp_path, cfg):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    _, params = llama.init_params(cfg, 3)
    hf_export.export_checkpoint(cfg, params, str(tmp_path), max_shard_bytes=30_000)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(model).__name__ == hf_config.hf_from_model_config(cfg)["architectures"][0]
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 20))
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    graphdef = llama.init_params(cfg, 0)[0]
    forward = jax.jit(lambda p, t: llama.forward(graphdef, p, t, jax.numpy.broadcast_to(jax.numpy.arange(20), (2, 20)),
                                                 jax.numpy.ones((2, 20), bool)))
    ours = np.asarray(forward(params, tokens))
    assert np.abs(ours - ref).max() <= 1e-4


@pytest.mark.parametrize("shape", [(5, 3), (300, 64), (64, 2048 + 1), (128, 512)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transpose_into_equals_numpy_transpose(shape, dtype):
    # Shapes cover a partial last row block (300 rows, 128 per block), power-of-two strides and
    # a single block; the cast is the same as NumPy's astype.
    matrix = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    out = hf_load.aligned_empty(shape[::-1], hf_load._NP_DTYPES[dtype])
    hf_load.transpose_into(out, matrix)
    want = matrix.T.astype(hf_load._NP_DTYPES[dtype])
    assert out.shape == want.shape and out.dtype == want.dtype and out.flags.c_contiguous
    assert out.tobytes() == want.tobytes()


def test_aligned_empty_is_aligned_and_device_put_keeps_its_values():
    for shape in [(3,), (7, 5), (1000, 33)]:
        out = hf_load.aligned_empty(shape, np.float32)
        assert out.shape == shape and out.ctypes.data % 64 == 0 and out.flags.c_contiguous
        out[...] = np.arange(out.size, dtype=np.float32).reshape(shape)
        np.testing.assert_array_equal(np.asarray(jax.device_put(out)), out)


def test_write_safetensors_is_what_the_safetensors_library_reads(tmp_path):
    import ml_dtypes
    from safetensors import safe_open

    rng = np.random.default_rng(0)
    arrays = {"a.weight": rng.normal(size=(3, 5)).astype(np.float32),
              "b.weight": rng.normal(size=(7,)).astype(ml_dtypes.bfloat16),
              "c.bias": rng.normal(size=(2, 2, 3)).astype(np.float16),
              "d.scale": np.asarray(1.5, np.float32)}
    path = str(tmp_path / "x.safetensors")
    written = hf_export.write_safetensors(path, [(n, a.shape, a.dtype) for n, a in arrays.items()],
                                          lambda i, name: arrays[name], metadata={"format": "pt"})
    assert written == sum(a.nbytes for a in arrays.values())
    got = load_file(path)
    assert got.keys() == arrays.keys()
    for name, a in arrays.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape and got[name].tobytes() == a.tobytes(), name
    with safe_open(path, "np") as f:
        assert f.metadata() == {"format": "pt"}
    header = int.from_bytes(open(path, "rb").read(8), "little")
    assert (8 + header) % 8 == 0  # the data starts aligned
    with pytest.raises(ValueError, match="tensor 'a.weight': float32\\[5, 3\\] where the header says float32\\[3, 5\\]"):
        hf_export.write_safetensors(path, [("a.weight", (3, 5), np.dtype(np.float32))],
                                    lambda i, name: arrays[name].T)


def test_export_holds_one_tensor_at_a_time_not_the_model(tmp_path):
    """Beyond the params, export's host memory is one tensor's copy (a kernel transposed), not a
    shard's: safetensors' save_file held the whole file (+0.4 GB at SmolLM2's end of run)."""
    import tracemalloc

    cfg = ModelConfig(**{**TINY.__dict__, "n_layers": 8, "d_model": 64, "d_ff": 256})
    _, params = llama.init_params(cfg, 0)
    total = sum(np.asarray(v).nbytes for v in jax.tree.leaves(params))
    largest = max(np.asarray(v).nbytes for v in jax.tree.leaves(params))
    tracemalloc.start()
    try:
        hf_export.export_checkpoint(cfg, params, str(tmp_path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert largest * 10 < total
    # one kernel's copy plus the export's own small objects (the JSON, the config): a quarter of
    # the model at most, where holding a shard's copies takes all of it
    assert peak < total / 4, (peak, largest, total)
    _, _, back = hf_load.load_checkpoint(str(tmp_path), ModelConfig())
    _assert_bitwise_equal(params, back)
