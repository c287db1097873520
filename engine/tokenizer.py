"""`tokenizer.json` via the `tokenizers` library, plus the bits of tokenizer_config.json SpecDeck uses.

Every file is read as untrusted (engine/untrusted.py: regular files only, size caps). The chat template
is Jinja from the model folder: it is rendered in Jinja's immutable sandbox, like transformers does, and
on top of that with a time limit and a size limit (render_chat below), so a template that loops or builds
a huge string ends in one line naming its file instead of a hang or an exhausted memory.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .config import MAX_VOCAB, eos_id_list
from .errors import EngineError, ModelLoadError
from .untrusted import MiB, exists, load_json, one_line, read_capped

MAX_TOKENIZER_BYTES = 256 * MiB  # Qwen's tokenizer.json is ~11 MiB
MAX_TOKENIZER_CONFIG_BYTES = 32 * MiB
MAX_GENERATION_CONFIG_BYTES = 1 * MiB
MAX_TEMPLATE_BYTES = 1 * MiB  # real chat templates are a few KiB
TEMPLATE_SECONDS = 2.0  # compile + render of one chat prompt
TEMPLATE_MAX_CHARS = 1_000_000  # any one value or the output, plus 4x the messages' own text
TEMPLATE_MAX_INT = 100_000  # the largest number a template may pass to a function (Jinja's range limit)


class Tokenizer:
    def __init__(self, model_dir: Path, eos_ids: tuple[int, ...]) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = model_dir / "tokenizer.json"
        if not exists(path):
            raise ModelLoadError(f"{path}: tokenizer.json not found; SpecDeck needs the model's tokenizer.json")
        data = read_capped(path, MAX_TOKENIZER_BYTES, "tokenizer.json", ModelLoadError)
        try:
            self._tok = HFTokenizer.from_str(data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ModelLoadError(f"{path}: cannot read tokenizer (not UTF-8 text: byte {exc.start})") from None
        except Exception as exc:
            raise ModelLoadError(f"{path}: cannot read tokenizer ({one_line(exc)})") from None
        self.chat_template: str | None = None
        self.chat_template_source: Path | None = None
        cfg_path = model_dir / "tokenizer_config.json"
        if exists(cfg_path):
            raw = load_json(cfg_path, MAX_TOKENIZER_CONFIG_BYTES, "tokenizer_config.json", ModelLoadError)
            template = raw.get("chat_template") if isinstance(raw, dict) else None
            if template is not None:
                self.chat_template = pick_template(template, cfg_path)
                self.chat_template_source = cfg_path
        jinja = model_dir / "chat_template.jinja"  # where newer checkpoints keep it
        if self.chat_template is None and exists(jinja):
            data = read_capped(jinja, MAX_TEMPLATE_BYTES, "chat template", ModelLoadError)
            try:
                self.chat_template = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ModelLoadError(f"{jinja}: chat template is not UTF-8 text (byte {exc.start})") from None
            self.chat_template_source = jinja
        if self.chat_template is not None and len(self.chat_template) > MAX_TEMPLATE_BYTES:
            raise ModelLoadError(f"{self.chat_template_source}: chat template is larger than 1 MiB; it is not used")
        gen = model_dir / "generation_config.json"
        ids = list(eos_ids)
        if exists(gen):
            raw = load_json(gen, MAX_GENERATION_CONFIG_BYTES, "generation_config.json", ModelLoadError)
            eos = raw.get("eos_token_id") if isinstance(raw, dict) else None
            # Checked for type here; the model's vocabulary (maybe larger than the tokenizer's) is not known yet.
            ids += eos_id_list(eos, MAX_VOCAB, f"{gen}: eos_token_id")
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        self.eos_token_id: int | None = min(ids) if ids else None
        self._compiled: Any = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def decode_one(self, token_id: int) -> str:
        """One token's text, special tokens shown (for listings such as `specdeck subvocab show`)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def special_ids(self) -> list[int]:
        """The ids of the tokenizer's special added tokens (end-of-text, chat markers, ...)."""
        return sorted(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The model's chat template applied to `messages`, within TEMPLATE_SECONDS and the size limits.
        Any failure is one EngineError naming the template's file."""
        if self.chat_template is None:
            raise EngineError("the model has no chat template")
        source = self.chat_template_source or "chat template"
        return render_chat(self.chat_template, messages, add_generation_prompt, str(source))


def pick_template(template: Any, path: Path) -> str:
    """chat_template as tokenizer_config.json holds it: a string, or Hugging Face's list of named
    templates ({"name": ..., "template": ...}), of which SpecDeck uses "default"."""
    if isinstance(template, str):
        return template
    if isinstance(template, list) and all(
        isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str) for t in template
    ):
        named = {t["name"]: t["template"] for t in template}
        if "default" in named:
            return named["default"]
        raise ModelLoadError(
            f"{path}: chat_template lists templates {', '.join(ascii(n) for n in list(named)[:8])} but none "
            "named 'default'"
        )
    raise ModelLoadError(
        f"{path}: chat_template must be a string or a list of {{name, template}} objects, got {type(template).__name__}"
    )


# ---- the bounded sandbox ---------------------------------------------------------------------------


class _OutOfTime(BaseException):
    """Raised from the trace function at the deadline. A BaseException, so no `except Exception` in a
    filter can swallow it (the trace function is gone once it has raised)."""


_FORMAT_WIDTH = re.compile(r"\d{6,}")  # a format width or precision of a million or more


def _weight(value: Any) -> int:
    """Roughly how many characters a value holds (strings, and lists/tuples/dicts one level down)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        return len(value) + sum(len(v) if isinstance(v, (str, list, tuple, dict)) else 1 for v in value)
    if isinstance(value, dict):
        return len(value) + sum(len(v) if isinstance(v, (str, list, tuple, dict)) else 1 for v in value.values())
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 4096:
        return value.bit_length()
    return 1


class _Limits:
    def __init__(self, seconds: float, max_chars: int) -> None:
        self.deadline = time.monotonic() + seconds
        self.max_chars = max_chars
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1
        if not self.ticks & 255 and time.monotonic() > self.deadline:
            raise _OutOfTime

    def check(self, value: Any, what: str = "a value") -> Any:
        if _weight(value) > self.max_chars:
            from jinja2.sandbox import SecurityError

            raise SecurityError(f"{what} larger than {self.max_chars} characters")
        return value

    def check_args(self, args: tuple, kwargs: dict) -> None:
        from jinja2.sandbox import SecurityError

        for v in (*args, *kwargs.values()):
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > TEMPLATE_MAX_INT:
                raise SecurityError(f"the number {v} is larger than {TEMPLATE_MAX_INT}")
            self.check(v, "an argument")


@functools.cache
def _environment_class() -> type:
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class LimitedCodeGenerator(CodeGenerator):
        def visit_Concat(self, node, frame) -> None:  # noqa: N802 (Jinja's name): `a ~ b`, checked
            self.write("environment.limited_join((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class LimitedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = LimitedCodeGenerator
        intercepted_binops = frozenset({"*", "**", "%", "+", "//"})
        limits: _Limits

        def limited_join(self, parts: tuple) -> str:
            self.limits.tick()
            texts = [str(p) for p in parts]
            if sum(len(t) for t in texts) > self.limits.max_chars:
                raise SecurityError(f"a joined string larger than {self.limits.max_chars} characters")
            return "".join(texts)

        def call_binop(self, context, operator, left, right):
            limits = self.limits
            limits.tick()
            numbers = isinstance(left, (int, float)) and isinstance(right, (int, float))
            if operator == "**" and numbers and abs(right) > 64 and abs(left) > 1:
                raise SecurityError(f"the power {right} is too large")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    repeated = isinstance(seq, (str, list, tuple)) and isinstance(n, int) and n > 0
                    if repeated and _weight(seq) * n > limits.max_chars:
                        raise SecurityError(f"a repeated value larger than {limits.max_chars} characters")
            if operator == "%" and isinstance(left, str) and _FORMAT_WIDTH.search(left):
                raise SecurityError("a format width of a million or more")
            result = super().call_binop(context, operator, left, right)
            return limits.check(result, "a result")

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
            limits = __self.limits
            limits.tick()
            limits.check_args(args, kwargs)
            owner = getattr(__obj, "__self__", None)
            if isinstance(owner, str):
                name = getattr(__obj, "__name__", "")
                new = args[1] if name == "replace" and len(args) >= 2 else ""
                if isinstance(new, str) and len(owner) * max(1, len(new)) > limits.max_chars and new:
                    raise SecurityError(f"a replaced string larger than {limits.max_chars} characters")
            return limits.check(super().call(__context, __obj, *args, **kwargs), "a result")

        def getattr(self, obj, attribute):
            self.limits.tick()
            if isinstance(obj, str) and attribute in ("format", "format_map") and _FORMAT_WIDTH.search(obj):
                raise SecurityError("a format width of a million or more")
            return self.limits.check(super().getattr(obj, attribute))

        def getitem(self, obj, argument):
            self.limits.tick()
            return self.limits.check(super().getitem(obj, argument))

    return LimitedEnvironment


def _limited_filter(env: Any, func: Any) -> Any:
    from jinja2.sandbox import SecurityError

    @functools.wraps(func)  # keeps Jinja's pass_context / pass_environment marks
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        limits = env.limits
        limits.tick()
        limits.check_args(tuple(a for a in args if not _is_jinja_object(a)), kwargs)
        if func.__name__ in ("do_format",) and args and isinstance(args[0], str) and _FORMAT_WIDTH.search(args[0]):
            raise SecurityError("a format width of a million or more")
        return limits.check(func(*args, **kwargs), "a filter's result")

    return wrapper


def _is_jinja_object(value: Any) -> bool:
    module = type(value).__module__ or ""
    return module.startswith("jinja2")


def _make_environment(limits: _Limits) -> Any:
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols

    env = _environment_class()(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.limits = limits
    env.globals.pop("lipsum", None)

    def raise_exception(message: str) -> None:  # as transformers provides it
        raise TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return time.strftime(fmt)

    env.globals |= {"raise_exception": raise_exception, "strftime_now": strftime_now}
    env.filters["tojson"] = tojson
    env.filters = {name: _limited_filter(env, f) for name, f in env.filters.items()}
    env.tests = {name: _limited_filter(env, f) for name, f in env.tests.items()}
    return env


_COMPILED: dict[str, Any] = {}  # template text -> compiled in its own limited environment
_RENDER_LOCK = threading.Lock()  # the environment's limits are per render


def render_chat(
    template: str,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
    source: str = "chat template",
    seconds: float | None = None,
    max_chars: int | None = None,
) -> str:
    """Compile and render a chat template in the sandbox, within `seconds` and a size limit (any value or
    the output: `max_chars`, by default TEMPLATE_MAX_CHARS plus 4x the messages' text). Raises one-line
    EngineError naming `source` for a template that is blocked, fails, loops or grows too large.
    `seconds` defaults to TEMPLATE_SECONDS."""
    if seconds is None:
        seconds = TEMPLATE_SECONDS
    if max_chars is None:
        max_chars = TEMPLATE_MAX_CHARS + 4 * sum(_weight(m.get("content", "")) for m in messages)
    limits = _Limits(seconds, max_chars)

    def tracer(frame, event, arg):
        limits.tick()
        return local if frame.f_code.co_filename == "<template>" else None

    def local(frame, event, arg):
        if event == "line":
            limits.tick()
        return local

    def fail(why: str) -> EngineError:
        return EngineError(f"{source}: chat template failed ({why}); fix the template or remove it from the model")

    previous = sys.gettrace()
    _RENDER_LOCK.acquire()
    sys.settrace(tracer)
    try:
        compiled = _COMPILED.get(template)
        if compiled is None:
            compiled = _make_environment(limits).from_string(template)
            if len(_COMPILED) >= 8:
                _COMPILED.clear()
            _COMPILED[template] = compiled
        compiled.environment.limits = limits
        pieces, total = [], 0
        for piece in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt):
            total += len(piece)
            if total > max_chars:
                raise fail(f"the output is larger than {max_chars} characters")
            pieces.append(piece)
            limits.tick()
        return "".join(pieces)
    except _OutOfTime:
        raise fail(f"it ran for more than {seconds:g} s") from None
    except EngineError:
        raise
    except RecursionError:
        raise fail("it nests or recurses too deeply") from None
    except MemoryError:
        raise fail("it ran out of memory") from None
    except Exception as exc:
        raise fail(f"{type(exc).__name__}: {one_line(exc, 200)}") from None
    finally:
        sys.settrace(previous)
        _RENDER_LOCK.release()
