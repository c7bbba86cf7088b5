"""Compile the CPU decoding kernels before the first token, on two cores where a first start has them.

Why: numba compiles on one core, and a first start (an empty kernel cache) compiles three groups
one after the other: the small-rows linear kernels, the attention kernel and the layer halves
(4.5, 7.9 and 5.1 s on a 2-core Zen 3: bench/history/2026-11-24-25-cpu-vs-llamacpp-avx2.md).
Here, when the attention kernel is not in numba's cache yet and a second core is free, a child process compiles it (into the same
cache) while this one compiles the other two; this process then loads it from the cache. If the
child fails, the kernel is compiled here as before: the child only saves time, it never decides
what runs. With the kernels cached, or on one core, everything happens here, as before.

    python -m triforce.kernels.cpu.warm float32 3x64 [...]   (the child: dtype, then KV heads x head dim)"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numba
import torch

from triforce.kernels.cpu import distribution, draw, greedy, gumbel_max, layer, penalties
from triforce.kernels.cpu.attention import decode
from triforce.kernels.cpu.linear import dense

CHILD_TIMEOUT_S = 600  # far above a compile's seconds: a hung child must not hang a start


def fresh(dtype: torch.dtype, kv_shapes) -> bool:
    """Whether warm_up would compile (a first start) rather than load the kernels from numba's cache."""
    return not _attention_cached(dtype, kv_shapes)


def warm_up(dtype: torch.dtype, kv_shapes, say=None, blocks=None, run_step=None) -> None:
    """Compile (or load) every CPU decoding kernel `dtype` runs for models of these
    (KV heads, head dim). say(line): told of each group as it is compiled, on a first start only
    (a start with the kernels cached loads them in about a second and says nothing).
    blocks(): a block-quantized model's kernels (a group of their own, compiled while the child
    still compiles attention). run_step(name, work): runs each group on a first start instead of
    the timing that says its time after it (a terminal names it as it starts: app.start_steps)."""
    fresh_start = fresh(dtype, kv_shapes)
    tell = say if say is not None and fresh_start else (lambda line: None)
    groups = 3 + (blocks is not None)
    tell(f"compiling the CPU kernels for {str(dtype).removeprefix('torch.')} (once per machine and version: "
         "later starts load them)")
    child = _attention_child(dtype, kv_shapes) if fresh_start and _worth_a_child(dtype, kv_shapes) else None
    timed = (lambda name, step: run_step(f"  {name}", step)) if run_step is not None and fresh_start \
        else (lambda name, step: _timed(tell, name, step))
    timed(f"1/{groups} linear", lambda: dense.warm_up(dtype))
    timed(f"2/{groups} layer halves", lambda: (layer.warm_up(dtype), greedy.warm_up(), draw.warm_up(),
                                               distribution.warm_up(), penalties.warm_up(), gumbel_max.warm_up()))

    def attention():
        if child is not None:
            try:
                child.wait(timeout=CHILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:  # never seen: compiled here below all the same
                child.kill()
                child.wait()
        decode.warm_up(dtype, kv_shapes)  # loads what the child compiled (compiles what it did not)

    if blocks is not None:
        timed(f"3/{groups} block weights", blocks)
    timed(f"{groups}/{groups} attention{' (the rest of its compile beside)' if child else ''}", attention)


def _timed(tell, name: str, step) -> None:
    started = time.perf_counter()
    step()
    tell(f"  {name}: {time.perf_counter() - started:.1f} s")


def _worth_a_child(dtype: torch.dtype, kv_shapes) -> bool:
    """A second core is this process's (numba's threads: ranks of a tensor-parallel run share the
    cores), and some attention kernel these models take is not in numba's cache."""
    return numba.get_num_threads() >= 2 and not _attention_cached(dtype, kv_shapes)


def _attention_cached(dtype: torch.dtype, kv_shapes) -> bool:
    """Whether every attention kernel these models take is in numba's cache (the three groups are
    compiled together, so this one stands for all)."""
    kernels = [decode.attend_kernel(dtype, dim) for dim in decode.taken_dims(dtype, kv_shapes)]
    return all(_cached(kernel) for kernel in kernels)


def _cached(kernel) -> bool:
    """Whether numba's cache holds an index for `kernel` (some signature of it compiled before).
    numba has no public call for this: its cache's index path, read defensively (unknown counts as
    cached, which keeps the one-process warm-up)."""
    try:
        return Path(kernel._cache._cache_file._index_path).exists()
    except (AttributeError, TypeError):
        return True


def _attention_child(dtype: torch.dtype, kv_shapes) -> subprocess.Popen | None:
    shapes = [f"{heads}x{dim}" for heads, dim in kv_shapes]
    try:
        return subprocess.Popen([sys.executable, "-m", "triforce.kernels.cpu.warm", str(dtype).removeprefix("torch."),
                                 *shapes], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    except OSError:
        return None


if __name__ == "__main__":
    decode.warm_up(getattr(torch, sys.argv[1]),
                          [tuple(int(n) for n in shape.split("x")) for shape in sys.argv[2:]])
