"""Prompts of the text tasks (jsonl, word_problems) in a checkpoint's own tokens: raw text after
BOS, or the user turn (after an optional system message) through the checkpoint's chat template."""

from __future__ import annotations

from cadence.actors.tasks.config import TaskConfig


def check_text_tokenizer(cfg: TaskConfig, tokenizer, task_name: str) -> None:
    """Raises ValueError("<field>: <problem>") when the tokenizer cannot carry cfg.format."""
    if tokenizer is None:
        raise ValueError(f"name: the {task_name} task needs the checkpoint's tokenizer (set model.path)")
    if cfg.format == "chat" and not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError("format: 'chat' needs a tokenizer with a chat template (set model.path)")


def encode_user_text(cfg: TaskConfig, tokenizer, text: str) -> tuple[int, ...]:
    """The prompt tokens of `text` as task.format says: "chat" (task.system_prompt first, if any)
    or "plain" (BOS, if the tokenizer has one, then the text)."""
    if cfg.format == "chat":
        system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        return tuple(tokenizer.apply_chat_template([*system, {"role": "user", "content": text}]))
    bos = () if tokenizer.bos_id is None else (tokenizer.bos_id,)
    return (*bos, *tokenizer.encode(text))
