import re
import random

import numpy as np
import pytest

from cadence.learner.models.char_tokenizer import ALPHABET, CharTokenizer


@pytest.fixture
def tok():
    return CharTokenizer()


def test_special_ids_are_fixed(tok):
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)


def test_digits_come_first_then_symbols_then_letters(tok):
    assert tok.encode("0123456789") == list(range(4, 14))
    assert tok.encode("+-=>:,| ") == list(range(14, 22))
    assert tok.encode("az") == [22, 47]
    assert [tok.digit_id(d) for d in range(10)] == list(range(4, 14))


def test_vocab_size_counts_defined_ids_and_fits_default_model_vocab(tok):
    assert tok.vocab_size == 4 + len(ALPHABET) == 48
    assert tok.vocab_size < 64  # the model's default vocab leaves junk ids [48, 64)
    # Every defined non-special id decodes to exactly one character.
    for i in range(4, tok.vocab_size):
        assert len(tok.decode([i])) == 1


def test_encode_adds_no_bos_or_eos(tok):
    ids = tok.encode("12>")
    assert tok.bos_id not in ids and tok.eos_id not in ids and len(ids) == 3
    assert tok.encode("") == []


def test_round_trip_full_alphabet_and_random_strings(tok):
    assert tok.decode(tok.encode(ALPHABET)) == ALPHABET
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randrange(0, 30)))
        assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("bad", ["A", "?", "\n", "é"])
def test_encode_unknown_character_raises_naming_it(tok, bad):
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        tok.encode("12" + bad + "3")


def test_decode_renders_specials_visibly(tok):
    text = tok.decode([tok.bos_id, tok.digit_id(5), tok.eos_id, tok.pad_id, tok.unk_id])
    assert text == "<bos>5<eos><pad><unk>"


def test_decode_renders_junk_ids_visibly_and_never_drops_them(tok):
    assert tok.decode([tok.digit_id(1), 57, tok.digit_id(2)]) == "1<junk:57>2"
    assert tok.decode([tok.vocab_size]) == f"<junk:{tok.vocab_size}>"
    assert tok.decode([63, -1]) == "<junk:63><junk:-1>"


def test_decode_accepts_numpy_ids(tok):
    ids = np.asarray(tok.encode("42>") + [tok.eos_id], dtype=np.int32)
    assert tok.decode(ids) == "42><eos>"


@pytest.mark.parametrize("bad", [-1, 10, 2.0, "3", True, None])
def test_digit_id_rejects_non_digits(tok, bad):
    with pytest.raises(ValueError):
        tok.digit_id(bad)


def test_digit_id_accepts_numpy_integers(tok):
    assert tok.digit_id(np.int64(7)) == tok.encode("7")[0]
