"""Per-session decode state: KV caches, recurrent state in position-tagged snapshot planes, MTP carry-over.

Snapshot planes
---------------
The recurrent state (delta-net S and the conv window) cannot be un-applied, so it lives in a ring of
`n_planes` planes per layer: plane (p % n_planes) holds the state after the first p tokens, and
`plane_pos[i]` says which position plane i holds (-1 = nothing valid). A batch of T tokens starting at
position p reads plane p and writes planes p+1 .. p+T, and leaves every other plane as it was, with its
tag. Rolling back to position q is then just "move the length to q" — allowed only when plane q still
holds position q; otherwise the rollback is refused and the caller re-prefills the committed prefix.
Planes past the new length are untagged on rollback so a later rollback can never read a stale branch.

The KV cache of full-attention layers rolls back by moving the length alone.

MTP carry-over
--------------
`hidden[r]` keeps the target's post-norm hidden state of position r. The MTP head has consumed rows
0 .. mtp_len-1 (row r pairs hidden[r] with token r+1); rows mtp_len .. len(tokens)-2 are pending and
are fed to the head at the start of the next draft (catch-up), together with the first draft step.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from .config import ModelConfig
from .plans import PlanPool
from .settings import EngineSettings

if TYPE_CHECKING:
    from .sampling import SamplingBuffers


def session_bytes(
    cfg: ModelConfig, dtype: torch.dtype, max_context: int, n_planes: int, has_mtp: bool
) -> dict[str, int]:
    """What a session of `max_context` tokens allocates, by component, computed from the config alone
    (so that a context that cannot fit is refused before anything is allocated)."""
    size = torch.empty((), dtype=dtype).element_size()
    full = sum(1 for t in cfg.layer_types if t == "full_attention")
    linear = sum(1 for t in cfg.layer_types if t == "linear_attention")
    n_mtp = cfg.mtp_num_hidden_layers if has_mtp else 0
    kv = (full + n_mtp) * 2 * max_context * cfg.num_key_value_heads * cfg.head_dim * size
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    planes = linear * n_planes * (hv * dk * dv * 4 + cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * size)
    workspace = max_context * cfg.hidden_size * size + 3 * max_context * 8  # hidden rows, staging, offsets
    return {"kv_cache": kv, "snapshot_planes": planes, "workspace": workspace}


class SessionState:
    """All mutable state of one sequence. Buffers are allocated once, for `max_context` tokens."""

    def __init__(
        self,
        cfg: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_context: int,
        n_planes: int,
        has_mtp: bool,
        caches: bool = True,
    ) -> None:
        self.cfg = cfg
        self.shards: list[SessionState] = []  # tensor parallel: each shard's caches (this state keeps none)
        self.max_context = max_context
        self.n_planes = n_planes
        full = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] if caches else []
        linear = [i for i, t in enumerate(cfg.layer_types) if t == "linear_attention"] if caches else []
        kv_shape = (max_context, cfg.num_key_value_heads, cfg.head_dim)
        self.k_cache = {i: torch.zeros(kv_shape, device=device, dtype=dtype) for i in full}
        self.v_cache = {i: torch.zeros(kv_shape, device=device, dtype=dtype) for i in full}
        hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        k1 = cfg.linear_conv_kernel_dim - 1
        self.delta_planes = {i: torch.zeros((n_planes, hv, dk, dv), device=device, dtype=torch.float32) for i in linear}
        self.conv_planes = {i: torch.zeros((n_planes, cfg.conv_dim, k1), device=device, dtype=dtype) for i in linear}
        self.plane_pos = [-1] * n_planes
        self.has_mtp = has_mtp
        n_mtp = cfg.mtp_num_hidden_layers if has_mtp and caches else 0
        self.mtp_k_cache = [torch.zeros(kv_shape, device=device, dtype=dtype) for _ in range(n_mtp)]
        self.mtp_v_cache = [torch.zeros(kv_shape, device=device, dtype=dtype) for _ in range(n_mtp)]
        self.hidden = torch.zeros((max_context, cfg.hidden_size), device=device, dtype=dtype)
        # Static round buffers: captured plans read and write only these (their addresses never change).
        # The staged inputs are views of one packed buffer so the host fills them with a single copy:
        # [target length, first pending MTP row, index of the last pending row, verify ids (last token,
        # drafts...), catch-up tokens...]
        width = n_planes  # >= max verify width (depth + 1) + 1
        self.stage_dev = torch.zeros(3 + width + max_context, dtype=torch.long, device=device)
        self.start_buf = self.stage_dev[0:1]  # target length before the round
        self.mtp_start_buf = self.stage_dev[1:2]  # first pending MTP row
        self.mtp_last_buf = self.stage_dev[2:3]  # pending MTP rows - 1: the catch-up row that is draft step 1
        self.ids_buf = self.stage_dev[3 : 3 + width]  # verify input: last token, drafts
        self.mtp_tok_buf = self.stage_dev[3 + width :]  # catch-up tokens (host writes them after ids_buf)
        self.cache_len_buf = torch.zeros(1, dtype=torch.long, device=device)  # target length after acceptance
        self.probs_buf = torch.ones(width, dtype=torch.float32, device=device)  # the drafts' probabilities
        self.out_buf = torch.zeros(width + 2, dtype=torch.long, device=device)  # acceptance result
        # Synthetic acceptance (EngineSettings.synthetic_rates): the rate of each draft position and the seed the
        # verify's synthetic_accept reads in place; written by the host only when they change (engine/spec.py).
        self.synth_rates_buf = torch.ones(width - 1, dtype=torch.float32, device=device)
        self.synth_seed_buf = torch.zeros(1, dtype=torch.long, device=device)
        self.synth_staged: tuple | None = None  # the (rates, seed) those buffers hold
        pinned = device.type == "cuda"
        self.stage_host = torch.zeros(3 + width + max_context, dtype=torch.long, pin_memory=pinned)
        # the rounds' results on the host: two, so a round queued behind one not read yet has its own
        self.out_hosts = tuple(torch.zeros(width + 2, dtype=torch.long, pin_memory=pinned) for _ in range(2))
        self._offsets = torch.arange(max_context, dtype=torch.long, device=device)  # 0, 1, 2, ...
        self.sampling_buffers: SamplingBuffers | None = None  # made at the first sampled round (engine/sampling.py)
        self.reset()

    def row_offsets(self, n: int) -> torch.Tensor:
        """0 .. n-1 on the device: a view of one static buffer (no arange launched per round or plan)."""
        return self._offsets[:n]

    # ---- bookkeeping -------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget everything: the next prompt is prefilled from scratch (MTP carry-over included)."""
        self.tokens: list[int] = []
        self.target_len = 0  # tokens the target has consumed (KV length / recurrent position)
        self.mtp_len = 0  # MTP rows consumed
        for planes in self.delta_planes.values():
            planes[0].zero_()
        for planes in self.conv_planes.values():
            planes[0].zero_()
        for shard in self.shards:
            shard.reset()
        self.plane_pos = [-1] * self.n_planes
        self.plane_pos[0] = 0

    def forget_computed(self) -> None:
        """Keep the committed tokens, drop everything computed from them (KV, planes, MTP rows): the next
        round re-prefills. Used after a failure mid-run, so the conversation itself is never lost."""
        tokens = list(self.tokens)
        self.reset()
        self.tokens = tokens

    def buffers(self) -> dict[str, list[torch.Tensor]]:
        """State tensors by component (for the memory breakdown), this state's and its shards'."""
        out = {
            "kv_cache": [*self.k_cache.values(), *self.v_cache.values(), *self.mtp_k_cache, *self.mtp_v_cache],
            "snapshot_planes": [*self.delta_planes.values(), *self.conv_planes.values()],
            "workspace": [
                self.hidden,
                self.stage_dev,
                self.out_buf,
                self._offsets,
                self.synth_rates_buf,
                self.synth_seed_buf,
            ],
        }
        for shard in self.shards:
            for key, tensors in shard.buffers().items():
                if key != "workspace":
                    out[key] += tensors
        return out

    def can_rollback(self, pos: int) -> bool:
        return 0 <= pos <= self.target_len and self.plane_pos[pos % self.n_planes] == pos

    def rollback(self, pos: int) -> bool:
        """Move the target back to `pos` consumed tokens. Returns False (and changes nothing) when no plane
        holds that position: the caller must then re-prefill."""
        if not self.can_rollback(pos):
            return False
        self.target_len = pos
        self.plane_pos = [p if p <= pos else -1 for p in self.plane_pos]
        self.mtp_len = min(self.mtp_len, pos)
        return True

    def record_batch(self, start: int, count: int, every_plane: bool) -> None:
        """Tag the planes a batch wrote: every position start+1..start+count (recurrent form) or only the
        last one (chunked prefill form)."""
        n = self.n_planes
        first = start + 1 if every_plane else start + count
        for p in range(max(first, start + count - n + 1), start + count + 1):
            self.plane_pos[p % n] = p
        self.target_len = start + count


class Session:
    """A handle on one independent conversation. `settings` and `cancel()` are safe from any thread."""

    def __init__(self, state: SessionState, plans: PlanPool, settings: EngineSettings | None = None) -> None:
        self.state = state
        self.plans = plans
        self.sid = 0  # the engine's id for it (the same on every rank); set by Engine.new_session
        self._settings = settings or EngineSettings()
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self.busy = threading.Lock()  # held while a generation runs on this session
        self.depth_controller = None  # draft_depth="auto": what the session's rounds taught it (engine/adaptive.py)
        # Tests replace the MTP head with a drafter told where to be wrong: (tokens, depth) -> drafts.
        self.test_drafter = None

    @property
    def settings(self) -> EngineSettings:
        with self._lock:
            return self._settings

    @settings.setter
    def settings(self, value: EngineSettings) -> None:
        if not isinstance(value, EngineSettings):
            raise TypeError("settings must be an EngineSettings")
        with self._lock:
            self._settings = value

    def cancel(self) -> None:
        """Stop the running generation at the next round boundary (or within the current round)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def _clear_cancel(self) -> None:
        self._cancel.clear()

    @property
    def tokens(self) -> list[int]:
        return list(self.state.tokens)

    def reset(self) -> None:
        with self.busy:
            self.state.reset()
