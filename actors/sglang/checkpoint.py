"""The directory a server loads: Cadence's params as a Hugging Face checkpoint plus tokenizer files.

Servers need tokenizer files even though Cadence sends input_ids. A policy loaded from a checkpoint
(model.path) brings its own; the built-in character tokenizer is written here as an equivalent
``tokenizer.json`` (a WordLevel model with the same ids, one token per character).
"""
from __future__ import annotations

import json
import os

import tokenizers
from tokenizers import models, pre_tokenizers

from cadence.learner.models import char_tokenizer as ct
from cadence.learner.models.config import ModelConfig
from cadence.learner.models.hf_export import export_checkpoint

_SPECIALS = {ct.PAD_ID: "<pad>", ct.BOS_ID: "<bos>", ct.EOS_ID: "<eos>", ct.UNK_ID: "<unk>"}


def char_vocab(vocab_size: int) -> dict[str, int]:
    """token text -> id for the character tokenizer, padded with "<junk:ID>" up to vocab_size."""
    vocab = {text: i for i, text in _SPECIALS.items()}
    vocab.update({c: ct.FIRST_CHAR_ID + i for i, c in enumerate(ct.ALPHABET)})
    for i in range(len(vocab), vocab_size):
        vocab[f"<junk:{i}>"] = i
    return vocab


def write_char_tokenizer(out_dir: str, vocab_size: int) -> None:
    """Writes tokenizer.json, tokenizer_config.json and generation_config.json for CharTokenizer ids."""
    tok = tokenizers.Tokenizer(models.WordLevel(char_vocab(vocab_size), unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    tok.add_special_tokens(list(_SPECIALS.values()))
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
                   "pad_token": "<pad>", "unk_token": "<unk>", "model_max_length": 1 << 20,
                   "add_bos_token": False}, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": ct.BOS_ID, "eos_token_id": ct.EOS_ID, "pad_token_id": ct.PAD_ID}, f, indent=2)


def export_for_server(model_cfg: ModelConfig, params, out_dir: str, fetch=None) -> str:
    """Exports params (and tokenizer files) so a server can load out_dir; returns out_dir.

    With model_cfg.path the checkpoint's own tokenizer files are copied; otherwise the character
    tokenizer's are written and config.json gets its special ids. fetch: see export_checkpoint.
    """
    export_checkpoint(model_cfg, params, out_dir, source=model_cfg.path, fetch=fetch)
    if not model_cfg.path:
        write_char_tokenizer(out_dir, model_cfg.vocab_size)
        path = os.path.join(out_dir, "config.json")
        with open(path) as f:
            cfg = json.load(f)
        cfg.update(bos_token_id=ct.BOS_ID, eos_token_id=ct.EOS_ID, pad_token_id=ct.PAD_ID)
        with open(path, "w") as f:
            json.dump(cfg, f, indent=2)
    return out_dir
