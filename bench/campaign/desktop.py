"""The 2026 desktop's steps of the GPU campaign (issue 72): random-weight Q4_K_M files of a model
whose 128K KV fits a 24 GB card (Llama-3.1-8B) and one whose KV must live on the host (Qwen3-32B),
ours beside llama.cpp's CUDA build (bench/build_llamacpp_cuda.sh) on the same file."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from triforce.bench.campaign.work import TRACE, Fixed, Step


@dataclass(frozen=True)
class Desktop:
    """The 2026 desktop's files (bench/random_gguf.py, Q4_K_M as llama.cpp writes it) and contexts:
    one model whose KV fits the card at 128K, one whose KV must live on the host."""
    folder: str                        # where the files are written (on the lent machine's disk)
    small: str = "llama3.1-8b"
    large: str = "qwen3-32b-128k"
    small_contexts: tuple[int, int] = (32768, 131072)
    large_contexts: tuple[int, int] = (65536, 131072)
    card_gib: float = 22.3             # what a 4090 driving a display leaves to PyTorch
    llama_bench: str = "-"             # "-": the carried CUDA build (llamacpp_peer's default)
    budget_flags: tuple[str, ...] = ("--profile", "rtx4090-24g-display")  # 22.3 GiB to PyTorch

    def file(self, arch: str) -> str:
        return f"{self.folder}/{arch}-q4_k_m.gguf"


DESKTOP = Desktop("/tmp/triforce-desktop")
# on a CPU: a llama file and a Qwen3 block (64-wide heads) of a few MB, llama.cpp's CPU build where it is
REDUCED_DESKTOP = Desktop("/tmp/triforce-desktop-reduced", "llama-68m", "qwen3-tiny-test", (512, 1000), (512, 1000),
                          0.5, "~/.cache/llamacpp/bin/llama-bench", ("--device-budget", "120MB"))


def desktop_steps(scale, out_dir) -> list[Step]:
    """The 2026 desktop (issue 72): random-weight Q4_K_M files of Llama-3.1-8B (its 128K KV fits the
    card) and Qwen3-32B (its KV lives on the host), ours beside llama.cpp's CUDA build on the same
    file. Named steps for now (--only desktop-...): their estimates are assumed until a card runs them."""
    d = scale.desktop
    small, large = d.file(d.small), d.file(d.large)
    peer = ("-m", "triforce.bench.campaign.llamacpp_peer", *(() if d.llama_bench == "-" else
                                                              ("--llama-bench", str(Path(d.llama_bench).expanduser()))))
    if scale.reduced:
        peer += ("--repeats", "1", "--new-tokens", "4", "--threads", "2")
    ours = (*d.budget_flags, "--dtype", scale.dtype, "--quantize", "gguf", "--acceptance-trace", TRACE)
    tokens = ("--new-tokens", "4", "--speculative-tokens", "16", "--repeats", "1") if scale.reduced else \
        ("--new-tokens", "8", "--speculative-tokens", "32", "--repeats", "2")

    def write(arch):
        return ("-m", "triforce.bench.random_gguf", d.file(arch), "--arch", arch, "--json")

    def decode_ours(name, model, context, methods):
        argv = ("-m", "triforce.cli.main", "bench", "offload", "--model", model, "--context", str(context),
                "--methods", methods, *ours, *tokens, *scale.speculation, "--plot", str(out_dir / f"{name}.png"),
                "--json")
        return Step(name, f"ours on {Path(model).name} at {context} tokens: {methods}", Fixed(
            240, "assumed: a 128K prefill and two methods' windows"), argv, default=False, streams_rows=True)

    placement_large = f"host-kv,fit:{d.card_gib:g}"
    return [
        Step("desktop-file-small", f"{d.small} Q4_K_M with random weights written to {d.folder}",
             Fixed(20, "assumed: 4.9 GB at ~0.5 GB/s"), write(d.small), default=False),
        Step("desktop-file-large", f"{d.large} Q4_K_M with random weights written to {d.folder}",
             Fixed(50, "assumed: 19.8 GB at ~0.5 GB/s"), write(d.large), default=False),
        Step("llamacpp-small", f"llama.cpp's CUDA build on {d.small}: a {d.small_contexts[0]}-token prefill, decoding "
                               "at each depth, f16 and q8_0 KV, all on the card",
             Fixed(150, "assumed: two deep fills per KV type"),
             (*peer, "--model", small, "--depths", ",".join(map(str, d.small_contexts)), "--kv", "f16,q8_0",
              "--prefill", str(d.small_contexts[0]), "--placement", "card" if not scale.reduced else "cpu", "--json"),
             default=False),
        Step("desktop-prefill-small", f"ours on {d.small}: a {d.small_contexts[0]}-token prefill, then decoding",
             Fixed(60, "assumed"), ("-m", "triforce.bench.prefill_ttft", "--model", small, "--context",
                                    str(d.small_contexts[0]), "--acceptance-trace", TRACE, *d.budget_flags,
                                    "--dtype", scale.dtype, "--quantize", "gguf", "--json"), default=False),
        decode_ours("desktop-decode-small", small, d.small_contexts[1], "ar-offload,triforce"),
        Step("llamacpp-large", f"llama.cpp's CUDA build on {d.large} at each depth: KV on the host (-nkvo) and the "
                               f"most layers a {d.card_gib:g} GiB card holds",
             Fixed(200, "assumed: CPU attention at 64K and 128K"),
             (*peer, "--model", large, "--depths", ",".join(map(str, d.large_contexts)), "--kv", "f16",
              "--prefill", "0", "--placement", placement_large if not scale.reduced else "cpu", "--json"),
             default=False),
        decode_ours("desktop-decode-large", large, d.large_contexts[1], "ar-offload,ar-hybrid,triforce"),
    ]
