"""`tokenizer.json` via the `tokenizers` library, plus the bits of tokenizer_config.json SpecDeck uses."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import ModelLoadError


class Tokenizer:
    def __init__(self, model_dir: Path, eos_ids: tuple[int, ...]) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: tokenizer.json not found; SpecDeck needs the model's tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:
            raise ModelLoadError(f"{path}: cannot read tokenizer ({str(exc).splitlines()[0]})") from None
        self.chat_template: str | None = None
        cfg_path = model_dir / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                self.chat_template = json.loads(cfg_path.read_text(encoding="utf-8")).get("chat_template")
            except (json.JSONDecodeError, UnicodeDecodeError):
                self.chat_template = None
        jinja = model_dir / "chat_template.jinja"  # where newer checkpoints keep it
        if self.chat_template is None and jinja.is_file():
            self.chat_template = jinja.read_text(encoding="utf-8")
        gen = model_dir / "generation_config.json"
        ids = list(eos_ids)
        if gen.is_file():
            try:
                eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id")
                ids += eos if isinstance(eos, list) else ([eos] if isinstance(eos, int) else [])
            except (json.JSONDecodeError, UnicodeDecodeError):
                pass
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        self.eos_token_id: int | None = min(ids) if ids else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)
