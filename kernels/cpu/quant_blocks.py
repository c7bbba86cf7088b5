"""GGUF's block formats Q8_0, Q4_0 and Q4_1, kept as blocks: what a weight matrix holds in memory
when it is not de-quantized.

Every format stores 32 consecutive weights of a row in one block with a float16 scale d (Q4_1 also
a float16 offset m): Q8_0 32 int8 values w = d q; Q4_0 16 bytes of nibbles w = d (q - 8); Q4_1 16
bytes of nibbles w = d q + m (byte j holds weight j in its low nibble and weight j + 16 in its
high one). The kernels (triforce.kernels.cpu.quant_linear) read them as arrays of their own:
quants [n, blocks * 32] int8 or [n, blocks * 16] uint8, scales and offsets [n, blocks] float32
(Q4_1's m; Q4_0 and Q8_0 have none: [n, 0]). Quantizing a float
matrix and de-quantizing (the reference in tests) are the gguf package's own."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

BLOCK = 32
FORMATS = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1}
_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}  # per block of 32 weights, as in a GGUF file


def format_of(kind: GGMLQuantizationType) -> str | None:
    """The format name of a GGUF tensor type that runs as blocks here (None: it does not)."""
    return next((name for name, t in FORMATS.items() if t == kind), None)


@dataclass
class BlockWeight:
    """A [rows, cols] weight matrix in one of FORMATS (cols a multiple of 32)."""
    kind: str
    rows: int
    cols: int
    quants: np.ndarray   # int8 [rows, cols] (q8_0) or uint8 [rows, cols // 2] (4-bit)
    scales: np.ndarray   # float32 [rows, cols // 32]
    offsets: np.ndarray  # float32 [rows, cols // 32] (q4_1); [rows, 0] for q8_0 and q4_0

    @property
    def nbytes(self) -> int:
        return self.quants.nbytes + self.scales.nbytes + self.offsets.nbytes

    @property
    def file_nbytes(self) -> int:
        """Bytes the same blocks take in a GGUF file."""
        return self.rows * self.cols // BLOCK * _BYTES[self.kind]

    @classmethod
    def from_raw(cls, kind: str, raw: np.ndarray, rows: int, cols: int) -> "BlockWeight":
        """raw: the GGUF tensor's bytes, uint8 [rows, cols // 32 * bytes per block]."""
        if kind not in FORMATS:
            raise ValueError(f"unknown block format '{kind}' (one of {', '.join(FORMATS)})")
        if cols % BLOCK:
            raise ValueError(f"a {kind} row holds whole blocks of {BLOCK} weights, not {cols}")
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // BLOCK, _BYTES[kind])
        scales = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
        if kind == "q8_0":
            quants = blocks[:, :, 2:].copy().view(np.int8).reshape(rows, cols)
            offsets = np.zeros((rows, 0), np.float32)
        elif kind == "q4_0":
            quants = blocks[:, :, 2:].reshape(rows, cols // 2).copy()
            offsets = np.zeros((rows, 0), np.float32)  # the kernels subtract 8 from each nibble
        else:
            offsets = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32)
            quants = blocks[:, :, 4:].reshape(rows, cols // 2).copy()
        return cls(kind, rows, cols, quants, np.ascontiguousarray(scales), np.ascontiguousarray(offsets))

    @classmethod
    def quantize(cls, kind: str, weight: torch.Tensor) -> "BlockWeight":
        """A float matrix [rows, cols] quantized as llama.cpp's reference quantizer does."""
        if kind not in FORMATS:
            raise ValueError(f"unknown block format '{kind}' (one of {', '.join(FORMATS)})")
        rows, cols = weight.shape
        if cols % BLOCK:
            raise ValueError(f"{kind} needs rows of whole {BLOCK}-weight blocks; this matrix has {cols} columns")
        raw = quantize(weight.detach().to(torch.float32).numpy(), FORMATS[kind])
        return cls.from_raw(kind, raw, rows, cols)

    def raw(self) -> np.ndarray:
        """The GGUF bytes of these blocks (uint8 [rows, blocks * bytes per block])."""
        nb = self.cols // BLOCK
        out = np.empty((self.rows, nb, _BYTES[self.kind]), np.uint8)
        out[:, :, 0:2] = self.scales.astype(np.float16)[:, :, None].view(np.uint8)
        if self.kind == "q8_0":
            out[:, :, 2:] = self.quants.reshape(self.rows, nb, BLOCK).view(np.uint8)
        elif self.kind == "q4_0":
            out[:, :, 2:] = self.quants.reshape(self.rows, nb, BLOCK // 2)
        else:
            out[:, :, 2:4] = self.offsets.astype(np.float16)[:, :, None].view(np.uint8)
            out[:, :, 4:] = self.quants.reshape(self.rows, nb, BLOCK // 2)
        return out.reshape(self.rows, -1)

    def dequantized(self) -> torch.Tensor:
        """float32 [rows, cols] by the gguf package's de-quantizer (the reference)."""
        return torch.from_numpy(dequantize(self.raw(), FORMATS[self.kind]).reshape(self.rows, self.cols).copy())

    def take_rows(self, index: torch.Tensor) -> torch.Tensor:
        """float32 [len(index), cols]: those rows de-quantized (an embedding lookup)."""
        picked = index.to(torch.int64).numpy()
        part = BlockWeight(self.kind, len(picked), self.cols, self.quants[picked], self.scales[picked],
                           self.offsets[picked])
        return part.dequantized()

    @staticmethod
    def stack(parts: list["BlockWeight"]) -> "BlockWeight":
        """The matrices one above the other (a fused projection), all of one format."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1 or len({p.cols for p in parts}) != 1:
            raise ValueError("stacked block weights need one format and one width")
        return BlockWeight(parts[0].kind, sum(p.rows for p in parts), parts[0].cols,
                           np.concatenate([p.quants for p in parts]), np.concatenate([p.scales for p in parts]),
                           np.concatenate([p.offsets for p in parts]))

    def permute_rows(self, order: np.ndarray) -> "BlockWeight":
        return BlockWeight(self.kind, self.rows, self.cols, self.quants[order].copy(), self.scales[order].copy(),
                           self.offsets[order].copy())
