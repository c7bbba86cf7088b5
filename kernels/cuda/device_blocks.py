"""Block-quantized weights held as torch tensors on a device (a GPU), for the Triton block kernels
(triforce.kernels.cuda.quant_triton): the same arrays as triforce.kernels.cpu.quant_blocks'
BlockWeight, which the CPU's numba kernels read as numpy arrays. Made from a BlockWeight; no
format logic of its own beyond de-quantizing, which repeats BlockWeight.dequantized's float32
arithmetic in torch (the reference path and embedding lookups run it on the device)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from triforce.kernels.cpu.quant_blocks import BLOCK, FILE_BYTES, Q4_BIAS


@dataclass
class DeviceBlocks:
    """A [rows, cols] matrix in one of the block formats: quants int8 [rows, cols] (q8_0) or uint8
    [rows, cols // 2] (4-bit; byte j of a block holds weight j low, j + 16 high), scales float32
    [rows, cols // 32], offsets float32 [rows, cols // 32] (q4_1, q4_k) or [rows, 0]."""
    kind: str
    rows: int
    cols: int
    quants: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def of(cls, block, device: torch.device) -> "DeviceBlocks":
        """A BlockWeight's arrays copied to `device`."""
        def put(a):
            return torch.from_numpy(a).to(device).contiguous()
        return cls(block.kind, block.rows, block.cols, put(block.quants), put(block.scales), put(block.offsets))

    @property
    def q4(self) -> bool:
        return self.kind != "q8_0"

    @property
    def bias(self) -> float:
        """What each 4-bit quant is shifted by before scaling (8 for q4_0, else 0)."""
        return Q4_BIAS.get(self.kind, 0.0)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.quants, self.scales, self.offsets))

    @property
    def file_nbytes(self) -> int:
        return self.rows * self.cols // BLOCK * FILE_BYTES[self.kind]

    def dequantized(self) -> torch.Tensor:
        """float32 [rows, cols] on the device: d (q - bias) + m, as BlockWeight.dequantized."""
        return _dequantize(self, self.quants, self.scales, self.offsets)

    def take_rows(self, index: torch.Tensor) -> torch.Tensor:
        """float32 [len(index), cols]: those rows de-quantized (an embedding lookup)."""
        index = index.to(device=self.quants.device, dtype=torch.int64)
        return _dequantize(self, self.quants[index], self.scales[index], self.offsets[index])

    def part(self, rows: slice) -> "DeviceBlocks":
        """Rows `rows` of this matrix (views)."""
        first, stop, _ = rows.indices(self.rows)
        return DeviceBlocks(self.kind, stop - first, self.cols, self.quants[rows], self.scales[rows], self.offsets[rows])

    @staticmethod
    def stack(parts: list["DeviceBlocks"]) -> "DeviceBlocks":
        if len({p.kind for p in parts}) != 1 or len({p.cols for p in parts}) != 1:
            raise ValueError("stacked block weights need one format and one width")
        return DeviceBlocks(parts[0].kind, sum(p.rows for p in parts), parts[0].cols,
                            *(torch.cat([getattr(p, name) for p in parts])
                              for name in ("quants", "scales", "offsets")))


def _dequantize(blocks: DeviceBlocks, quants, scales, offsets) -> torch.Tensor:
    rows, nb = scales.shape
    if blocks.q4:
        packed = quants.reshape(rows, nb, 1, BLOCK // 2)
        shifts = torch.tensor([0, 4], dtype=torch.uint8, device=quants.device).reshape(1, 1, 2, 1)
        q = ((packed >> shifts) & 0x0F).reshape(rows, nb, BLOCK).to(torch.float32) - blocks.bias
    else:
        q = quants.reshape(rows, nb, BLOCK).to(torch.float32)
    w = scales[:, :, None] * q
    if offsets.shape[1]:
        w = w + offsets[:, :, None]
    return w.reshape(rows, nb * BLOCK)
