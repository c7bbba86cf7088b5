"""GGUF's block formats Q8_0, Q4_0, Q4_1 and Q4_K, kept as blocks: what a weight matrix holds in
memory when it is not de-quantized.

Every format stores 32 consecutive weights of a row in one block with a float16 scale d (Q4_1 also
a float16 offset m): Q8_0 32 int8 values w = d q; Q4_0 16 bytes of nibbles w = d (q - 8); Q4_1 16
bytes of nibbles w = d q + m (byte j holds weight j in its low nibble and weight j + 16 in its
high one). Q4_K's super-blocks of 256 become eight Q4_1 blocks with float32 scales and offsets,
and Q6_K's (loaded from files only) int8 quants with a float32 scale per 16 weights, which the Q8_0
kernels read as 16-weight blocks (triforce.kernels.cpu.linear.q4_k). The kernels (triforce.kernels.cpu.linear.blocks) read them as
arrays of their own: quants [n, blocks * 32] int8 or [n, blocks * 16] uint8, scales and offsets
[n, blocks] float32 (Q4_1's and Q4_K's offsets; Q4_0, Q8_0 and Q6_K have none: [n, 0]). Quantizing a
float matrix is the gguf package's own (Q4_K's is quant_k's), and its de-quantizers are the
reference the tests hold these blocks to."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from triforce.kernels.cpu.linear.q4_k import (SUPER, q4_k_blocks, q4_k_factors, q6_k_blocks, q6_k_factors,
                                              quantize_q4_k)

BLOCK = 32
FORMATS = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0, "q4_1": GGMLQuantizationType.Q4_1,
           "q4_k": GGMLQuantizationType.Q4_K}
# run as blocks when a file holds them, but not made at load (the gguf package has no quantizer)
FILE_FORMATS = {**FORMATS, "q6_k": GGMLQuantizationType.Q6_K}
BYTE_QUANTS = ("q8_0", "q6_k")  # a signed byte per weight; the others 4-bit nibbles
# per 32 weights in a GGUF file (Q4_K: 144 per 256, Q6_K: 210)
FILE_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q4_k": 18, "q6_k": 26.25}
HELD_BYTES = {"q8_0": 36, "q4_0": 20, "q4_1": 24, "q4_k": 24, "q6_k": 40}  # as the CPU kernels read them
# per 32 weights as the GPU kernels read them (triforce.kernels.cuda.device_blocks): the file's
# float16 scales; Q4_K's 6-bit sc and m a byte each and float32 d and dmin per 256; Q6_K's
# nibbles, bit pairs and int8 sc as in the file, its d per 256 in float32
DEVICE_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q4_k": 19, "q6_k": 26.5}
_ROW_MULTIPLE = {"q4_k": SUPER, "q6_k": SUPER}
Q4_BIAS = {"q4_0": 8.0}  # 4-bit weights are d (q - bias) + m


def format_of(kind: GGMLQuantizationType) -> str | None:
    """The format name of a GGUF tensor type that runs as blocks here (None: it does not)."""
    return next((name for name, t in FILE_FORMATS.items() if t == kind), None)


@dataclass
class BlockWeight:
    """A [rows, cols] weight matrix in one of FORMATS (cols a multiple of 32)."""
    kind: str
    rows: int
    cols: int
    quants: np.ndarray   # int8 [rows, cols] (q8_0, q6_k) or uint8 [rows, cols // 2] (4-bit)
    scales: np.ndarray   # float32 [rows, cols // 32] (q6_k: cols // 16)
    offsets: np.ndarray  # float32 [rows, cols // 32] (q4_1); [rows, 0] for q8_0 and q4_0
    # q4_k and q6_k for a GPU: their own factors (q4_k.q4_k_factors: sc_m uint8 [rows, cols // 32, 2],
    # d_dmin float32 [rows, cols // 256, 2]; q4_k.q6_k_factors: sc int8 [rows, cols // 16], d float32
    # [rows, cols // 256]), which DeviceBlocks holds instead of scales and offsets
    k_factors: tuple[np.ndarray, np.ndarray] | None = None

    @property
    def nbytes(self) -> int:
        return self.quants.nbytes + self.scales.nbytes + self.offsets.nbytes

    @property
    def file_nbytes(self) -> int:
        """Bytes the same blocks take in a GGUF file."""
        return int(self.rows * self.cols // BLOCK * FILE_BYTES[self.kind])

    @property
    def group(self) -> int:
        """Weights per scale: 32 (16 for q6_k)."""
        return self.cols // self.scales.shape[1]

    @classmethod
    def from_raw(cls, kind: str, raw: np.ndarray, rows: int, cols: int, k_factors: bool = False) -> "BlockWeight":
        """raw: the GGUF tensor's bytes, uint8 [rows, cols // 32 * bytes per block]. k_factors:
        keep Q4_K's and Q6_K's own factors too (a GPU holds those)."""
        _check(kind, cols)
        if kind == "q4_k":
            return cls(kind, rows, cols, *q4_k_blocks(raw, rows, cols),
                       k_factors=q4_k_factors(raw, rows, cols) if k_factors else None)
        if kind == "q6_k":
            return cls(kind, rows, cols, *q6_k_blocks(raw, rows, cols), np.zeros((rows, 0), np.float32),
                       k_factors=q6_k_factors(raw, rows, cols) if k_factors else None)
        blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows, cols // BLOCK, FILE_BYTES[kind])
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
    def quantize(cls, kind: str, weight: torch.Tensor, k_factors: bool = False) -> "BlockWeight":
        """A float matrix [rows, cols] quantized as llama.cpp's reference quantizer does (Q4_K:
        a plainer one, triforce.kernels.cpu.linear.q4_k). k_factors: see from_raw."""
        rows, cols = weight.shape
        _check(kind, cols)
        w = weight.detach().to(torch.float32).numpy()
        raw = quantize_q4_k(w) if kind == "q4_k" else quantize(w, FORMATS[kind])
        return cls.from_raw(kind, raw, rows, cols, k_factors)

    def raw(self) -> np.ndarray:
        """The GGUF bytes of these blocks (uint8 [rows, blocks * bytes per block]); Q4_K's are not
        kept (its blocks are held as Q4_1's)."""
        if self.kind in ("q4_k", "q6_k"):
            raise ValueError(f"{self.kind} blocks are held in a layout of their own; their file bytes are not kept")
        nb = self.cols // BLOCK
        out = np.empty((self.rows, nb, FILE_BYTES[self.kind]), np.uint8)
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
        """float32 [rows, cols]: d (q - bias) + m per weight, in the gguf package's float32
        arithmetic (the tests hold it to the package's de-quantizers bit for bit)."""
        nb = self.scales.shape[1]
        if self.kind in BYTE_QUANTS:
            q = self.quants.reshape(self.rows, nb, self.group).astype(np.float32)
        else:
            packed = self.quants.reshape(self.rows, nb, 1, BLOCK // 2)
            nibbles = (packed >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
            q = nibbles.reshape(self.rows, nb, BLOCK).astype(np.float32) - np.float32(Q4_BIAS.get(self.kind, 0.0))
        w = self.scales[:, :, None] * q
        if self.offsets.shape[1]:
            w = w + self.offsets[:, :, None]
        return torch.from_numpy(np.ascontiguousarray(w.reshape(self.rows, self.cols)))

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

    def part(self, rows: slice) -> "BlockWeight":
        """Rows `rows` of this matrix (views)."""
        first, stop, _ = rows.indices(self.rows)
        return BlockWeight(self.kind, stop - first, self.cols, self.quants[rows], self.scales[rows], self.offsets[rows],
                           None if self.k_factors is None else tuple(f[rows] for f in self.k_factors))

    def permute_rows(self, order: np.ndarray) -> "BlockWeight":
        """The rows `order` names, in that order (all of them, or a fused matrix's part)."""
        return BlockWeight(self.kind, len(order), self.cols, self.quants[order].copy(), self.scales[order].copy(),
                           self.offsets[order].copy(),
                           None if self.k_factors is None else tuple(f[order].copy() for f in self.k_factors))


def whole_blocks(kind: str, cols: int) -> bool:
    """Whether rows of `cols` weights hold whole blocks of format `kind`."""
    return cols % _ROW_MULTIPLE.get(kind, BLOCK) == 0


def _check(kind: str, cols: int) -> None:
    if kind not in FILE_FORMATS:
        raise ValueError(f"unknown block format '{kind}' (one of {', '.join(FILE_FORMATS)})")
    if not whole_blocks(kind, cols):
        raise ValueError(f"{kind} needs rows of whole {_ROW_MULTIPLE.get(kind, BLOCK)}-weight blocks; "
                         f"this matrix has {cols} columns")
