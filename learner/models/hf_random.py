"""Small Hugging Face checkpoints made on the spot, for tests, benchmarks and offline demos.

There is no model hub here: ``write_random_checkpoint`` writes a randomly initialised model of
any ModelConfig in HF format (through the real exporter), and ``write_tiny_tokenizer`` writes a
byte-level BPE tokenizer with a ChatML chat template trained on a few sentences of arithmetic.
"""

from __future__ import annotations

import json
import os

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from cadence.learner.models.config import ModelConfig
from cadence.learner.models.hf_export import export_checkpoint
from cadence.learner.models.llama import init_params

# The Qwen2 ChatML template, minus tool calls.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CORPUS = [
    "What is 12 + 30? The answer is 42.",
    "Compute 1/2 + 1/4. The answer is \\boxed{3/4}.",
    "Natalia sold 48 clips in April and half as many in May. #### 72",
    "You are a helpful assistant. Solve the problem and put the final answer in \\boxed{}.",
    "system user assistant question answer sort digits add reversed",
]


def write_tiny_tokenizer(out_dir: str, vocab_size: int = 320) -> int:
    """Writes tokenizer.json, tokenizer_config.json and generation_config.json into out_dir.

    Digits are split one per token (as Qwen2's tokenizer does). EOS is "<|im_end|>", padding
    "<|endoftext|>", there is no BOS.

    Returns:
      The number of ids the tokenizer defines (<= vocab_size).
    """
    os.makedirs(out_dir, exist_ok=True)
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None,
                   "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "chat_template": CHATML_TEMPLATE, "model_max_length": 4096}, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
                   "pad_token_id": ids["<|endoftext|>"]}, f, indent=2)
    return tok.get_vocab_size(with_added_tokens=True)


def write_random_checkpoint(out_dir: str, cfg: ModelConfig, seed: int = 0, *, tokenizer: bool = True,
                            max_shard_bytes: int = 2 * 1024**3) -> list[str]:
    """Writes a randomly initialised model (``init_params(cfg, seed)``) as an HF directory.

    Args:
      out_dir: destination directory.
      cfg: the architecture; cfg.vocab_size must cover the tiny tokenizer's ids if tokenizer=True.
      seed: init seed.
      tokenizer: also write the tiny tokenizer (and put its token ids in config.json).
      max_shard_bytes: shard size limit.

    Returns:
      The shard file names.
    """
    _, params = init_params(cfg, seed)
    files = export_checkpoint(cfg, params, out_dir, max_shard_bytes=max_shard_bytes)
    if tokenizer:
        n = write_tiny_tokenizer(out_dir)
        if n > cfg.vocab_size:
            raise ValueError(f"vocab_size: {cfg.vocab_size} < the tiny tokenizer's {n} ids")
        with open(os.path.join(out_dir, "generation_config.json")) as f:
            gen = json.load(f)
        path = os.path.join(out_dir, "config.json")
        with open(path) as f:
            hf = json.load(f)
        hf.update(eos_token_id=gen["eos_token_id"][0], pad_token_id=gen["pad_token_id"], bos_token_id=None)
        with open(path, "w") as f:
            json.dump(hf, f, indent=2)
    return files
