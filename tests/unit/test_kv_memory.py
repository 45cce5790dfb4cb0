"""KV caches whose memory grows with the tokens written into them and goes back when a sequence ends."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from quiver.t2t.kv_memory import CacheMemory

ROWS, HEADS, POSITIONS, HEAD_SIZE = 8, 4, 2048, 64  # 16 MiB a tensor


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc for memory")


@linux_only
def test_memory_grows_with_the_tokens_written_and_goes_back_when_rows_are_dropped() -> None:
    shape = (ROWS, HEADS, POSITIONS, HEAD_SIZE)
    before = _resident_bytes()
    memory = CacheMemory({"key": shape, "value": shape})
    assert _resident_bytes() - before < 1 << 20  # nothing is made until written: a server at rest holds no cache
    written = 0
    for array in memory.arrays.values():
        array[:, :, :512] = 1.0  # every row caches 512 tokens of 2048
        written += array[:, :, :512].nbytes
    grown = _resident_bytes() - before
    assert written <= grown <= 1.1 * written + (1 << 20)  # about the tokens' bytes, not the context's (4x more)
    memory.drop_rows(range(ROWS))
    assert _resident_bytes() - before < 1 << 20
    for array in memory.arrays.values():
        assert not array.any()  # dropped pages read as zeros


@linux_only
def test_dropping_one_row_leaves_the_others_as_they_are() -> None:
    memory = CacheMemory({"key": (ROWS, HEADS, POSITIONS, HEAD_SIZE)})
    key = memory.arrays["key"]
    key[:] = np.arange(ROWS, dtype=np.float32)[:, None, None, None] + 1
    memory.drop_rows([3])
    assert not key[3].any()
    for row in (0, 2, 4, 7):
        assert (key[row] == row + 1).all()


def test_a_forked_child_writing_its_cache_leaves_the_parents_alone() -> None:
    if not hasattr(os, "fork"):
        pytest.skip("no fork on this OS")
    memory = CacheMemory({"key": (1, 1, 1024, 64)})
    memory.arrays["key"][:] = 7.0
    pid = os.fork()
    if pid == 0:  # the child: write and leave at once
        memory.arrays["key"][:] = -1.0
        os._exit(0)
    os.waitpid(pid, 0)
    assert (memory.arrays["key"] == 7.0).all()
