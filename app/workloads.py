"""The fixed workloads of the bench and the app: code_gen, code_edit, code_echo, prose (assets/workloads)."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from engine.errors import EngineError

WORKLOAD_DIR = Path(__file__).resolve().parent.parent / "assets" / "workloads"
WORKLOAD_NAMES = ("code_gen", "code_edit", "code_echo", "prose")


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    prompt: str  # for a base model: text the model continues
    chat: str  # the same task as a user message, for models with a chat template

    def prompt_for(self, tokenizer) -> str:
        """The chat prompt when the tokenizer has a chat template (and jinja2 is there), else the base prompt."""
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            return self.prompt
        try:
            import jinja2  # noqa: F401
        except ImportError:
            return self.prompt
        messages = [{"role": "user", "content": self.chat}]
        render = getattr(tokenizer, "render_chat", None)
        if render is not None:  # the engine's tokenizer: sandboxed, with a time and a size limit
            return render(messages, add_generation_prompt=True)
        from engine.tokenizer import render_chat

        return render_chat(template, messages, True)


def load_workloads(directory: Path = WORKLOAD_DIR) -> dict[str, Workload]:
    out: dict[str, Workload] = {}
    for name in WORKLOAD_NAMES:
        path = directory / f"{name}.toml"
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
            out[name] = Workload(name, data.get("description", ""), data["prompt"], data.get("chat", data["prompt"]))
        except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:
            raise EngineError(f"{path}: workload cannot be read ({exc})") from None
    return out
