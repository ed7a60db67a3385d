"""The streaming I/O under convert/verify: sequential reads, O_DIRECT writes with buffered fallback, the read-ahead thread.

Block sizes are shrunk to one page so KB-sized files cross many chunk and block boundaries.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import threading
from pathlib import Path

import pytest

from converter.errors import InputError
from converter.plan import ShardPlan, SourceSlice, TensorPlan
from converter.read import sequential
from converter.read.safetensors_header import TensorRef
from converter.write import writer


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(writer, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(sequential, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(sequential, "READ_CHUNK_BYTES", 8192)
    monkeypatch.setattr(writer, "PREFETCH_BLOCKS", 2)


def _payload(tmp_path: Path, size: int = 50_000, seed: int = 0) -> tuple[Path, bytes]:
    data = random.Random(seed).randbytes(size)
    path = tmp_path / "source.bin"
    path.write_bytes(data)
    return path, data


def test_reader_returns_exact_ranges_and_hashes_the_whole_file(tmp_path, small_blocks):
    path, data = _payload(tmp_path)
    reader = sequential.SequentialReader(path)
    offset = 7
    for length in (1, 4095, 4096, 4097, 8193, 0, 12_000, 3):
        offset += 13  # gaps are skipped but still hashed
        assert bytes(reader.read(offset, length)) == data[offset:offset + length]
        offset += length
    view = sequential.page_aligned_buffer(5000)
    reader.fill(offset, view)
    assert bytes(view) == data[offset:offset + 5000]
    assert reader.finish() == hashlib.sha256(data).hexdigest()


def test_reader_range_blocks_and_out_of_order_read(tmp_path, small_blocks):
    path, data = _payload(tmp_path)
    reader = sequential.SequentialReader(path)
    assert b"".join(bytes(b) for b in reader.range_blocks(100, 20_000)) == data[100:20_100]
    with pytest.raises(RuntimeError, match="not in source order"):
        reader.read(50, 10)


def test_reader_names_a_file_that_ends_early(tmp_path, small_blocks):
    path, data = _payload(tmp_path, size=10_000)
    with pytest.raises(InputError, match=f"{path.name}: ended 2000 bytes early"):
        sequential.SequentialReader(path).read(9_000, 3_000)


@pytest.mark.parametrize("refuse_direct", [False, True])
def test_hashing_writer_writes_every_byte_in_order(tmp_path, small_blocks, monkeypatch, refuse_direct):
    """Blocks are written by several threads at their own offsets; the file is the bytes in order."""
    monkeypatch.setattr(writer, "WRITERS", 3)
    out = tmp_path / "out.bin"
    pieces = [random.Random(i).randbytes(n) for i, n in enumerate((10, 4096, 1, 9000, 0, 4086, 12_289, 40_000))]
    refused, real = [], os.pwrite
    if refuse_direct:  # the first write fails with EINVAL, like a filesystem accepting O_DIRECT at open only
        def pwrite(fd, data, offset):
            if not refused:
                refused.append(offset)
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(fd, data, offset)
        monkeypatch.setattr(writer.os, "pwrite", pwrite)
    with writer._HashingWriter(out) as writer_:
        for piece in pieces:
            writer_.write(piece)
        writer_.finish()
    assert not refuse_direct or (refused and not writer_._direct)
    expected = b"".join(pieces)
    assert out.read_bytes() == expected
    assert writer_.sha256.hexdigest() == hashlib.sha256(expected).hexdigest() and writer_.written == len(expected)


def test_a_failing_write_is_raised_and_stops_the_writers(tmp_path, small_blocks, monkeypatch):
    before = threading.active_count()

    def pwrite(fd, data, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(writer.os, "pwrite", pwrite)
    with pytest.raises(OSError, match="Input/output error"):
        with writer._HashingWriter(tmp_path / "out.bin") as writer_:
            for _ in range(20):
                writer_.write(b"x" * 4096)
            writer_.finish()
    assert threading.active_count() == before


def _shard(path: Path, sizes: list[int]) -> ShardPlan:
    tensors, offset = [], 0
    for i, size in enumerate(sizes):
        ref = TensorRef(name=f"t{i}", dtype="U8", shape=(size,), file=path, offset=offset, nbytes=size)
        tensors.append(TensorPlan(name=ref.name, dtype="U8", shape=(size,), source=SourceSlice.whole(ref),
                                  action="kept"))
        offset += size + 3
    return ShardPlan("out.safetensors", tuple(tensors))


def test_write_shard_streams_copies_through_the_read_ahead_thread(tmp_path, small_blocks):
    path, data = _payload(tmp_path)
    shard = _shard(path, [5000, 0, 16_384, 1, 9000])
    readers = {path: sequential.SequentialReader(path)}
    digest = writer.write_shard(tmp_path / "out.safetensors", shard, metadata={}, readers=readers,
                                render=lambda t, raw: memoryview(raw), on_bytes=lambda n: None)
    written = (tmp_path / "out.safetensors").read_bytes()
    header = writer.shard_header(shard, {})
    body = b"".join(data[t.source.offset:t.source.offset + t.source.nbytes] for t in shard.tensors)
    assert written == header + body and digest == hashlib.sha256(written).hexdigest()
    assert readers[path].finish() == hashlib.sha256(data).hexdigest()


def test_read_ahead_errors_surface_and_no_thread_is_left(tmp_path, small_blocks):
    path, data = _payload(tmp_path, size=20_000)
    before = threading.active_count()
    with pytest.raises(InputError, match="ended .* bytes early"):
        writer.write_shard(tmp_path / "a.safetensors", _shard(path, [15_000, 9000]), metadata={},
                           readers={path: sequential.SequentialReader(path)}, render=lambda t, raw: memoryview(raw),
                           on_bytes=lambda n: None)
    assert threading.active_count() == before


def test_a_failing_writer_stops_the_read_ahead_thread(tmp_path, small_blocks):
    path, data = _payload(tmp_path)
    before = threading.active_count()

    def fail(n: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        writer.write_shard(tmp_path / "b.safetensors", _shard(path, [40_000]), metadata={},
                           readers={path: sequential.SequentialReader(path)}, render=lambda t, raw: memoryview(raw),
                           on_bytes=fail)
    assert threading.active_count() == before


def _evict(path: Path, start: int = 0, length: int = 0) -> None:
    """Asks the kernel to drop the file's cached pages (after fsync, clean pages go), so reads go to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("copier", ["kernel", "buffers"])
@pytest.mark.parametrize("evict", ["none", "all", "middle"])
@pytest.mark.parametrize("size", [0, 1, 4096, 50_001])
def test_copy_file_is_exact_and_hashed_once_whatever_is_cached(tmp_path, small_blocks, monkeypatch, copier, evict,
                                                                size):
    """copy_file_range where the kernel has it (else through buffers: cached pages read from the page cache, the
    rest with O_DIRECT from the next block boundary); either way one sha256 of the source."""
    monkeypatch.setattr(writer, "COPY_RANGE_BYTES", 8192)
    if copier == "buffers":
        def no_copy_range(*args):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        monkeypatch.setattr(writer.os, "copy_file_range", no_copy_range)
    path, data = _payload(tmp_path, size=size)
    if evict != "none":
        _evict(path, *((8192 + 100, 20_000) if evict == "middle" else ()))
    digest = writer.copy_file(path, tmp_path / "copy.bin", expected_size=size)
    assert (tmp_path / "copy.bin").read_bytes() == data and digest == hashlib.sha256(data).hexdigest()


def test_copy_file_refuses_a_source_that_changed_size(tmp_path, small_blocks):
    path, data = _payload(tmp_path, size=10_000)
    with pytest.raises(InputError, match="source.bin: is 10000 bytes, 12000 when its header was read"):
        writer.copy_file(path, tmp_path / "copy.bin", expected_size=12_000)


def test_source_file_reads_every_byte_when_part_of_it_is_cached(tmp_path, small_blocks):
    path, data = _payload(tmp_path, size=100_003)
    _evict(path, 30_000, 40_000)
    source = sequential.SourceFile(path)
    buffer = sequential.page_aligned_buffer(8192)
    got = bytearray()
    while count := source.readinto(buffer):
        got += buffer[:count]
    source.close()
    assert bytes(got) == data
