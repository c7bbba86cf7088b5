"""A Llama-family decoder layer's work around attention, for a few rows on the CPU, in two numba
calls: `pre` (RMSNorm, the q/k/v projection, RoPE) and `post` (the output projection and
residual, RMSNorm, gate/up, SiLU, down and residual).

Why: decoding one token through eager PyTorch ran ~50 small operators per layer around the two
memory streams (weights, KV), each a few microseconds of dispatch, conversion and allocation:
on the default model ~6 ms of a 23 ms bfloat16 token on this project's 2-core box. Here each
half is one call that runs the projections through the small-rows linear kernel
(triforce.kernels.cpu.linear.dense) and the rest in place. Where the pass's cache offers its CPU
blocks (`decode`), pre writes the keys and values straight into them and the attention kernel runs
between the halves on numpy arrays: the torch views, slices and copies between three kernels cost
~2 ms of a 19 ms token (bench/RESULTS.md, "Straight into the cache").

Numerics follow the eager layer's (triforce.model.decoder): activations are rounded to the
model's dtype wherever the eager layer holds a tensor of that dtype, the norms and sums are
float32. A row's result does not depend on the other rows of the call (every loop is per row or
the linear kernel's per-row dot), so a verify pass computes each token as decoding it alone
would, as the linear and attention kernels do. Not bit-identical to the eager layer (summation
order, exp): the reference path (`use_kernels("reference")`) stays the eager one."""
from __future__ import annotations

import numba
import numpy as np
import torch

from triforce.kernels.cpu.simd.bf16_bits import bits_of, narrow, to_float32
from triforce.kernels.cpu.simd.exp import exp_in_place
from triforce.kernels.cpu.linear.dense import SMALL_ROWS, FusedLinear
from triforce.kernels.cpu.simd.f32_dot import HAS_F32_FMA
from triforce.kernels.cpu.linear.blocks import QuantLinear, project
from triforce.kernels.device_kind import on_host


@numba.njit(cache=True)
def _round(value, like):
    """value (float32) rounded to the element type of array `like` (bfloat16 bits or float32)."""
    return to_float32(narrow(value, like))


@numba.njit(fastmath=True, cache=True)
def _rms_norm(x, weight, eps, out):
    """out[i] = weight * (x[i] / rms(x[i])), the normalised row rounded to the weight's dtype
    before the product (as the eager norm), the product rounded too."""
    rows, width = x.shape
    for i in range(rows):
        total = np.float32(0.0)
        for j in range(width):
            total += x[i, j] * x[i, j]
        scale = np.float32(1.0) / np.sqrt(total / np.float32(width) + eps)
        for j in range(width):
            out[i, j] = _round(to_float32(weight[j]) * _round(x[i, j] * scale, weight), weight)


@numba.njit(cache=True)
def _rope(row, base, dim, cos, sin, like, out):
    """out[d] = row[base + d] * cos[d] + rotate_half(row[base:base + dim])[d] * sin[d], each
    product and the sum rounded to `like`'s dtype (as three eager operators round them)."""
    half = dim // 2
    for d in range(dim):
        other = -row[base + d + half] if d < half else row[base + d - half]
        out[d] = narrow(_round(_round(row[base + d] * to_float32(cos[d]), like)
                               + _round(other * to_float32(sin[d]), like), like), like)


@numba.njit(inline="always")
def _projected(x, norm, eps, w_qkv, b_qkv):
    """x [rows, hidden] -> [rows, q/k/v outputs] float32: RMSNorm, the projection and its bias,
    rounded to x's dtype."""
    rows, hidden = x.shape
    xf = np.empty((rows, hidden), np.float32)
    for i in range(rows):
        for j in range(hidden):
            xf[i, j] = to_float32(x[i, j])
    h = np.empty((rows, hidden), np.float32)
    _rms_norm(xf, norm, eps, h)
    proj = np.empty((rows, b_qkv.shape[0]), np.float32)  # the bias: one per output row, whatever the weight
    project(h, w_qkv, proj)
    for i in range(rows):
        for j in range(proj.shape[1]):
            proj[i, j] = _round(proj[i, j] + b_qkv[j], x)
    return proj


@numba.njit(inline="always")
def _place(proj, i, head, dim, cos, sin, turned, like, out):
    """Head `head` of projected row i into out [D]: rotated where `turned`, else as it is."""
    if turned:
        _rope(proj[i], head * dim, dim, cos[i], sin[i], like, out)
    else:
        for d in range(dim):
            out[d] = narrow(proj[i, head * dim + d], like)


# parallel=True on the halves although they have no prange of their own: see small_rows_linear.
@numba.njit(parallel=True, cache=True)
def _pre(x, norm, eps, w_qkv, b_qkv, cos, sin, heads, kv_heads, qkv_out):
    """x [B * T, hidden] (row i: sequence i // T, token i % T) -> qkv_out [B, heads + 2 kv_heads,
    T, D] (queries and keys rotated)."""
    length, dim = qkv_out.shape[2], qkv_out.shape[3]
    proj = _projected(x, norm, eps, w_qkv, b_qkv)
    for i in range(x.shape[0]):
        seq, token = i // length, i % length
        for head in range(heads + 2 * kv_heads):
            _place(proj, i, head, dim, cos, sin, head < heads + kv_heads, x, qkv_out[seq, head, token])


@numba.njit(parallel=True, cache=True)
def _pre_cached(x, norm, eps, w_qkv, b_qkv, cos, sin, heads, kv_heads, q_out, k_cache, v_cache, first):
    """_pre for one sequence's T rows whose keys and values go straight into a cache's blocks:
    q_out [heads, T, D]; row t's key and value heads into k_cache, v_cache [Hkv, capacity, D] at
    slot first + t (the bits _pre would give them)."""
    dim = q_out.shape[2]
    proj = _projected(x, norm, eps, w_qkv, b_qkv)
    for t in range(x.shape[0]):
        for head in range(heads):
            _place(proj, t, head, dim, cos, sin, True, x, q_out[head, t])
        for h in range(kv_heads):
            _place(proj, t, heads + h, dim, cos, sin, True, x, k_cache[h, first + t])
            _place(proj, t, heads + kv_heads + h, dim, cos, sin, False, x, v_cache[h, first + t])


@numba.njit(parallel=True, cache=True)
def _post(x, attn, w_o, b_o, norm, eps, w_gate_up, b_gate_up, w_down, b_down, out):
    """x [B * T, hidden], attn [B, H, T, D] -> out [B * T, hidden]: x + o(attn), then + the MLP
    of it."""
    rows, hidden = x.shape
    _, heads, length, dim = attn.shape
    a = np.empty((rows, heads * dim), np.float32)
    for i in range(rows):
        for head in range(heads):
            for d in range(dim):
                a[i, head * dim + d] = to_float32(attn[i // length, head, i % length, d])
    o = np.empty((rows, hidden), np.float32)
    project(a, w_o, o)
    x1 = np.empty((rows, hidden), np.float32)
    for i in range(rows):
        for j in range(hidden):
            x1[i, j] = _round(to_float32(x[i, j]) + _round(o[i, j] + b_o[j], x), x)
    h = np.empty((rows, hidden), np.float32)
    _rms_norm(x1, norm, eps, h)
    inner = b_gate_up.shape[0] // 2
    gu = np.empty((rows, 2 * inner), np.float32)
    project(h, w_gate_up, gu)
    m = np.empty((rows, inner), np.float32)
    e = np.empty(inner, np.float32)
    powers = np.empty(inner, np.int32)
    for i in range(rows):
        for j in range(inner):
            m[i, j] = _round(gu[i, j] + b_gate_up[j], x)  # the gate
            e[j] = -m[i, j]
        exp_in_place(e, inner, powers)
        for j in range(inner):
            silu = _round(m[i, j] / (np.float32(1.0) + e[j]), x)
            m[i, j] = _round(silu * _round(gu[i, inner + j] + b_gate_up[inner + j], x), x)
    down = np.empty((rows, hidden), np.float32)
    project(m, w_down, down)
    for i in range(rows):
        for j in range(hidden):
            out[i, j] = narrow(x1[i, j] + _round(down[i, j] + b_down[j], x), x)


class CpuLayer:
    """The numba halves of one decoder layer over its fused projections (FusedLinear, whose
    weights they read in place) and norm weights. `takes(x)` says when they serve a pass."""

    def __init__(self, in_norm: torch.Tensor, post_norm: torch.Tensor, eps: float, qkv: FusedLinear,
                 o: FusedLinear, gate_up: FusedLinear, down: FusedLinear, heads: int, kv_heads: int,
                 head_dim: int):
        """The projections are FusedLinear (weights in the norms' dtype) or QuantLinear (blocks)."""
        self.dtype = in_norm.dtype
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self._norms = (bits_of(in_norm.detach()), bits_of(post_norm.detach()))
        self._eps = np.float32(eps)
        self._linears = [(lin.kernel_args if isinstance(lin, QuantLinear) else lin._w, _bias(lin))
                         for lin in (qkv, o, gate_up, down)]

    @staticmethod
    def fits(in_norm: torch.Tensor, post_norm: torch.Tensor, *linears) -> bool:
        """Whether the layer's parts allow it: every projection a FusedLinear with its kernel,
        all in one dtype, the norm weights in it too (contiguous, on the CPU); or every one a
        QuantLinear (block kernels, on CPUs with FMA) beside float32 or bfloat16 norms."""
        if all(isinstance(lin, QuantLinear) for lin in linears):
            return HAS_F32_FMA and all(n.dtype in (torch.float32, torch.bfloat16) and n.dtype == in_norm.dtype
                                       and on_host(n) and n.is_contiguous() for n in (in_norm, post_norm))
        if not all(isinstance(lin, FusedLinear) and lin._kernel is not None for lin in linears):
            return False
        dtype = linears[0].weight.dtype
        return all(lin.weight.dtype == dtype for lin in linears) and all(
            n.dtype == dtype and on_host(n) and n.is_contiguous() for n in (in_norm, post_norm))

    def takes(self, x: torch.Tensor) -> bool:
        """x [B, T, hidden]: at most SMALL_ROWS tokens in all (a decoding step or verify pass of
        one sequence, or of a batch's rows) in the layer's dtype."""
        return (on_host(x) and x.dtype == self.dtype and x.shape[0] * x.shape[1] <= SMALL_ROWS
                and x.is_contiguous())

    def pre(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, T, hidden]; cos, sin [B, 1, T, D] -> q [B, H, T, D], k, v [B, Hkv, T, D]."""
        batch, length, hidden = x.shape
        qkv = torch.empty(batch, self.heads + 2 * self.kv_heads, length, self.head_dim, dtype=self.dtype,
                          device="cpu")
        w, b = self._linears[0]
        _pre(bits_of(x.view(batch * length, hidden)), self._norms[0], self._eps, w, b, *_angles(cos, sin),
             self.heads, self.kv_heads, bits_of(qkv))
        heads, kv = self.heads, self.kv_heads
        return qkv[:, :heads], qkv[:, heads:heads + kv], qkv[:, heads + kv:]

    def post(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden], attn [B, H, T, D] -> the layer's output [B, T, hidden]."""
        return self._post(x, bits_of(attn.contiguous()))

    def _post(self, x: torch.Tensor, attn: np.ndarray) -> torch.Tensor:
        batch, length, hidden = x.shape
        out = torch.empty_like(x)
        (w_o, b_o), (w_gu, b_gu), (w_d, b_d) = self._linears[1:]
        _post(bits_of(x.view(batch * length, hidden)), attn, w_o, b_o, self._norms[1], self._eps, w_gu, b_gu,
              w_d, b_d, bits_of(out.view(batch * length, hidden)))
        return out

    def decode(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int, view) -> torch.Tensor:
        """The layer over x [B, T, hidden] (`takes(x)`) through `view` (the pass's CacheView):
        straight into the cache's CPU blocks where the view offers them (`kernel_slots`, as a
        BufferStep does), else pre, the view's attend and post. Same bits either way."""
        offer = getattr(view, "kernel_slots", None)  # a view may offer only attend (the protocol's one call)
        slots = offer(layer, self.dtype, x.shape[0], self.heads, x.shape[1]) if offer is not None else None
        if slots is None:
            return self.post(x, view.attend(layer, *self.pre(x, cos, sin)))
        decoder, first, keys, queries = slots
        length, hidden = x.shape[1], x.shape[2]
        rows = bits_of(x.view(length, hidden))
        if queries is None:
            q = np.empty((self.heads, length, self.head_dim), rows.dtype)
        else:  # recorded for the sparse tiers, as attend records them
            queries[layer] = torch.empty(1, self.heads, length, self.head_dim, dtype=x.dtype, device="cpu")
            q = bits_of(queries[layer])[0]
        w, b = self._linears[0]
        _pre_cached(rows, self._norms[0], self._eps, w, b, *_angles(cos, sin), self.heads, self.kv_heads, q,
                    decoder.k[layer], decoder.v[layer], first)
        attn = decoder.attend_rows(layer, q, keys)
        return self._post(x, attn.reshape(1, self.heads, length, self.head_dim))


_last_angles: tuple = (None, None, None)  # (cos, sin, their arrays): the same for every layer of a pass


def _angles(cos: torch.Tensor, sin: torch.Tensor) -> tuple:
    """cos, sin [B, 1, T, D] as the [B * T, D] arrays _pre takes, converted once per forward pass (the model
    hands every layer the same two tensors; holding them here keeps their ids from being reused;
    one tuple, read and replaced whole, so concurrent passes never mix two passes' angles)."""
    global _last_angles
    last = _last_angles
    if last[0] is not cos or last[1] is not sin:
        rows = cos.shape[0] * cos.shape[2]
        last = (cos, sin, (bits_of(cos.reshape(rows, -1).contiguous()), bits_of(sin.reshape(rows, -1).contiguous())))
        _last_angles = last
    return last[2]


def _bias(linear) -> np.ndarray:
    """The linear's float32 bias (FusedLinear and QuantLinear keep one), or zeros: adding them is exact."""
    if linear._bias32 is None:
        return np.zeros(linear.out_features, np.float32)
    return linear._bias32.numpy()


def warm_up(dtype: torch.dtype) -> None:
    """Compile both halves for `dtype` now (or load them from numba's cache), with the array
    types a decoding step passes them."""
    if dtype not in (torch.float32, torch.bfloat16):
        return
    hidden, heads, dim = 8, 2, 4
    bits = lambda *shape: bits_of(torch.zeros(*shape, dtype=dtype, device="cpu"))  # noqa: E731
    zeros = lambda n: np.zeros(n, np.float32)  # noqa: E731
    eps, x, angles = np.float32(1e-5), bits(1, hidden), bits(1, dim)
    qkv = (heads + 2) * dim
    _pre(x, bits(hidden), eps, bits(qkv, hidden), zeros(qkv), angles, angles, heads, 1, bits(1, heads + 2, 1, dim))
    _pre_cached(x, bits(hidden), eps, bits(qkv, hidden), zeros(qkv), angles, angles, heads, 1, bits(heads, 1, dim),
                bits(1, 2, dim), bits(1, 2, dim), 0)
    _post(x, bits(1, heads, 1, dim), bits(hidden, heads * dim), zeros(hidden), bits(hidden), eps,
          bits(2 * hidden, hidden), zeros(2 * hidden), bits(hidden, hidden), zeros(hidden), bits(1, hidden))
