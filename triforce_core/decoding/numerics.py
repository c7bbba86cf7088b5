"""Logits that are NaN or infinite stop the run with one line naming where they began.

The verifiers read a finiteness flag with the tokens they read anyway (no host sync of its own);
when it is raised, or a CPU kernel fails on non-finite activations first (numba's division by
zero), `located` runs one plain forward pass over the sequence so far and names the first module
whose output is not finite (weights are checked at load: this is an activation that overflowed,
typically in float16/bfloat16)."""
from __future__ import annotations

import torch

from triforce.errors import UserError

_DIAGNOSED_TOKENS = 8192  # a longer sequence is not re-run to name the layer (only the failure is said)


class NonFiniteLogits(UserError):
    def __init__(self, where: str = "the target's logits"):
        super().__init__(f"{where} became NaN or infinite")


SYMPTOMS = (NonFiniteLogits, ZeroDivisionError)  # what a decoding step raises on non-finite numbers


def located(error: Exception, lm, seq: list[int]) -> Exception:
    """A SYMPTOMS error as one line naming the token and the first non-finite module (from a
    re-run); a division by zero the re-run does not explain stays what it was."""
    first = _first_non_finite(lm, seq) if len(seq) <= _DIAGNOSED_TOKENS else None
    if not isinstance(error, NonFiniteLogits) and first is None:
        return error
    dtype = str(lm.dtype).removeprefix("torch.")
    where = f", first in {first}" if first else ""
    return UserError(f"the model's logits became NaN or infinite at token {len(seq)}{where} (an activation "
                     f"overflowed in {dtype}, or the model is broken): try --dtype float32")


def _first_non_finite(lm, seq: list[int]) -> str | None:
    from triforce.cache.resident import ResidentKVCache

    found: list[str] = []
    names = {module: name for name, module in lm.model.named_modules()
             if name == "model.embed_tokens" or name == "model.norm" or name.count(".") == 2 and ".layers." in name}

    def hook(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        if not found and torch.is_tensor(out) and not bool(torch.isfinite(out).all()):
            found.append(names[module])

    handles = [module.register_forward_hook(hook) for module in names]
    halves = [(layer, layer.cpu_layer) for layer in lm.model.model.layers]  # the numba halves fail on NaN: eager
    for layer, _ in halves:
        layer.cpu_layer = None
    try:
        cache = ResidentKVCache(lm.config, len(seq), dtype=lm.dtype, device=lm.device, attn=lm.attn)
        step = cache.step(len(seq))
        with torch.inference_mode():
            lm.model(torch.tensor([seq], device=lm.device), step.positions, step, num_logits=1)
    except Exception:  # the diagnosis is a courtesy: the failure itself is already known
        return None
    finally:
        for handle in handles:
            handle.remove()
        for layer, kernels in halves:
            layer.cpu_layer = kernels
    return found[0] if found else None
