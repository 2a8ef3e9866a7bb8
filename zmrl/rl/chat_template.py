"""How a problem becomes prompt text: a tokenizer's chat template, or zmrl's plain one-line template.

Recipe key ``data.prompt_format`` picks (``PROMPT_FORMATS``):

- ``auto``: the tokenizer's chat template when it has one, else ``PROMPT_TEMPLATE``;
- ``chat_template``: the tokenizer's chat template, and a tokenizer without one is an error;
- ``plain``: ``PROMPT_TEMPLATE`` even when the tokenizer has a chat template (a base model).

A chat template renders one user turn holding the question and the ``\\boxed{}`` instruction (the answer
format the reward reads), with the generation prompt (the assistant turn's opening) added.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

__all__ = ["CHAT_USER_TEMPLATE", "PROMPT_FORMATS", "PROMPT_TEMPLATE", "ChatPrompt", "NoChatTemplateError",
           "read_chat_template"]

# Every prompt byte costs CPU time in rollout and training, so the instruction is as short as it can
# be while still naming the answer format that the reward (zmrl.rl.reward) reads.
PROMPT_TEMPLATE = "{question}\nAnswer in \\boxed{{}}.\n"
# the user turn given to a chat template
CHAT_USER_TEMPLATE = "{question}\nPut the final answer in \\boxed{{}}."
PROMPT_FORMATS = ("auto", "chat_template", "plain")


class NoChatTemplateError(ValueError):
    """``data.prompt_format=chat_template`` with a tokenizer that has no chat template."""


def read_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    """A checkpoint's chat template: ``chat_template.jinja`` beside ``tokenizer_config.json``, else the config's
    ``chat_template`` (a string, or a list of named templates of which ``default`` is used)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template.strip() else None


class ChatPrompt(ABC):
    """``apply_chat_template(question) -> str`` by ``prompt_format``; a subclass provides ``chat_template``
    (the template text or None) and ``_render(messages)``."""

    prompt_format: str = "auto"
    chat_template: str | None = None

    def set_prompt_format(self, prompt_format: str) -> None:
        """Pick the prompt format; ``chat_template`` without a template raises NoChatTemplateError."""
        if prompt_format not in PROMPT_FORMATS:
            raise ValueError(f"prompt format must be one of {PROMPT_FORMATS}, got {prompt_format!r}")
        if prompt_format == "chat_template" and not self.chat_template:
            raise NoChatTemplateError(f"the tokenizer {self!r} has no chat template (looked for "
                                      "tokenizer_config.json 'chat_template' and chat_template.jinja)")
        self.prompt_format = prompt_format

    @property
    def uses_chat_template(self) -> bool:
        return self.prompt_format != "plain" and bool(self.chat_template)

    def apply_chat_template(self, question: str) -> str:
        if not self.uses_chat_template:
            return PROMPT_TEMPLATE.format(question=question.strip())
        content = CHAT_USER_TEMPLATE.format(question=question.strip())
        return self._render([{"role": "user", "content": content}])

    @abstractmethod
    def _render(self, messages: list[dict[str, str]]) -> str:
        """The template applied to ``messages`` with the generation prompt added (each tokenizer's own way)."""
