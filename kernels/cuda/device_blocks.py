"""Block-quantized weights held as torch tensors on a device (a GPU), for the Triton block kernels
(triforce.kernels.cuda.quant_triton), in the GGUF file's own bytes as far as they go: the same
quants as triforce.kernels.cpu.linear.block_formats' BlockWeight (which the CPU's numba kernels read as
numpy arrays), but scales kept small, since a GPU step's time is the bytes it reads:
  q8_0, q4_0, q4_1: the file's float16 scales (and Q4_1's float16 offsets), 34/18/20 bytes per 32
      weights as in the file (the CPU widens them to float32);
  q4_k: each 32 weights' 6-bit sc and m a byte each, each 256's d and dmin in float32: 19 bytes
      per 32 (the file's 18; the CPU holds d sc and -dmin m expanded, 24);
  q6_k (from files): as the CPU holds it, q - 32 a signed byte and d sc float32 per 16 weights,
      40 bytes per 32 (the file's 26.25).
A weight is d (q - bias) + m per 32-weight block, Q4_K's d = d256 sc and m = -(dmin256 m6): the
same float32 products BlockWeight computes, so both de-quantize to the same bits."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from triforce.kernels.cpu.linear.block_formats import BLOCK, BYTE_QUANTS, FILE_BYTES, Q4_BIAS

SUPER_BLOCKS = 8  # Q4_K: 32-weight blocks per 256-weight super-block


@dataclass
class DeviceBlocks:
    """A [rows, cols] matrix in one of the block formats: quants int8 [rows, cols] (q8_0) or uint8
    [rows, cols // 2] (4-bit; byte j of a block holds weight j low, j + 16 high); scales float16
    [rows, cols // 32] (q4_k: uint8 sc; q6_k: float32 [rows, cols // 16]); offsets float16 [rows, cols // 32] (q4_1; q4_k: uint8 m)
    or [rows, 0]; supers float32 [rows, cols // 256, 2] (q4_k's d and dmin) or [rows, 0, 2]."""
    kind: str
    rows: int
    cols: int
    quants: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    supers: torch.Tensor

    @classmethod
    def of(cls, block, device: torch.device) -> "DeviceBlocks":
        """A BlockWeight copied to `device` (a q4_k one made with its k_factors)."""
        def put(a):
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)
        if block.kind == "q4_k":
            if block.k_factors is None:
                raise ValueError("q4_k blocks for a GPU are made with k_factors=True")
            sc_m, d_dmin = block.k_factors
            return cls("q4_k", block.rows, block.cols, put(block.quants), put(sc_m[:, :, 0]), put(sc_m[:, :, 1]),
                       put(d_dmin))
        if block.kind == "q6_k":  # d sc: a float32 product, not a float16
            return cls("q6_k", block.rows, block.cols, put(block.quants), put(block.scales), put(block.offsets),
                       torch.zeros(block.rows, 0, 2, device=device))
        half = [put(a.astype(np.float16)) for a in (block.scales, block.offsets)]  # exact: the file's float16
        return cls(block.kind, block.rows, block.cols, put(block.quants), *half,
                   torch.zeros(block.rows, 0, 2, device=device))

    @property
    def q4(self) -> bool:
        return self.kind not in BYTE_QUANTS

    @property
    def bias(self) -> float:
        """What each 4-bit quant is shifted by before scaling (8 for q4_0, else 0)."""
        return Q4_BIAS.get(self.kind, 0.0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.quants, self.scales, self.offsets, self.supers))

    @property
    def file_nbytes(self) -> int:
        return int(self.rows * self.cols // BLOCK * FILE_BYTES[self.kind])

    def block_scales(self, rows: slice | torch.Tensor = slice(None)) -> tuple[torch.Tensor, torch.Tensor | None]:
        """float32 [rows, blocks] scales and offsets (None: none) of each 32-weight block."""
        scales, offsets = self.scales[rows], self.offsets[rows]
        if self.kind != "q4_k":
            return scales.float(), offsets.float() if offsets.shape[1] else None
        supers = self.supers[rows]  # [rows, supers, 2] -> one (d, dmin) per 32-weight block
        supers = supers[:, :, None].expand(-1, -1, SUPER_BLOCKS, -1).reshape(supers.shape[0], -1, 2)
        return supers[:, :, 0] * scales.float(), -(supers[:, :, 1] * offsets.float())

    def dequantized(self) -> torch.Tensor:
        """float32 [rows, cols] on the device: d (q - bias) + m, as BlockWeight.dequantized."""
        return self._dequantize(self.quants, *self.block_scales())

    def take_rows(self, index: torch.Tensor) -> torch.Tensor:
        """float32 [len(index), cols]: those rows de-quantized (an embedding lookup)."""
        index = index.to(device=self.quants.device, dtype=torch.int64)
        return self._dequantize(self.quants[index], *self.block_scales(index))

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

    def _dequantize(self, quants, scales, offsets) -> torch.Tensor:
        rows, nb = scales.shape
        if self.q4:
            # low nibbles are weights 0-15 of a block, high ones 16-31; no constant tensor is made
            # here (a host-to-device copy per call, which a CUDA graph cannot capture)
            packed = quants.reshape(rows, nb, BLOCK // 2)
            q = torch.cat([packed & 0x0F, packed >> 4], dim=2).to(torch.float32) - self.bias
        else:
            q = quants.reshape(rows, nb, self.cols // nb).to(torch.float32)
        w = scales[:, :, None] * q
        if offsets is not None:
            w = w + offsets[:, :, None]
        return w.reshape(rows, -1)
