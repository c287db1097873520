"""One speculative round: draft -> verify -> accept -> roll back. Plain greedy is a round with no drafts.

State contract at a round boundary (see engine/state.py): the session has N committed tokens; the target
has consumed the first N-1 (the last committed token is the next verify input); hidden[r] holds the
target's post-norm hidden of every consumed position r >= mtp_len.

Data flow of one round (the same code on every device; on CUDA the two device phases are captured graphs):
  host  stages [target length, first pending MTP row, last token, catch-up tokens] into static buffers
  draft MTP catch-up rows + step 1, then steps 2..n; chain on: argmax on the device over the sub-vocab
        (ids 0..N-1, or the first N ids of the model's sub-vocab order, mapped back to token ids on the
        device), (token, prob) into ids_buf / probs_buf — no host decision; chain off: each step's full
        vocabulary row goes to the host, which picks (the seed's "before")
  verify target over ids_buf[:n+1]; hidden rows into state.hidden; argmax; greedy acceptance writes the
        emitted count, the tokens and the new cache length into device buffers
  read  out_buf -> pinned host memory: the round's one device-to-host synchronisation
  host  tags the snapshot planes, rolls back to the accepted length, applies EOS and the token budget

Synthetic acceptance (`settings.synthetic_rates`, a measurement mode: greedy only) keeps this flow and its work:
the verify's acceptance is `synthetic_accept`, which draws how many drafts pass from the per-position rates
(hash of (SYNTHETIC_SEED, start_buf, slot), on the device) instead of comparing them with the target's picks, and
writes the same out_buf: the accepted drafts, then the target's token after them, so rollback is unchanged. The
target consumed exactly those drafts, so its state stays consistent; the text is not the model's output.

Sampled rounds (`sampling` with temperature > 0, engine/sampling.py) keep this flow: the draft draws each token
from its processed distribution q (its row kept in the session's q_buf), the verify turns the target's rows into
p and `spec_accept` applies the speculative-sampling rule, writing the same out_buf; random numbers come from a
hash of (seed_buf, start_buf, slot, purpose), so graphs replay without the host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import ops
from kernels import reference as ref_ops

from .decode_model import DecodeModel
from .errors import EngineError
from .plans import PlanPool
from .sampling import SamplingBuffers, SamplingParams, active, buffers_for
from .settings import MAX_DRAFT_DEPTH, EngineSettings
from .state import SessionState

# A test drafter: given the committed tokens and the depth, propose drafts (replaces the MTP head).
Drafter = Callable[[list[int], int], list[int]]
# Catch-up widths above this (after a prompt or plain-greedy rounds) run eagerly, never as a plan.
MAX_CAPTURED_CATCHUP = MAX_DRAFT_DEPTH + 1
# The seed of synthetic acceptance's draws: fixed, so a synthetic run is reproducible (its draws are keyed by
# the round's start position too, so every round draws fresh numbers).
SYNTHETIC_SEED = 15


@dataclass(kw_only=True)  # built with keywords only: fields of the same type cannot be swapped unseen
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
    synthetic: bool = False  # synthetic acceptance: the accepted count was drawn (settings.synthetic_rates)
    plan_hits: int = 0
    plan_misses: int = 0
    plan_capture_s: float = 0.0
    # Host-side split of the round (wall clock): until the verify plan was launched, waiting in the
    # one synchronisation, and after it. For profiling where a round's time goes.
    host_launch_s: float = 0.0
    host_wait_s: float = 0.0
    host_after_s: float = 0.0
    # The draft scored its sub-vocabulary through the model's sub-vocab order (engine/subvocab.py).
    remapped: bool = False
    pipelined: bool = False  # queued behind the round before it, its inputs taken on the device (launch_round)


PREFILL_CHUNK = 2048  # prompt tokens per forward pass: peak memory of a prefill stays that of one chunk


def prefill(model: DecodeModel, state: SessionState, chunk: int | None = None) -> int:
    """Bring the target up to N-1 consumed tokens (the prompt minus its last token), `chunk` tokens per pass:
    each pass carries the KV cache and the recurrent state on, so the memory a prefill needs beyond the
    session's own buffers does not grow with the prompt. Returns tokens fed."""
    chunk = chunk or PREFILL_CHUNK
    n = len(state.tokens)
    todo = state.tokens[state.target_len : n - 1]
    if not todo:
        return 0
    for lo in range(0, len(todo), chunk):
        start = state.target_len
        ids = torch.tensor(todo[lo : lo + chunk], dtype=torch.long, device=model.device)
        hidden = model.forward(ids, state)
        state.hidden[start : start + ids.shape[0]] = hidden
    # The MTP head catches up over the prompt here too (all pending rows but the last, which the first
    # draft step takes), so the first decode round has the same small shape as every other round.
    first, last = state.mtp_len, n - 2
    if model.has_mtp and last > first:
        for a in range(first, last, chunk):
            b = min(a + chunk, last)
            toks = torch.tensor(state.tokens[a + 1 : b + 1], dtype=torch.long, device=model.device)
            model.mtp_forward(toks, state.hidden[a:b], a, state)
        state.mtp_len = last
    return len(todo)


def refill(model: DecodeModel, state: SessionState) -> None:
    """Fallback when a rollback cannot be served: reset the recurrent state and re-prefill the committed
    prefix (tokens are kept; the MTP head catches up from row 0)."""
    state.forget_computed()
    prefill(model, state)


def check_fits(model: DecodeModel, settings: EngineSettings) -> None:
    """Raise EngineError when valid settings still do not fit this model (checked at every round, since a
    session's settings may change between rounds from another thread)."""
    if settings.sub_vocab > model.cfg.vocab_size:
        raise EngineError(
            f"sub_vocab {settings.sub_vocab} is larger than the model's vocabulary ({model.cfg.vocab_size}); "
            "use 0 (full) or a smaller value"
        )


def check_synthetic(settings: EngineSettings, sampling: SamplingParams | None) -> None:
    """Synthetic acceptance is a greedy measurement: with sampling (temperature > 0) it is refused."""
    if settings.synthetic and active(sampling) is not None:
        raise EngineError(
            "synthetic acceptance (synthetic_rates) measures greedy rounds only; set the temperature to 0, "
            "or clear synthetic_rates to sample"
        )


class _Clock:
    """Phase timing: CUDA events on the GPU (read after the round's one sync), wall time on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []
        # the stream the round is queued on, looked up once (torch.cuda.current_stream is microseconds of Python a
        # call, and a round marks up to four times)
        self.stream = torch.cuda.current_stream(device) if self.cuda else None

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(self.stream)
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        if self.cuda:
            return [a.elapsed_time(b) / 1000.0 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


@contextlib.contextmanager
def allowed_sync(device: torch.device):
    """Marks the one synchronisation a round is allowed: under torch.cuda.set_sync_debug_mode("error")
    (the GPU test's guard against hidden host round trips), this read alone is let through."""
    if device.type != "cuda":
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    if mode == 0:
        yield
        return
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def _stage(state: SessionState, values: list[int]) -> None:
    """[target_len, mtp_first, last_token, catch-up tokens...] -> the static device buffers, which are views
    of one packed buffer laid out the same way: one host-to-device copy (async from pinned memory)."""
    k = len(values)
    host = state.stage_host
    host[:k] = torch.tensor(values, dtype=torch.long)
    state.stage_dev[:k].copy_(host[:k], non_blocking=True)


def _catch_up(model: DecodeModel, state: SessionState, rows: int) -> torch.Tensor:
    """The MTP head over its pending rows (mtp_start_buf ..), the last being draft step 1: returns that
    row's output y [1, H], the input of the next step and of the pick.

    `rows` may exceed the pending rows (see `_catch_up_rows`): the extra rows sit after the real ones, so
    causal attention keeps them out of every real row; they write MTP cache entries past the pending
    rows, which the draft steps (positions start_buf + s) overwrite in order before anything reads them,
    and which the next round's catch-up rewrites. Their inputs are stale buffer contents, all finite."""
    offsets = state.mtp_start_buf + state.row_offsets(rows)
    y = model.mtp_forward(state.mtp_tok_buf[:rows], state.hidden.index_select(0, offsets), state.mtp_start_buf, state)
    return y.index_select(0, state.mtp_last_buf)


def _catch_up_rows(state: SessionState, first: int, pending: int, depth: int) -> tuple[int, int]:
    """(catch-up rows, draft steps) of a chained draft: depth + 1 rows and depth steps, the shape a static run of
    that depth has. A round after a deeper one can have more pending rows (up to the previous depth + 1): it runs
    the plan of the depth those rows belong to (pending - 1 steps; the verify reads only `depth` drafts), so every
    depth keeps one draft shape and costs what it costs in a static run. (Padding every depth's catch-up to the
    most rows the session had computed kept one shape too, but made every depth below the deepest one visited
    pay the deepest one's catch-up.) Exact where the rows or steps would pass the end of the caches."""
    rows = max(pending, depth + 1)
    steps = max(depth, rows - 1)
    if first + rows > state.max_context or first + rows + steps > state.max_context:
        return pending, depth
    return rows, steps


def _pipelinable_shape(rows: int, steps: int, pending: int, depth: int) -> bool:
    """Whether a chained draft of this shape leaves a round another can be pipelined behind: a captured plan of a
    depth's shape (rows the most of its pending rows and depth + 1, a step a row after the first), not the exact
    shape near the context's end."""
    return rows == max(pending, depth + 1) and steps == rows - 1 and rows <= MAX_CAPTURED_CATCHUP


def _draft_chain(model: DecodeModel, state: SessionState, width: int, depth: int, sub: int) -> None:
    """Catch-up rows + `depth` draft steps, argmax on the device; results in ids_buf[1:] / probs_buf."""
    y = _catch_up(model, state, width)
    # every step's position (start + s) in one launch, the steps reading their element (a launch a step before)
    starts = state.start_buf + state.row_offsets(depth) if depth > 1 else None
    for s in range(depth):
        model.draft_pick(y, sub, (state.ids_buf[1 + s : 2 + s], state.probs_buf[s : s + 1]))
        if s + 1 < depth:
            y = model.mtp_forward(state.ids_buf[1 + s : 2 + s], y, starts[s : s + 1], state)


def _draft_host(model: DecodeModel, state: SessionState, width: int, depth: int, p_min: float) -> int:
    """The "before": one submission per step, the full vocabulary row copied to the host, picked there."""
    y = _catch_up(model, state, width)
    n = 0
    for s in range(depth):
        row = model.lm_head(y).float().cpu()[0]
        tok = int(row.argmax())
        prob = float(torch.softmax(row, dim=-1)[tok])
        if prob < p_min:
            break
        state.ids_buf[1 + s] = tok
        n += 1
        if s + 1 < depth:
            y = model.mtp_forward(state.ids_buf[1 + s : 2 + s], y, state.start_buf + s, state)
    state.probs_buf[:n].fill_(1.0)  # already filtered by p_min on the host
    return n


def _verify(model: DecodeModel, state: SessionState, width: int, p_min: float, synthetic: bool = False) -> None:
    """Target over ids_buf[:width]; hidden rows saved; greedy acceptance (or, `synthetic`, the drawn one) into
    out_buf / cache_len_buf."""
    hidden = model.forward_layers(state.ids_buf[:width], state, state.start_buf, recurrent=True)
    ops.store_rows(state.hidden, hidden, state.start_buf)
    if synthetic:
        target_tokens, _ = model.pick(hidden, 0)
        state.cache_len_buf.copy_(state.start_buf)
        ops.synthetic_accept(
            state.ids_buf[1:width],
            state.probs_buf[: width - 1],
            target_tokens,
            p_min,
            state.synth_rates_buf,
            state.synth_seed_buf,
            state.start_buf,
            state.cache_len_buf,
            state.out_buf[: width + 2],
        )
        return
    model.pick_accept(  # the pick and the acceptance in one launch where the model can
        hidden,
        state.ids_buf[1:width],
        state.probs_buf[: width - 1],
        p_min,
        state.cache_len_buf,
        state.out_buf[: width + 2],
        state.start_buf,  # cache_len = start + accepted: no copy of start before it
    )


def _stage_synthetic(state: SessionState, settings: EngineSettings) -> None:
    """The rate of every draft position (the last given rate continuing) and the seed into the session's
    synthetic buffers, only when they change: one scalar fill per value (launches, no host synchronisation)."""
    rates = tuple(settings.synthetic_rate(i) for i in range(state.synth_rates_buf.shape[0]))
    if state.synth_staged == (rates, SYNTHETIC_SEED):
        return
    for i, rate in enumerate(rates):
        state.synth_rates_buf[i : i + 1].fill_(rate)
    state.synth_seed_buf.fill_(SYNTHETIC_SEED)
    state.synth_staged = (rates, SYNTHETIC_SEED)


# ---- sampled rounds (SamplingParams with temperature > 0; engine/sampling.py) ---------------------------------
# The same round with draws instead of argmaxes: every draw is keyed by (seed, start_buf = the round's start
# position, slot, purpose), so the device draws without the host and a rerun draws the same numbers.
# Several devices: every rank runs this same round; model.lm_head gives every rank the full logits (mirror_output
# off all-gathers the vocabulary slices: sampling needs whole rows, the distributed argmax is not enough), and
# every draw depends only on logits, seed and position, so all ranks draw the same tokens (no host RNG, no
# rank-dependent state; Engine._run sends `sampling` to the workers with the run).


def _process(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    return ops.sample_probs(logits, 0, sp.temperature, sp.top_k, sp.top_p, sp.min_p)


def _draft_chain_sampled(
    model: DecodeModel, state: SessionState, bufs: SamplingBuffers, width: int, depth: int, sub: int, sp: SamplingParams
) -> None:
    """Catch-up rows + `depth` draft steps, each drawn from q on the device; q rows into bufs.q_buf, (token,
    q(token)) into ids_buf[1:] / probs_buf (p_min applies to q(token)). With a sub-vocab order, q's columns are
    the order's ids: the drawn column is mapped to its token id and q is scattered into token-id columns of a
    zeroed row, so the verify reads q(x) of every token x (zero outside the sub-vocabulary), as it needs."""
    y = _catch_up(model, state, width)
    ids = model.draft_ids(sub)
    starts = state.start_buf + state.row_offsets(depth) if depth > 1 else None  # as in _draft_chain
    for s in range(depth):
        q = _process(model.draft_logits(y, sub), sp)  # [1, Vq]
        tok, prob = ops.sample_token(q, bufs.seed_buf, state.start_buf, s, ref_ops.RNG_DRAFT)
        if ids is None:
            bufs.q_buf[s : s + 1, : q.shape[1]].copy_(q)
        else:
            tok = ids.index_select(0, tok)
            row = bufs.q_buf[s]
            row.zero_()
            row.index_copy_(0, ids, q[0])
        state.ids_buf[1 + s : 2 + s].copy_(tok)
        state.probs_buf[s : s + 1].copy_(prob)
        if s + 1 < depth:
            y = model.mtp_forward(state.ids_buf[1 + s : 2 + s], y, starts[s : s + 1], state)


def _draft_host_sampled(
    model: DecodeModel,
    state: SessionState,
    bufs: SamplingBuffers,
    width: int,
    depth: int,
    p_min: float,
    sp: SamplingParams,
) -> int:
    """Chain off: each step's row comes to the host, which processes it and draws (the same numbers the device
    would draw: the round's start position is n - 1); the q row goes back to bufs.q_buf for the verify."""
    y = _catch_up(model, state, width)
    pos = len(state.tokens) - 1
    n = 0
    for s in range(depth):
        q = ref_ops.sample_probs(model.lm_head(y).float().cpu(), 0, sp.temperature, sp.top_k, sp.top_p, sp.min_p)
        tok, prob = ref_ops.sample_token(q, bufs.seed_host, pos, s, ref_ops.RNG_DRAFT)
        if float(prob[0]) < p_min:
            break
        bufs.q_buf[s].copy_(q[0])
        state.ids_buf[1 + s] = int(tok[0])
        n += 1
        if s + 1 < depth:
            y = model.mtp_forward(state.ids_buf[1 + s : 2 + s], y, state.start_buf + s, state)
    state.probs_buf[:n].fill_(1.0)  # already filtered by p_min on the host
    return n


def _verify_sampled(
    model: DecodeModel,
    state: SessionState,
    bufs: SamplingBuffers,
    width: int,
    vq: int,
    p_min: float,
    sp: SamplingParams,
) -> None:
    """Target over ids_buf[:width]; hidden rows saved; speculative-sampling acceptance into out_buf /
    cache_len_buf (the layout greedy_accept writes)."""
    hidden = model.forward_layers(state.ids_buf[:width], state, state.start_buf, recurrent=True)
    ops.store_rows(state.hidden, hidden, state.start_buf)
    p = _process(model.lm_head(hidden), sp)  # [width, V]
    state.cache_len_buf.copy_(state.start_buf)
    ops.spec_accept(
        state.ids_buf[1:width],
        state.probs_buf[: width - 1],
        bufs.q_buf[: width - 1, :vq],
        p,
        p_min,
        bufs.seed_buf,
        state.start_buf,
        state.cache_len_buf,
        state.out_buf[: width + 2],
    )


@dataclass(kw_only=True)
class LaunchedRound:
    """A round whose work is queued on the device and whose results are not read yet (launch_round)."""

    settings: EngineSettings
    budget: int | None  # tokens it may emit; None until the round it was pipelined behind is read (resolve)
    eos_ids: frozenset[int]
    n: int | None  # tokens before the round; None as budget
    width: int  # verify rows: drafts + 1
    clock: _Clock
    counters: tuple[int, int, float]  # the plan pool's (hits, misses, capture s) before the round
    counted: tuple[int, int, float]  # the same once the round's plans were launched
    t0: float
    t_launched: float
    remapped: bool
    out_host: torch.Tensor  # where its results are copied: state.out_hosts[out_slot] (two rounds queued: two)
    out_slot: int
    pipelined: bool = False  # its inputs were taken on the device from the round queued before it (behind)
    # "target": a target-only round; "chain": a round whose MTP head drafted on the device in a captured depth
    # shape (chain on, no drafter; greedy or sampled); "": neither. What can_pipeline lets a round be queued behind.
    kind: str = ""
    behind: LaunchedRound | None = None  # pipelined speculative: the round before it, until resolve
    emitted_on_device: int = 0  # tokens the device accepted (before the host cut at an end of text or the budget)
    read: bool = False  # finish_round has read it


def resolve(state: SessionState, r: LaunchedRound) -> None:
    """Fill in a speculative round's n and budget, queued behind a round whose accepted count the device alone
    knew at the time: valid once that round is read (the host then holds its tokens)."""
    if r.n is not None:
        return
    b = r.behind
    if b is None or not b.read:
        raise RuntimeError("resolve: the round this one was queued behind is not read yet")
    r.n = len(state.tokens)
    r.budget = b.budget - (r.n - b.n)
    r.behind = None  # no chain of references from round to round
    state.mtp_len = r.n - 1  # its catch-up rows end there, as launch_round records for a round staged from the host


def can_pipeline(
    state: SessionState,
    settings: EngineSettings,
    after: LaunchedRound | RoundOutcome | None,
    speculative: bool = False,
) -> bool:
    """Whether the round after `after` (queued, not read yet) can be queued before `after` is read, its inputs
    taken from `after`'s results on the device (launch_round's `behind`): a target-only round after a target-only
    round (its one input token and position); with `speculative`, also a chained-draft round after one of
    the same settings but perhaps another depth (an adaptive depth's choice, a change made between rounds): its
    position, the MTP head's pending rows and their tokens (the accepted ones), where `after` cannot be cut by the
    budget; greedy or sampled alike (a sampled round's draws are keyed by the seed and the start position, both
    on the device). Either way with room for it in the budget and the context. Host drafts and drafters cannot:
    they decide on the host."""
    if not isinstance(after, LaunchedRound):
        return False
    resolve(state, after)
    if after.kind == "target" and not settings.speculative:
        return after.budget > 1 and after.n + 1 < state.max_context
    if not (speculative and after.kind == "chain" and settings.speculative and after.budget > after.width):
        return False
    if not _same_but_depth(settings, after.settings):
        return False
    # the catch-up covers after's verify rows, or the new depth's plan rows where it is deeper (_catch_up_rows);
    # with its steps and the verify from the furthest start after can accept, inside the context
    rows = max(after.width, settings.draft_depth + 1)
    return after.n + 2 * rows + settings.draft_depth + 2 <= state.max_context


_BUT_DEPTH = tuple(f.name for f in dataclasses.fields(EngineSettings) if f.name != "draft_depth")


def _same_but_depth(a: EngineSettings, b: EngineSettings) -> bool:
    return a is b or all(getattr(a, f) == getattr(b, f) for f in _BUT_DEPTH)


# A target-only round queued behind another runs its _advance and its copy to the host inside its verify plan
# (launch_round); False: as separate launches between the plans (bench/decode_ab.py --boundary-ab).
ADVANCE_IN_PLAN = True
BEHIND_MIN_POOL = 3  # the plans a pipelined target-only run keeps: the first round's and one behind per host buffer


def _advance(state: SessionState) -> None:
    """The staged inputs of a target-only round from the one queued before it, on the device: what _stage would
    write once that round is read (target length + 1, the pending MTP row index + 1, its emitted token as the
    verify's input), so nothing waits for the host between the two."""
    state.stage_dev[0:3:2].add_(1)
    state.ids_buf[:1].copy_(state.out_buf[2:3])


def _advance_chain(state: SessionState, width: int) -> None:
    """The same for a chained-draft round after one of `width` verify rows, from its acceptance (out_buf: e
    tokens, then the tokens) and cache_len_buf: what _stage writes once it is read. The target length is the
    cache length; the MTP head's first pending row is the round's start (it caught up to there); its pending rows
    are the e accepted tokens, the last of them the verify's input. The catch-up reads `width` token slots; past
    the e real ones they hold earlier rounds' tokens (valid ids, in rows the causal mask keeps out)."""
    st, out = state.stage_dev, state.out_buf
    st[1:2].copy_(st[0:1])
    st[0:1].copy_(state.cache_len_buf)
    torch.sub(out[0:1], 1, out=st[2:3])
    torch.gather(out, 0, out[0:1] + 1, out=state.ids_buf[:1])
    state.mtp_tok_buf[:width].copy_(out[2 : 2 + width])


def launch_round(
    model: DecodeModel,
    state: SessionState,
    plans: PlanPool,
    settings: EngineSettings,
    budget: int,
    eos_ids: frozenset[int],
    is_cancelled: Callable[[], bool] = lambda: False,
    drafter: Drafter | None = None,
    sampling: SamplingParams | None = None,
    behind: LaunchedRound | None = None,
) -> LaunchedRound | RoundOutcome:
    """Queue a round's device work (draft, verify, the copy of its results to the host) without waiting for
    it; the host state is left as it was until finish_round, which emits between 1 and min(budget, depth+1)
    tokens. A RoundOutcome with no tokens instead when cancelled before the verify was queued. `sampling`
    None or temperature 0: greedy (argmax); otherwise speculative sampling (see engine/sampling.py).
    `settings.synthetic_rates` set: synthetic acceptance (greedy only; see the module's docstring).
    A round is launch_round then finish_round; between the two the caller may do host work of its own
    (the engine: the previous round's event), which then overlaps the device's work.
    `behind`: a round queued and not read yet (`can_pipeline` must hold): this round is queued behind it with
    its inputs taken from its results on the device, so the device goes from one to the other without waiting for
    the host. It is this round's caller's to finish `behind` first, then this one (or abandon_round it, if
    `behind` turned out to be the run's last: an end of text). `budget` is then unused: what `behind` leaves
    (after a speculative `behind`, known once it is read: resolve)."""
    if behind is not None and not can_pipeline(state, settings, behind, speculative=settings.speculative):
        raise ValueError("behind: a round can_pipeline does not allow behind this one")
    check_fits(model, settings)
    check_synthetic(settings, sampling)
    sp = active(sampling)
    vocab = model.cfg.vocab_size
    bufs = buffers_for(state, vocab) if sp is not None else None
    if bufs is not None:
        bufs.set_seed(sp.seed)
    vq = vocab  # the width of the draft's q rows the verify reads (sampling)
    chain_behind = behind is not None and settings.speculative
    if behind is None:
        n = len(state.tokens)
        if state.target_len != n - 1:
            refill(model, state)
    elif chain_behind:
        # n is behind's tokens plus what it accepts: the device's to know until behind is read. Every use of n
        # below is for the depth's room (can_pipeline checked it for the most behind can accept) and for host
        # staging, which _advance_chain replaces.
        n, budget = behind.n + behind.width, None
    else:
        n, budget = behind.n + 1, behind.budget - 1
    model.configure(settings)
    hits0, misses0, cap0 = plans.counters()
    pool = settings.plan_pool
    clock = _Clock(model.device)
    t0 = time.perf_counter()
    clock.mark()
    # The depth is capped only by what fits the context, not by the token budget: near the end of a run
    # a shallower round would be a new plan shape (a capture, milliseconds) to save a few draft steps;
    # tokens past the budget are simply not emitted.
    depth = max(0, min(settings.draft_depth, state.max_context - n)) if settings.speculative else 0
    first = state.mtp_len
    width_mtp = n - 1 - first  # pending MTP rows, the last of which is draft step 1 (behind a round: the most)
    use_mtp = drafter is None and model.has_mtp and depth > 0 and width_mtp > 0
    if behind is None:
        staged = [n - 1, first, width_mtp - 1, state.tokens[-1]]
        if use_mtp:  # catch-up tokens go after the verify-id slots (drafts are written there on the device)
            staged += [0] * (state.ids_buf.shape[0] - 1) + state.tokens[first + 1 : n]
        _stage(state, staged)
    elif chain_behind and first != behind.n - 1:
        raise RuntimeError(f"launch_round: the MTP head is at row {first}, not where behind starts ({behind.n - 1})")
    # A target-only round queued behind another: its advance and its copy to the host go inside its verify plan (one
    # plan per host buffer), so the device goes from one plan to the next without small launches between them (the
    # bundled model's target-only decode on the H200: 2.9-3.9k -> 4.3-4.8k t/s; bench/results/h200-boundary-2026-12-04
    # .txt); with a pool smaller than those three plans they would be captured again every round, so the advance is
    # launched here, as a chained-draft round's is before its draft plan.
    in_plan = ADVANCE_IN_PLAN and behind is not None and not chain_behind and pool >= BEHIND_MIN_POOL
    if chain_behind:
        _advance_chain(state, behind.width)
    elif behind is not None and not in_plan:
        _advance(state)

    n_drafts = depth
    p_min = settings.p_min
    remapped = False
    chain_kind = False
    if drafter is not None:
        proposal = list(drafter(list(state.tokens), depth))[:depth]
        n_drafts = len(proposal)
        if proposal:
            state.ids_buf[1 : 1 + n_drafts] = torch.tensor(proposal, dtype=torch.long)
            state.probs_buf[:n_drafts].fill_(1.0)
            if bufs is not None:  # a deterministic proposal is a draft distribution with all mass on it
                bufs.q_buf[:n_drafts].zero_()
                bufs.q_buf[torch.arange(n_drafts), torch.tensor(proposal, dtype=torch.long)] = 1.0
        p_min = 0.0
    elif not use_mtp:
        n_drafts = 0
    elif settings.chain and sp is not None:
        sub = settings.sub_vocab
        remapped = model.draft_ids(sub) is not None
        vq = vocab if remapped else sub or vocab  # with an order, q rows are scattered over the token ids
        rows, steps = _catch_up_rows(state, first, width_mtp, depth)
        chain_kind = _pipelinable_shape(rows, steps, width_mtp, depth)
        if rows <= MAX_CAPTURED_CATCHUP:
            plans.run(
                ("draft", rows, steps, sub, *model.plan_tag, sp.plan_key),
                pool,
                lambda: _draft_chain_sampled(model, state, bufs, rows, steps, sub, sp),
            )
        else:
            _draft_chain_sampled(model, state, bufs, width_mtp, depth, sub, sp)
    elif settings.chain:
        sub = settings.sub_vocab
        remapped = model.draft_ids(sub) is not None
        rows, steps = _catch_up_rows(state, first, width_mtp, depth)
        chain_kind = _pipelinable_shape(rows, steps, width_mtp, depth)
        if rows <= MAX_CAPTURED_CATCHUP:
            plans.run(
                ("draft", rows, steps, sub, *model.plan_tag),
                pool,
                lambda: _draft_chain(model, state, rows, steps, sub),
            )
        else:
            _draft_chain(model, state, width_mtp, depth, sub)
    elif sp is not None:
        n_drafts = _draft_host_sampled(model, state, bufs, width_mtp, depth, p_min, sp)
        p_min = 0.0
    else:
        n_drafts = _draft_host(model, state, width_mtp, depth, p_min)
        p_min = 0.0
    if use_mtp and not chain_behind:  # behind a round: once n is known (finish_round)
        state.mtp_len = n - 1
    clock.mark()
    if is_cancelled():
        return RoundOutcome(
            tokens=[],
            from_draft=[],
            drafted=0,
            accepted=0,
            time_draft_s=time.perf_counter() - t0,
            time_verify_s=0.0,
            time_accept_s=0.0,
            hit_eos=False,
            cancelled=True,
        )

    width = n_drafts + 1
    # Synthetic acceptance only where there are drafts to accept: a round without any is the plain target
    # step of a real run (the same plan), which emits the model's own token either way.
    synthetic = settings.synthetic and n_drafts > 0
    # the results go to pinned memory by an asynchronous copy (as the staging copies): queued, not waited for; a
    # round queued behind one not read yet copies into the other buffer
    slot = 1 - behind.out_slot if behind is not None else 0
    out_host = state.out_hosts[slot][: width + 2]

    def copy_out() -> None:
        out_host.copy_(state.out_buf[: width + 2], non_blocking=model.device.type == "cuda")

    if synthetic:
        _stage_synthetic(state, settings)
        key = ("verify", width, p_min, *model.plan_tag, "synthetic")
        verify = lambda: _verify(model, state, width, p_min, synthetic=True)  # noqa: E731
    elif sp is not None:
        key = ("verify", width, p_min, *model.plan_tag, vq, sp.plan_key)
        verify = lambda: _verify_sampled(model, state, bufs, width, vq, p_min, sp)  # noqa: E731
    else:
        key = ("verify", width, p_min, *model.plan_tag)
        verify = lambda: _verify(model, state, width, p_min)  # noqa: E731
    if in_plan:
        plans.run((*key, "behind", slot), pool, lambda: (_advance(state), verify(), copy_out()))
    else:
        plans.run(key, pool, verify)
    t_launched = time.perf_counter()
    clock.mark()
    if not in_plan:
        copy_out()
    clock.mark()  # recorded after the copy: finish_round waits for this event, so every span is complete
    return LaunchedRound(
        settings=settings,
        budget=budget,
        eos_ids=eos_ids,
        n=None if chain_behind else n,
        width=width,
        clock=clock,
        counters=(hits0, misses0, cap0),
        counted=plans.counters(),
        t0=t0,
        t_launched=t_launched,
        remapped=remapped,
        out_host=out_host,
        out_slot=slot,
        pipelined=behind is not None,
        kind="target" if width == 1 and not settings.speculative else "chain" if chain_kind else "",
        behind=behind if chain_behind else None,
    )


def _wait(model: DecodeModel, launched: LaunchedRound) -> None:
    """Wait for a launched round's results on the host: its last clock event, recorded after their copy (a round
    queued behind it keeps running). Nothing on the CPU, where the work is done when it is queued."""
    if model.device.type == "cuda":
        model.sync(launched.clock.marks[-1])


def finish_round(
    model: DecodeModel,
    state: SessionState,
    plans: PlanPool,
    launched: LaunchedRound,
    while_waiting: Callable[[], None] | None = None,
) -> RoundOutcome:
    """Wait for a launched round (the round's one device-to-host synchronisation), read what it emitted and
    bring the host state up to it. `while_waiting()`: host work for later (no device work), run just before
    the host waits, so that it overlaps the device's work instead of following it."""
    resolve(state, launched)  # queued behind a speculative round, now read: its tokens are the host's
    n, width, clock = launched.n, launched.width, launched.clock
    hits0, misses0, cap0 = launched.counters
    out_host = launched.out_host
    if state.target_len != n - 1 or len(state.tokens) != n:
        raise RuntimeError(f"finish_round: the host state is not the round's ({state.target_len=}, {n=})")
    if while_waiting is not None:
        while_waiting()
    with allowed_sync(model.device):  # the round's one device-to-host synchronisation
        _wait(model, launched)
    t_synced = time.perf_counter()
    got = out_host.tolist()
    t_read = time.perf_counter()

    e, n_valid = got[0], got[1]
    launched.emitted_on_device, launched.read = e, True
    emitted = got[2 : 2 + e]
    from_draft = [True] * (e - 1) + [False]
    hit_eos = False
    for i, tok in enumerate(emitted):
        if tok in launched.eos_ids:
            emitted, from_draft, hit_eos = emitted[: i + 1], from_draft[: i + 1], True
            break
    emitted, from_draft = emitted[: launched.budget], from_draft[: launched.budget]
    e = len(emitted)
    state.tokens.extend(emitted)
    state.record_batch(n - 1, width, every_plane=True)
    if not state.rollback(n - 1 + e):
        refill(model, state)
    t_end = time.perf_counter()
    draft_s, verify_s, read_s = clock.spans()
    hits1, misses1, cap1 = launched.counted
    return RoundOutcome(
        tokens=emitted,
        from_draft=from_draft,
        drafted=n_valid,
        accepted=sum(from_draft),
        time_draft_s=draft_s,
        time_verify_s=verify_s,
        time_accept_s=read_s + (t_end - t_read),
        hit_eos=hit_eos,
        synthetic=launched.settings.synthetic,
        plan_hits=hits1 - hits0,
        plan_misses=misses1 - misses0,
        plan_capture_s=cap1 - cap0,
        host_launch_s=launched.t_launched - launched.t0,
        host_wait_s=t_synced - launched.t_launched,
        host_after_s=t_end - t_synced,
        remapped=launched.remapped,
        pipelined=launched.pipelined,
    )


def abandon_round(model: DecodeModel, state: SessionState, plans: PlanPool, launched: LaunchedRound) -> None:
    """A launched round nobody will read (its run was dropped while it was queued ahead): wait for it, then
    take the host state back to before it. Its tokens are not committed; the planes it wrote are marked
    unused, so a later rollback never takes one of them for a position it no longer holds. Where the host state
    is no longer the one it was queued on (a round queued behind one whose read failed, and the session's
    computed state forgotten since), it is only waited for. A speculative round queued behind one that the host
    then cut (an end of text, the budget) started where the device put it, past the host's tokens: see
    _abandon_behind."""
    if launched.n is None:
        _abandon_behind(model, state, launched)
        return
    if state.target_len != launched.n - 1 or len(state.tokens) != launched.n:
        _wait(model, launched)
        return
    finish_round(model, state, plans, launched)
    n = launched.n
    del state.tokens[n:]
    if not state.rollback(n - 1):
        refill(model, state)


def _abandon_behind(model: DecodeModel, state: SessionState, launched: LaunchedRound) -> None:
    """Drop a speculative round queued behind another (launch_round's `behind`), that one read: wait for it, then
    undo its marks on the host. It ran from the position the device's acceptance gave (behind's start plus every
    token the device accepted, which may pass where the host cut the run) and wrote the recurrent planes of the
    positions after it: those slots are marked unused. Its KV entries, MTP rows and hidden rows all lie at or past
    the host's target length, rewritten before anything reads them. If the plane of the host's target length was
    one of those slots, the target goes back to the latest position whose plane is intact and the tokens from there
    are fed again (a full refill only where none is)."""
    b = launched.behind
    _wait(model, launched)
    if b is None or not b.read:
        return  # behind's read failed and the session's computed state was forgotten: nothing to undo
    launched.behind = None
    start = b.n - 1 + b.emitted_on_device
    for p in range(start + 1, start + launched.width + 1):
        state.plane_pos[p % state.n_planes] = -1
    target = state.target_len
    if state.can_rollback(target):
        return
    q = next((q for q in range(target - 1, max(-1, target - state.n_planes), -1) if state.can_rollback(q)), None)
    if q is None:
        refill(model, state)
        return
    state.rollback(q)
    prefill(model, state)
