"""The 2026 desktop's steps of the GPU campaign (issue 72), the default call's journey: random-weight
Q4_K_M files of a model whose 128K KV fits a 24 GB card (Llama-3.1-8B) and one whose KV must live
on the host (Qwen3-32B), ours beside llama.cpp's CUDA build (bench/build_llamacpp_cuda.sh) on the
same file, then DeepSpeed ZeRO-Inference beside our offloaded rows (deepspeed_peer.py).

Every estimate here is assumed until a card runs it: a lease holds one 128K fill per llama.cpp test
and one 128K prefill of ours (the 8B's TTFT); decode rows of ours replay the trace on random KV
(`bench offload` with --acceptance-trace), and llama.cpp with its KV on the host is timed at
shallow depths and extrapolated (its CPU attention would take hours to fill 128K)."""
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
    shallow_depths: tuple[int, int] = (512, 2048)  # llama.cpp with host KV: measured here, extrapolated deeper
    deepspeed_contexts: tuple[int, ...] = (4096, 8192, 16384)
    card_gib: float = 22.3             # what a 4090 driving a display leaves to PyTorch
    llama_bench: str = "-"             # "-": the carried CUDA build (llamacpp_peer's default)
    budget_flags: tuple[str, ...] = ("--profile", "rtx4090-24g-display")  # 22.3 GiB to PyTorch

    def file(self, arch: str) -> str:
        return f"{self.folder}/{arch}-q4_k_m.gguf"


DESKTOP = Desktop("/tmp/triforce-desktop")
# on a CPU: a llama file and a Qwen3 block (64-wide heads) of a few MB, llama.cpp's CPU build where it is
REDUCED_DESKTOP = Desktop("/tmp/triforce-desktop-reduced", "llama-68m", "qwen3-tiny-test", (512, 1000), (512, 1000),
                          (128, 256), (256, 512), 0.5, "~/.cache/llamacpp/bin/llama-bench",
                          ("--device-budget", "120MB"))


def desktop_steps(scale, out_dir) -> list[Step]:
    """The journey's steps in order (default), then what a second call adds (--only NAMES)."""
    d = scale.desktop
    small, large = d.file(d.small), d.file(d.large)
    short, long = d.small_contexts
    peer = ("-m", "triforce.bench.campaign.llamacpp_peer", *(() if d.llama_bench == "-" else
                                                              ("--llama-bench", str(Path(d.llama_bench).expanduser()))))
    if scale.reduced:
        peer += ("--repeats", "1", "--new-tokens", "4", "--threads", "2")
    on_card = "card" if not scale.reduced else "cpu"
    ours = (*d.budget_flags, "--dtype", scale.dtype, "--quantize", "gguf", "--acceptance-trace", TRACE)
    tokens = ("--new-tokens", "4", "--speculative-tokens", "16", "--repeats", "1") if scale.reduced else \
        ("--new-tokens", "8", "--speculative-tokens", "32", "--repeats", "2")

    def write(arch, seconds, source, default=True):
        return Step(f"desktop-file-{'small' if arch == d.small else 'large'}",
                    f"{arch} Q4_K_M with random weights written to {d.folder}", Fixed(seconds, source),
                    ("-m", "triforce.bench.random_gguf", d.file(arch), "--arch", arch, "--json"), default)

    def prefill(name, context, seconds, default):
        return Step(name, f"ours on {d.small}: a {context}-token prefill (time to first token), then decoding",
                    Fixed(seconds, "assumed: start 8, the file to the card 5, the prefill at 0.4 of the tensor "
                                   "cores, first tokens"),
                    ("-m", "triforce.bench.prefill_ttft", "--model", small, "--context", str(context),
                     "--acceptance-trace", TRACE, *d.budget_flags, "--dtype", scale.dtype, "--quantize", "gguf",
                     "--json"), default)

    def decode_ours(name, model, context, methods, seconds, source, default=True):
        argv = ("-m", "triforce.cli.main", "bench", "offload", "--model", model, "--context", str(context),
                "--methods", methods, *ours, *tokens, *scale.speculation, "--plot", str(out_dir / f"{name}.png"),
                "--json")
        return Step(name, f"ours on {Path(model).name} at {context} tokens (random KV, the trace replayed): "
                          f"{methods}", Fixed(seconds, source), argv, default=default, streams_rows=True)

    shallow = ",".join(map(str, d.shallow_depths))
    deep = ",".join(map(str, d.large_contexts))
    return [
        write(d.small, 15, "measured: 13.7 s for 4.9 GB on a 2-core Xeon, 2026-11-29"),
        Step("llamacpp-small", f"llama.cpp's CUDA build on {d.small}, all on the card, f16 KV: {short}- and "
                               f"{long}-token prefills, decoding at each depth",
             Fixed(85, "assumed: two fills at each depth, 128K at ~4K tokens/s"),
             (*peer, "--model", small, "--depths", f"{short},{long}", "--kv", "f16", "--prefill", f"{short},{long}",
              "--placement", on_card, "--json")),
        prefill("desktop-prefill-small", long, 35, True),
        decode_ours("desktop-decode-small", small, long, "ar-offload,triforce", 35,
                    "assumed: start 8, the file 5, KV filled on the card, two methods' windows"),
        write(d.large, 55, "measured: 4.9 GB in 13.7 s on a 2-core Xeon, 2026-11-29, scaled to 19.8 GB"),
        Step("llamacpp-large", f"llama.cpp's CUDA build on {d.large} with its KV on the host (-nkvo): decoding at "
                               f"{shallow} tokens, extrapolated to {deep}",
             Fixed(40, "assumed: the file to the card 10, CPU attention fills of 2K tokens"),
             (*peer, "--model", large, "--depths", shallow, "--extrapolate", deep, "--kv", "f16", "--prefill", "0",
              "--placement", "host-kv" if not scale.reduced else "cpu", "--json")),
        decode_ours("desktop-decode-large", large, d.large_contexts[1], "ar-offload,triforce", 65,
                    "assumed: start 8, the file 15, host KV stored 11, ar ~0.7 s a token, triforce ~0.13"),
        Step("deepspeed", "DeepSpeed ZeRO-Inference (KV offload, its fork of transformers) on random Llama-2-7B "
                          f"weights at {','.join(map(str, d.deepspeed_contexts))} tokens, our ar-offload and "
                          "triforce beside it where it ran",
             Fixed(60, "assumed: its start and 7B made on the card 20, each length's prefill and tokens, ours 20 a "
                       "length"),
             ("-m", "triforce.bench.campaign.deepspeed_peer", "--contexts", ",".join(map(str, d.deepspeed_contexts)),
              "--arch", "llama2-7b-128k" if not scale.reduced else "tiny-test", "--ours", "ar-offload,triforce",
              *(("--reduced",) if scale.reduced else ()), "--json")),
        # a second call (--only): the rest of issue 72's journey
        Step("llamacpp-small-q8", f"llama.cpp's CUDA build on {d.small}, all on the card, q8_0 KV: decoding at "
                                  f"{short} and {long}",
             Fixed(80, "assumed: a fill at each depth"),
             (*peer, "--model", small, "--depths", f"{short},{long}", "--kv", "q8_0", "--prefill", "0",
              "--placement", on_card, "--json"), default=False),
        prefill("desktop-prefill-small-32k", short, 20, False),
        decode_ours("desktop-decode-small-32k", small, short, "ar-offload,triforce", 30,
                    "assumed: start 8, the file 5, two methods' windows", default=False),
        Step("llamacpp-large-fit", f"llama.cpp's CUDA build on {d.large}: the most layers a {d.card_gib:g} GiB "
                                   f"card holds with their KV at {d.large_contexts[1]}, decoding at {shallow}, "
                                   f"extrapolated to {deep}",
             Fixed(60, "assumed: the file 10, fills with most layers' attention on the CPU"),
             (*peer, "--model", large, "--depths", shallow, "--extrapolate", deep, "--kv", "f16", "--prefill", "0",
              "--placement", f"fit:{d.card_gib:g}" if not scale.reduced else "cpu", "--json"), default=False),
        decode_ours("desktop-decode-large-64k", large, d.large_contexts[0], "ar-offload,ar-hybrid,triforce", 70,
                    "assumed: start 8, the file 15, host KV 5, three methods' windows", default=False),
    ]
