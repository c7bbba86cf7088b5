"""What the application plugs into the engine's loop, all optional, given at construction."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from triforce.decoding.sync_count import SyncCounter


@dataclass(frozen=True)
class EngineHooks:
    """What the application plugs into the loop, all optional."""
    replay: object = None  # a ReplayVerifier decides checks instead of the models (benchmarks)
    agree: Callable[[list[int]], list[int]] | None = None  # tensor parallelism: rank 0's decisions win
    agree_ok: Callable[[bool], bool] | None = None         # ... and graph capture succeeds everywhere or nowhere
    gamma2_controller: object = None                       # picks gamma2 from the observed acceptance
    gamma1_controller: object = None                       # picks gamma1 from the observed rate of tier 0's drafts
    speculation_gate: object = None                        # --method auto: ar while speculation is slower
    sync_counter: SyncCounter | None = None                # host synchronisations per phase (CUDA)
