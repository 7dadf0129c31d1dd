"""A checkpoint's own tokenizer (``tokenizer.json``, fast tokenizer) and chat template, offline.

    tok = HFTokenizer("/ckpt/Qwen2.5-0.5B-Instruct")
    ids = tok.apply_chat_template([{"role": "user", "content": "1+1?"}])   # ends with the assistant header

Same interface as CharTokenizer (pad_id, bos_id, eos_id, vocab_size, encode, decode) plus
``apply_chat_template``. EOS and padding ids come from the checkpoint's generation_config.json /
config.json (as transformers' generate uses them); the chat template is rendered with Jinja2 the
way transformers does (sandboxed, trim_blocks, lstrip_blocks, ``raise_exception``, ``tojson``).
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _token_text(value: Any) -> str | None:
    # tokenizer_config stores special tokens as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


class HFTokenizer:
    """The fast tokenizer of a Hugging Face checkpoint directory.

    Raises (at construction):
      FileNotFoundError: if the directory has no tokenizer.json.
      ValueError: if no EOS id can be found in the configs or the tokenizer.
    """

    def __init__(self, path: str) -> None:
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no tokenizer.json in checkpoint directory {path!r} "
                                    "(only fast tokenizers are supported)")
        self.path = path
        self._tok = tokenizers.Tokenizer.from_file(file)
        tok_cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        model_cfg = _read_json(os.path.join(path, "config.json"))
        gen_cfg = _read_json(os.path.join(path, "generation_config.json"))
        self.special_tokens = {
            key: _token_text(tok_cfg.get(key)) for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        self.chat_template = self._find_chat_template(path, tok_cfg)

        # EOS: the ids generate() stops on; when several, prefer the tokenizer's own eos token (an
        # instruct model's end-of-turn), else the first.
        eos_ids = _as_ids(gen_cfg.get("eos_token_id")) or _as_ids(model_cfg.get("eos_token_id"))
        tok_eos = self._id_of(self.special_tokens["eos_token"])
        if not eos_ids and tok_eos is not None:
            eos_ids = [tok_eos]
        if not eos_ids:
            raise ValueError(f"checkpoint {path!r}: no eos_token_id in generation_config.json or "
                             "config.json and no eos_token in tokenizer_config.json")
        self.eos_ids = tuple(eos_ids)
        self._eos = tok_eos if tok_eos in eos_ids else eos_ids[0]
        pad = _as_ids(gen_cfg.get("pad_token_id")) or _as_ids(model_cfg.get("pad_token_id"))
        tok_pad = self._id_of(self.special_tokens["pad_token"])
        # Padding is always masked, so any valid id works; EOS is the usual fallback.
        self._pad = pad[0] if pad else (tok_pad if tok_pad is not None else self._eos)
        self._bos = self._id_of(self.special_tokens["bos_token"])

    @staticmethod
    def _find_chat_template(path: str, tok_cfg: dict[str, Any]) -> str | None:
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file) as f:
                return f.read()
        template = tok_cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        return template

    def _id_of(self, text: str | None) -> int | None:
        return None if text is None else self._tok.token_to_id(text)

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def bos_id(self) -> int | None:
        """The BOS id, or None for tokenizers without one (Qwen): then prompts start without it."""
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer defines (base vocabulary plus added tokens)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of text, without BOS/EOS (special-token text such as "<|im_end|>" maps to its id)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of ids; skip_special_tokens drops BOS/EOS/chat markers."""
        return self._tok.decode([int(t) for t in ids], skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat template applied to messages, as text.

        Raises:
          ValueError: if the checkpoint has no chat template.
        """
        if not self.chat_template:
            raise ValueError(f"checkpoint {self.path!r} has no chat template "
                             "(tokenizer_config.json chat_template or chat_template.jinja)")
        return _compile(self.chat_template).render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            tools=None,
            documents=None,
            **{k: v for k, v in self.special_tokens.items() if v is not None},
        )

    def apply_chat_template(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``render_chat(messages)`` (its BOS, if any, comes from the template)."""
        return self.encode(self.render_chat(messages, add_generation_prompt))


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


_TEMPLATES: dict[str, jinja2.Template] = {}


def _compile(source: str) -> jinja2.Template:
    template = _TEMPLATES.get(source)
    if template is None:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        template = _TEMPLATES[source] = env.from_string(source)
    return template
