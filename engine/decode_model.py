"""`DecodeModel`: what a round (engine/spec.py) and the engine's session and plan bookkeeping need from a model.

`engine.model.Model` (one device, or one rank's shard) is the implementation; anything else that provides
these members can be decoded by the same round loop (tests/test_floors.py checks that Model satisfies it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from .config import ModelConfig

if TYPE_CHECKING:
    from .settings import EngineSettings
    from .state import SessionState


@runtime_checkable
class DecodeModel(Protocol):
    cfg: ModelConfig  # the model's shape (a rank's shard's head counts on several ranks)
    device: torch.device
    dtype: torch.dtype
    has_mtp: bool  # False: the round decodes without drafts (plain greedy / sampling)

    @property
    def plan_tag(self) -> tuple:
        """Anything beyond the batch shape that a captured plan depends on (part of the plan key)."""
        ...

    @property
    def capturable(self) -> bool:
        """Whether its forward passes may be captured as CUDA graphs."""
        ...

    def new_state(self, max_context: int, n_planes: int) -> SessionState:
        """A session's state (caches, snapshot planes, round buffers) sized for this model."""
        ...

    def configure(self, settings: EngineSettings) -> None:
        """Apply the settings that change what the model holds, at a round boundary."""
        ...

    def forward(self, ids: torch.Tensor, state: SessionState) -> torch.Tensor:
        """The target over `ids` after the state's tokens, with host bookkeeping (prefill, refill)."""
        ...

    def forward_layers(
        self, ids: torch.Tensor, state: SessionState, start: int | torch.Tensor, recurrent: bool
    ) -> torch.Tensor:
        """The target's layers over T tokens at `start` (host int or device tensor): pure device work."""
        ...

    def mtp_forward(self, tokens: torch.Tensor, hiddens: torch.Tensor, start: int, state: SessionState) -> torch.Tensor:
        """The MTP head's rows start .. start+T-1 (token r+1 with the target's hidden of position r)."""
        ...

    def pick(
        self, hidden: torch.Tensor, n: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy (token, probability) per row over the first n vocabulary ids (0 = all), on the device;
        written into `out` (token, probability tensors) when given."""
        ...

    def pick_accept(
        self,
        hidden: torch.Tensor,
        drafts: torch.Tensor,
        draft_probs: torch.Tensor,
        p_min: float,
        cache_len: torch.Tensor,
        out: torch.Tensor,
        start: torch.Tensor,
    ) -> None:
        """The verify's greedy pick over all ids (pick(hidden, 0)'s tokens) and ops.greedy_accept of `drafts`
        against them, written into `out` and `cache_len` on the device."""
        ...

    def lm_head(self, hidden: torch.Tensor, rows: int = 0) -> torch.Tensor:
        """Logits over the first `rows` vocabulary ids (0 = all)."""
        ...

    def draft_ids(self, n: int) -> torch.Tensor | None:
        """The token ids (a device tensor) of the n columns a sub-vocab draft scores, when a sub-vocabulary
        order holds them; None when the draft scores ids 0..n-1 (or all, n = 0)."""
        ...

    def draft_pick(
        self, hidden: torch.Tensor, n: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy (token id, probability) per row over the draft's n-id sub-vocabulary (0 = all), on the device;
        written into `out` when given."""
        ...

    def draft_logits(self, hidden: torch.Tensor, n: int) -> torch.Tensor:
        """Logits [T, n] over the draft's n-id sub-vocabulary (0 = all), in `draft_ids(n)` order."""
        ...

    def sync(self, until=None) -> None:
        """Wait for the device's queued work, or its work up to the recorded CUDA event `until`: the round's one
        synchronisation."""
        ...
