"""StreamingLLM cache for a separate draft model: a few sink tokens plus a recent window of its
own KV. Positions are cache slots (as in StreamingLLM), so a small draft model never sees a
position beyond its own training length; when the window slides, the kept keys are rotated back
by the shift, which keeps every relative distance right."""
from __future__ import annotations

import torch

from triforce.cache_contract import BufferStep, buffer_decoder
from triforce.config.model import ModelConfig
from triforce.kernels import SDPA
from triforce.model.rope import RotaryEmbedding, apply_rope


class StreamingKVCache:
    """k_buf, v_buf: [num_layers, B, Hkv, sinks + window + slack, D].

    `length` counts the sequence tokens the cache stands for; `end` the physical entries held."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding | tuple[RotaryEmbedding, ...], sink_tokens: int,
                 window: int,
                 slack: int, *, batch: int = 1, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", attn=SDPA):
        self.attn = attn
        if window < slack:
            raise ValueError("the window must be at least as long as the longest rollback (slack)")
        self.sink_tokens, self.window, self.slack = sink_tokens, window, slack
        self.capacity = sink_tokens + window + slack
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, self.capacity, cfg.head_dim)
        self.k_buf = torch.zeros(shape, dtype=dtype, device=device)
        self.v_buf = torch.zeros(shape, dtype=dtype, device=device)
        self.scale = cfg.head_dim ** -0.5
        self.decoder = buffer_decoder(attn, self.k_buf, self.v_buf, self.scale)
        ropes = rope if isinstance(rope, tuple) else (rope,) * cfg.num_layers
        # the layers each RoPE turns (Gemma 3's local and global layers differ): slices where all share one
        groups: dict[int, list[int]] = {}
        for layer, r in enumerate(ropes):
            groups.setdefault(id(r), []).append(layer)
        # layer indices on the device, made once: a Python list would be copied over at every eviction
        self._rope_groups = [(ropes[layers[0]], slice(None) if len(groups) == 1
                              else torch.tensor(layers, device=self.k_buf.device)) for layers in groups.values()]
        self.sliding_windows = cfg.sliding_windows
        self.length = 0
        self.end = 0

    def reset(self) -> None:
        self.length = self.end = 0

    def skip_to(self, length: int) -> None:
        """Stand for `length` tokens without holding the ones in between (after the sinks)."""
        if length < self.length:
            raise ValueError("skip_to cannot go back")
        self.length = length

    def _evict(self, needed: int) -> None:
        keep = min(self.window, self.end - self.sink_tokens)
        source = self.end - keep
        shift = source - self.sink_tokens
        if shift <= 0 or self.sink_tokens + keep + needed > self.capacity:
            raise ValueError(f"cannot fit {needed} new tokens in the streaming cache")
        # torch.full fills on the device: no host-to-device copy (and no sync) in the draft phase
        shifted = torch.full((1, 1), -shift, dtype=torch.long, device=self.k_buf.device)
        dst = slice(self.sink_tokens, self.sink_tokens + keep)
        for rope, layers in self._rope_groups:
            cos, sin = rope.cos_sin(shifted, self.k_buf.dtype, unscaled=True)
            # indexing copies (and clone does where it slices): source and destination may overlap
            self.k_buf[layers, :, :, dst] = apply_rope(self.k_buf[layers, :, :, source:self.end].clone(), cos, sin)
        self.v_buf[:, :, :, dst] = self.v_buf[:, :, :, source:self.end].clone()
        self.end = self.sink_tokens + keep

    def step(self, num_new: int) -> BufferStep:
        if self.end + num_new > self.capacity:
            self._evict(num_new)
        start = self.end
        self.end += num_new
        self.length += num_new
        positions = torch.arange(start, self.end, device=self.k_buf.device)[None]
        return BufferStep(self, start, self.end, positions, sliding_windows=self.sliding_windows)

    def rollback(self, length: int) -> None:
        drop = self.length - length
        if drop < 0 or drop > self.end - self.sink_tokens:
            raise ValueError(f"cannot roll back {drop} tokens")
        self.length = length
        self.end -= drop

