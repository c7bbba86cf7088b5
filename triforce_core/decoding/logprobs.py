"""The emitted tokens' log-probabilities under the target model and its most likely alternatives
(an API's `logprobs` / `top_logprobs`): the full tier's own logits at each emitted token's
position, before penalties, temperature and the top-k/top-p filters, as OpenAI's and vLLM's
servers report them. Exact under speculation: every emitted token's position was scored by the
full model in the verify that emitted it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from triforce.decoding.observers import Observer, Round

MAX_TOP = 20  # alternatives per token, OpenAI's bound


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # (token, logprob), most likely first


@dataclass
class LogprobRecorder(Observer):
    """Handed to one Engine.generate: `entries` follows the emitted tokens."""
    top: int = 0
    entries: list[TokenLogprob] = field(default_factory=list)
    _pending: list[TokenLogprob] = field(default_factory=list)

    def full_logits(self, logits: torch.Tensor, tokens: list[int]) -> None:
        """logits [n, V]: the full model's rows for the n tokens a round emitted, in order (one
        host read for the round)."""
        logprobs = torch.log_softmax(logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32), -1)
        chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
        values, ids = logprobs.topk(self.top, dim=-1) if self.top else (logprobs[:, :0], logprobs[:, :0].long())
        self._pending = [TokenLogprob(t, c, list(zip(i, v))) for t, c, i, v in
                         zip(tokens, chosen, ids.tolist(), values.tolist())]

    def committed(self, plan: Round) -> None:
        """The round kept its first plan.emitted tokens (a stop token ends it early)."""
        self.entries += self._pending[:plan.emitted]
        self._pending = []
