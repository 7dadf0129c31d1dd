"""The checkpoint tokenizer: ids from the checkpoint's configs, chat template as transformers renders it."""

import json

import pytest

from cadence.learner.models.hf_random import CHATML_TEMPLATE, write_tiny_tokenizer
from cadence.learner.models.hf_tokenizer import HFTokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1/2 + 12?"}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(str(d))
    return d


def test_special_ids_come_from_the_checkpoint_configs(tok_dir):
    tok = HFTokenizer(str(tok_dir))
    gen = json.loads((tok_dir / "generation_config.json").read_text())
    assert tok.eos_id == gen["eos_token_id"][0] == tok.encode("<|im_end|>")[0]  # the tokenizer's own eos wins
    assert tok.eos_ids == tuple(gen["eos_token_id"])
    assert tok.pad_id == gen["pad_token_id"] == tok.encode("<|endoftext|>")[0]
    assert tok.bos_id is None
    assert tok.vocab_size <= 320


def test_eos_falls_back_to_first_config_id_when_tokenizer_eos_not_listed(tmp_path):
    write_tiny_tokenizer(str(tmp_path))
    endoftext = HFTokenizer(str(tmp_path)).encode("<|endoftext|>")[0]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": endoftext}))
    tok = HFTokenizer(str(tmp_path))
    assert tok.eos_id == endoftext and tok.pad_id == endoftext  # no pad id anywhere -> tokenizer's pad


def test_encode_decode_round_trip_without_special_tokens(tok_dir):
    tok = HFTokenizer(str(tok_dir))
    text = "Compute 1/2 + 1/4. The answer is \\boxed{3/4}."
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eos_id], skip_special_tokens=True) == text
    assert [tok.encode(d) for d in "0123456789"] == [[i] for i in tok.encode("0123456789")]  # one id per digit


def test_chat_template_matches_transformers(tok_dir):
    transformers = pytest.importorskip("transformers")
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    tok = HFTokenizer(str(tok_dir))
    for messages in (MESSAGES, MESSAGES[1:]):
        for gen in (True, False):
            want = ref_tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert tok.render_chat(messages, gen) == want
            ids = ref_tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            assert tok.apply_chat_template(messages, gen) == list(ids)
    assert tok.render_chat(MESSAGES[1:]).endswith("<|im_start|>assistant\n")


def test_chat_template_file_takes_precedence(tmp_path):
    write_tiny_tokenizer(str(tmp_path))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    tok = HFTokenizer(str(tmp_path))
    assert tok.render_chat(MESSAGES) == "[Be brief.][What is 1/2 + 12?]"
    assert CHATML_TEMPLATE not in tok.chat_template


def test_missing_files_and_template_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer(str(tmp_path))
    write_tiny_tokenizer(str(tmp_path))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no chat template"):
        HFTokenizer(str(tmp_path)).apply_chat_template(MESSAGES)
