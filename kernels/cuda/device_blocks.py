"""Block-quantized weights held as torch tensors on a device (a GPU), for the Triton block kernels
(triforce.kernels.cuda.quant_triton), in the GGUF file's own bytes as far as they go: the same
quants as triforce.kernels.cpu.linear.block_formats' BlockWeight (which the CPU's numba kernels read as
numpy arrays), but scales kept small, since a GPU step's time is the bytes it reads:
  q8_0, q4_0, q4_1: the file's float16 scales (and Q4_1's float16 offsets), 34/18/20 bytes per 32
      weights as in the file (the CPU widens them to float32);
  q4_k: each 32 weights' 6-bit sc and m a byte each, each 256's d and dmin in float32: 19 bytes
      per 32 (the file's 18; the CPU holds d sc and -dmin m expanded, 24);
  q6_k: each weight's low nibble in 4-bit blocks' order, its two high bits four to a byte, sc an
      int8 per 16 weights and d per 256 in float32: 26.5 bytes per 32 (the file's 26.25; the CPU
      holds q - 32 a byte and d sc in float32, 40).
A weight is d (q - bias) + m per 32-weight block, Q4_K's d = d256 sc and m = -(dmin256 m6), Q6_K's
d = d256 sc per 16 weights: the same float32 products BlockWeight computes, so both de-quantize
to the same bits."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from triforce.kernels.cpu.linear.block_formats import BLOCK, FILE_BYTES, Q4_BIAS

SUPER_BLOCKS = 8  # 32-weight blocks per 256-weight super-block (Q4_K, Q6_K)
Q6_BIAS = 32      # Q6_K's 6-bit quants are q - 32
HIGH_SHIFTS = (0, 2, 4, 6)  # Q6_K: bits 4-5 of weights j, j + 8, j + 16, j + 24 in byte j of 8


@dataclass
class DeviceBlocks:
    """A [rows, cols] matrix in one of the block formats: quants int8 [rows, cols] (q8_0) or uint8
    [rows, cols // 2] (4-bit and q6_k's low bits; byte j of a block holds weight j low, j + 16
    high); scales float16 [rows, cols // 32] (q4_k: uint8 sc; q6_k: int8 sc [rows, cols // 16]);
    offsets float16 [rows, cols // 32] (q4_1; q4_k: uint8 m; q6_k: the high bit pairs, uint8
    [rows, cols // 4]) or [rows, 0]; supers float32 [rows, cols // 256, 2] (q4_k's d and dmin;
    q6_k's d [rows, cols // 256, 1]) or [rows, 0, 2]."""
    kind: str
    rows: int
    cols: int
    quants: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    supers: torch.Tensor

    @classmethod
    def of(cls, block, device: torch.device) -> "DeviceBlocks":
        """A BlockWeight copied to `device` (a q4_k or q6_k one made with its k_factors)."""
        def put(a):
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)
        if block.kind in ("q4_k", "q6_k") and block.k_factors is None:
            raise ValueError(f"{block.kind} blocks for a GPU are made with k_factors=True")
        if block.kind == "q4_k":
            sc_m, d_dmin = block.k_factors
            return cls("q4_k", block.rows, block.cols, put(block.quants), put(sc_m[:, :, 0]), put(sc_m[:, :, 1]),
                       put(d_dmin))
        if block.kind == "q6_k":
            sc, d = block.k_factors
            low, high = pack_q6_k(block.quants)
            return cls("q6_k", block.rows, block.cols, put(low), put(sc), put(high), put(d[:, :, None]))
        half = [put(a.astype(np.float16)) for a in (block.scales, block.offsets)]  # exact: the file's float16
        return cls(block.kind, block.rows, block.cols, put(block.quants), *half,
                   torch.zeros(block.rows, 0, 2, device=device))

    @property
    def nibbles(self) -> bool:
        """Whether quants hold two weights' (low) 4 bits a byte: all but q8_0."""
        return self.kind != "q8_0"

    @property
    def bias(self) -> float:
        """What each quant is shifted by before scaling (8 for q4_0, 32 for q6_k, else 0)."""
        return Q6_BIAS if self.kind == "q6_k" else Q4_BIAS.get(self.kind, 0.0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.quants, self.scales, self.offsets, self.supers))

    @property
    def file_nbytes(self) -> int:
        return int(self.rows * self.cols // BLOCK * FILE_BYTES[self.kind])

    def block_scales(self, rows: slice | torch.Tensor = slice(None)) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float32 [rows, blocks] scales and offsets (None: none) of each 32-weight block (q6_k:
        scales of each 16 weights, no offsets)."""
        scales, offsets = self.scales[rows], self.offsets[rows]
        if self.kind == "q6_k":
            d = self.supers[rows][:, :, 0]  # one d per 16 scales
            return d[:, :, None].expand(-1, -1, 16).reshape(d.shape[0], -1) * scales.float(), None
        if self.kind != "q4_k":
            return scales.float(), offsets.float() if offsets.shape[1] else None
        supers = self.supers[rows]  # [rows, supers, 2] -> one (d, dmin) per 32-weight block
        supers = supers[:, :, None].expand(-1, -1, SUPER_BLOCKS, -1).reshape(supers.shape[0], -1, 2)
        return supers[:, :, 0] * scales.float(), -(supers[:, :, 1] * offsets.float())

    def dequantized(self) -> torch.Tensor:
        """float32 [rows, cols] on the device: d (q - bias) + m, as BlockWeight.dequantized."""
        return self._dequantize(slice(None))

    def take_rows(self, index: torch.Tensor) -> torch.Tensor:
        """float32 [len(index), cols]: those rows de-quantized (an embedding lookup)."""
        return self._dequantize(index.to(device=self.quants.device, dtype=torch.int64))

    def quant_values(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """uint8 or int8 [rows, cols]: each weight's quant in the weights' order (q6_k: q - 32, as
        BlockWeight holds it; the others as stored, before any bias)."""
        quants = self.quants[rows]
        if not self.nibbles:
            return quants
        n = quants.shape[0]
        # low nibbles are weights 0-15 of a block, high ones 16-31; no constant tensor is made
        # here (a host-to-device copy per call, which a CUDA graph cannot capture)
        packed = quants.reshape(n, -1, BLOCK // 2)
        q = torch.cat([packed & 0x0F, packed >> 4], dim=2)
        if self.kind != "q6_k":
            return q.reshape(n, -1)
        pairs = self.offsets[rows].reshape(n, -1, 1, BLOCK // 4)
        high = torch.cat([(pairs >> s) & 3 for s in HIGH_SHIFTS], dim=2).reshape(n, -1, BLOCK)
        return ((q | (high << 4)).to(torch.int16) - Q6_BIAS).to(torch.int8).reshape(n, -1)

    def part(self, rows: slice) -> "DeviceBlocks":
        """Rows `rows` of this matrix (views)."""
        first, stop, _ = rows.indices(self.rows)
        return DeviceBlocks(self.kind, stop - first, self.cols, self.quants[rows], self.scales[rows],
                            self.offsets[rows], self.supers[rows])

    @staticmethod
    def stack(parts: list["DeviceBlocks"]) -> "DeviceBlocks":
        if len({p.kind for p in parts}) != 1 or len({p.cols for p in parts}) != 1:
            raise ValueError("stacked block weights need one format and one width")
        return DeviceBlocks(parts[0].kind, sum(p.rows for p in parts), parts[0].cols,
                            *(torch.cat([getattr(p, name) for p in parts])
                              for name in ("quants", "scales", "offsets", "supers")))

    def _dequantize(self, rows: slice | torch.Tensor) -> torch.Tensor:
        scales, offsets = self.block_scales(rows)
        n, groups = scales.shape
        q = self.quant_values(rows).reshape(n, groups, self.cols // groups).to(torch.float32)
        if self.kind != "q6_k":
            q = q - self.bias
        w = scales[:, :, None] * q
        if offsets is not None:
            w = w + offsets[:, :, None]
        return w.reshape(n, -1)


def pack_q6_k(quants: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """BlockWeight's Q6_K quants (int8 q - 32 [rows, cols]) -> the low nibbles uint8 [rows, cols // 2]
    in 4-bit blocks' order and the high bit pairs uint8 [rows, cols // 4] (byte j of a block's 8
    holds those of weights j, j + 8, j + 16, j + 24, lowest first)."""
    rows, cols = quants.shape
    q = (quants.astype(np.int16) + Q6_BIAS).astype(np.uint8).reshape(rows, cols // BLOCK, BLOCK)
    low = q & 0x0F
    packed = low[:, :, :16] | (low[:, :, 16:] << 4)
    high = (q >> 4).reshape(rows, cols // BLOCK, 4, BLOCK // 4)
    pairs = sum(high[:, :, i] << shift for i, shift in enumerate(HIGH_SHIFTS)).astype(np.uint8)
    return packed.reshape(rows, cols // 2), pairs.reshape(rows, cols // 4)
