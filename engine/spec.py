"""One speculative round: draft -> verify -> accept -> roll back. Plain greedy is a round with no drafts.

State contract at a round boundary (see engine/state.py): the session has N committed tokens; the target
has consumed the first N-1 (the last committed token is the next verify input); hidden[r] holds the
target's post-norm hidden of every consumed position r >= mtp_len.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import ops

from .errors import EngineError
from .model import Model
from .settings import EngineSettings
from .state import SessionState

# A test drafter: given the committed tokens and the depth, propose drafts (replaces the MTP head).
Drafter = Callable[[list[int], int], list[int]]


@dataclass
class RoundOutcome:
    tokens: list[int]
    from_draft: list[bool]
    drafted: int
    accepted: int
    time_draft_s: float
    time_verify_s: float
    time_accept_s: float
    hit_eos: bool
    cancelled: bool = False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prefill(model: Model, state: SessionState) -> int:
    """Bring the target up to N-1 consumed tokens (the prompt minus its last token). Returns tokens fed."""
    n = len(state.tokens)
    todo = state.tokens[state.target_len : n - 1]
    if not todo:
        return 0
    start = state.target_len
    ids = torch.tensor(todo, dtype=torch.long, device=model.device)
    hidden = model.forward(ids, state)
    state.hidden[start : start + len(todo)] = hidden
    return len(todo)


def refill(model: Model, state: SessionState) -> None:
    """Fallback when a rollback cannot be served: reset the recurrent state and re-prefill the committed
    prefix (tokens are kept; the MTP head catches up from row 0)."""
    tokens = list(state.tokens)
    state.reset()
    state.tokens = tokens
    prefill(model, state)


def _draft(
    model: Model, state: SessionState, settings: EngineSettings, max_drafts: int
) -> tuple[list[int], list[float]]:
    """MTP drafting. First forward = the catch-up rows plus draft step 1; then one row per step."""
    n = len(state.tokens)
    if n < 2 or max_drafts <= 0:
        return [], []
    first = state.mtp_len
    toks = torch.tensor(state.tokens[first + 1 : n], dtype=torch.long, device=model.device)
    y = model.mtp_forward(toks, state.hidden[first : n - 1], first, state)[-1:]
    state.mtp_len = n - 1
    sub = settings.sub_vocab if settings.chain else 0
    drafts: list[int] = []
    probs: list[float] = []
    for step in range(max_drafts):
        if settings.chain:
            # Pick on the device; only (token, prob) leave the op.
            tok_t, prob_t = ops.argmax_prob(model.lm_head(y, sub), sub)
            tok, prob = int(tok_t[0]), float(prob_t[0])
        else:
            # The "before": the whole vocabulary row goes to the host, which picks.
            row = model.lm_head(y).float().cpu()[0]
            tok = int(row.argmax())
            prob = float(torch.softmax(row, dim=-1)[tok])
        if prob < settings.p_min:
            break
        drafts.append(tok)
        probs.append(prob)
        if step + 1 < max_drafts:
            t = torch.tensor([tok], dtype=torch.long, device=model.device)
            y = model.mtp_forward(t, y, n - 1 + step, state)
    return drafts, probs


def run_round(
    model: Model,
    state: SessionState,
    settings: EngineSettings,
    budget: int,
    eos_ids: frozenset[int],
    is_cancelled: Callable[[], bool] = lambda: False,
    drafter: Drafter | None = None,
) -> RoundOutcome:
    """Emit between 1 and min(budget, depth+1) tokens (0 when cancelled before verification)."""
    if settings.sub_vocab > model.cfg.vocab_size:
        raise EngineError(
            f"sub_vocab {settings.sub_vocab} is larger than the model's vocabulary ({model.cfg.vocab_size}); "
            "use 0 (full) or a smaller value"
        )
    n = len(state.tokens)
    if state.target_len != n - 1:
        refill(model, state)
    t0 = time.perf_counter()
    # Drafts beyond what may be emitted or what fits the context are wasted work: cap them.
    max_drafts = min(settings.draft_depth, budget - 1, state.max_context - n) if settings.speculative else 0
    drafts: list[int] = []
    probs: list[float] = []
    if drafter is not None:
        drafts = list(drafter(list(state.tokens), max(max_drafts, 0)))[: max(max_drafts, 0)]
        probs = [1.0] * len(drafts)
    elif model.has_mtp:
        drafts, probs = _draft(model, state, settings, max_drafts)
    _sync(model.device)
    t1 = time.perf_counter()
    if is_cancelled():
        return RoundOutcome([], [], 0, 0, t1 - t0, 0.0, 0.0, False, cancelled=True)

    dev = model.device
    ids = torch.tensor([state.tokens[-1], *drafts], dtype=torch.long, device=dev)
    hidden = model.forward(ids, state)
    target_tokens, _ = ops.argmax_prob(model.lm_head(hidden), 0)
    cache_len = torch.tensor([n - 1], dtype=torch.long, device=dev)
    out = torch.empty(len(drafts) + 3, dtype=torch.long, device=dev)
    ops.greedy_accept(
        torch.tensor(drafts, dtype=torch.long, device=dev),
        torch.tensor(probs, dtype=torch.float32, device=dev),
        target_tokens,
        settings.p_min if drafter is None else 0.0,
        cache_len,
        out,
    )
    got = out.tolist()  # the round's one device-to-host read
    t2 = time.perf_counter()

    k = got[0] - 1
    emitted = got[2 : 2 + k + 1]
    from_draft = [True] * k + [False]
    hit_eos = False
    for i, tok in enumerate(emitted):
        if tok in eos_ids:
            emitted, from_draft, hit_eos = emitted[: i + 1], from_draft[: i + 1], True
            break
    emitted, from_draft = emitted[:budget], from_draft[:budget]
    e = len(emitted)
    state.hidden[n - 1 : n - 1 + e] = hidden[:e]
    state.tokens.extend(emitted)
    if not state.rollback(n - 1 + e):
        refill(model, state)
    _sync(model.device)
    t3 = time.perf_counter()
    return RoundOutcome(emitted, from_draft, len(drafts), sum(from_draft), t1 - t0, t2 - t1, t3 - t2, hit_eos)
