"""The first-start warm-up: a child process compiles the attention kernel into numba's cache while
this process compiles the rest, only when that can help, and this process then loads it."""
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from triforce.kernels.cpu.attention import decode as cpu_attention
from triforce.kernels.cpu import warm


def _kernel_with_index(path):
    return SimpleNamespace(_cache=SimpleNamespace(_cache_file=SimpleNamespace(_index_path=str(path))))


def test_cached_reads_the_index_and_counts_the_unknown_as_cached(tmp_path):
    index = tmp_path / "k.nbi"
    assert not warm._cached(_kernel_with_index(index))
    index.write_bytes(b"")
    assert warm._cached(_kernel_with_index(index))
    assert warm._cached(object())  # numba's internals moved: keep the one-process warm-up
    cpu_attention.warm_up(torch.float32, [(3, 64)])
    compiled = Path(cpu_attention.attend_kernel(torch.float32, 64)._cache._cache_file._index_path)
    assert compiled.exists() and compiled.suffix == ".nbi"


def test_a_child_only_where_a_core_and_an_uncached_kernel_are(monkeypatch):
    monkeypatch.setattr(warm, "_cached", lambda kernel: False)
    monkeypatch.setattr(warm.numba, "get_num_threads", lambda: 2)
    assert warm._worth_a_child(torch.float32, [(3, 64)])
    assert not warm._worth_a_child(torch.float32, [(2, 16)])   # too narrow for the kernel: nothing to compile
    assert not warm._worth_a_child(torch.float64, [(3, 64)])   # no kernel for float64
    monkeypatch.setattr(warm.numba, "get_num_threads", lambda: 1)
    assert not warm._worth_a_child(torch.float32, [(3, 64)])   # one core: all here
    monkeypatch.setattr(warm.numba, "get_num_threads", lambda: 2)
    monkeypatch.setattr(warm, "_cached", lambda kernel: True)
    assert not warm._worth_a_child(torch.float32, [(3, 64)])   # cached: loading is quick


_SCRIPT = """
import torch
from triforce.kernels.cpu.attention import decode as cpu_attention
from triforce.kernels.cpu import layer as cpu_layer
from triforce.kernels.cpu.linear import dense as cpu_linear
from triforce.kernels.cpu import warm
cpu_linear.warm_up = cpu_layer.warm_up = lambda dtype: None  # the attention kernel alone: the child's part
kernel = cpu_attention.attend_kernel(torch.float32, 64)
print(warm._worth_a_child(torch.float32, [(3, 64)]))
warm.warm_up(torch.float32, [(3, 64)])
print(sum(kernel.stats.cache_hits.values()), sum(kernel.stats.cache_misses.values()))
"""


def test_the_child_compiles_into_the_cache_and_this_process_loads_it(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), NUMBA_NUM_THREADS="2")
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "1", "0"]  # a child was due; the kernel came from the cache


def test_a_first_start_says_what_it_compiles_and_a_later_one_says_nothing(monkeypatch):
    for module in (warm.dense, warm.layer):
        monkeypatch.setattr(module, "warm_up", lambda dtype: None)
    monkeypatch.setattr(warm.decode, "warm_up", lambda dtype, shapes: None)
    monkeypatch.setattr(warm, "_attention_child", lambda dtype, shapes: None)
    told = []
    monkeypatch.setattr(warm, "_cached", lambda kernel: False)
    warm.warm_up(torch.float32, [(3, 64)], told.append)
    assert told[0].startswith("compiling the CPU kernels for float32 (once per machine and version")
    assert [line.split(":")[0].strip() for line in told[1:]] == ["1/3 linear", "2/3 layer halves", "3/3 attention"]
    told.clear()
    blocks = []
    warm.warm_up(torch.float32, [(3, 64)], told.append, blocks=lambda: blocks.append(1))
    assert [line.split(":")[0].strip() for line in told[1:]] == ["1/4 linear", "2/4 layer halves", "3/4 block weights",
                                                                 "4/4 attention"] and blocks == [1]
    told.clear()
    monkeypatch.setattr(warm, "_cached", lambda kernel: True)
    warm.warm_up(torch.float32, [(3, 64)], told.append, blocks=lambda: blocks.append(2))
    assert told == [] and blocks == [1, 2]  # compiled or loaded all the same, said only when fresh
