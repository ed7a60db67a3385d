"""The streaming I/O under convert/verify: range and sequential reads, background hashes, O_DIRECT writes (from staging
blocks and from a mapped source) with buffered fallback, and their threads.

Block sizes are shrunk to one page so KB-sized files cross many chunk and block boundaries.
"""

from __future__ import annotations

import ctypes
import dataclasses
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
from converter.write import blocks, budget, hashing, headers, placement, render
from converter.write.shard import write_shard


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(sequential, "BLOCK_BYTES", 4096)


def _payload(tmp_path: Path, size: int = 50_000, seed: int = 0) -> tuple[Path, bytes]:
    data = random.Random(seed).randbytes(size)
    path = tmp_path / "source.bin"
    path.write_bytes(data)
    return path, data


def test_mapped_file_returns_exact_ranges_in_blocks(tmp_path, small_blocks):
    path, data = _payload(tmp_path)
    reader = sequential.MappedFile(path)
    offset = 7
    for length in (1, 4095, 4096, 4097, 8193, 0, 12_000, 3):
        offset += 13  # gaps are skipped
        assert bytes(reader.read(offset, length)) == data[offset:offset + length]
        blocks = [bytes(b) for b in reader.blocks(offset, length)]
        assert b"".join(blocks) == data[offset:offset + length] and all(len(b) <= 4096 for b in blocks)
        offset += length
    assert bytes(reader.read(50, 10)) == data[50:60]  # any order: nothing is consumed
    reader.close()


def test_background_sha256_hashes_the_whole_file_and_names_a_changed_size(tmp_path, small_blocks):
    path, data = _payload(tmp_path)
    with sequential.BackgroundSha256(path, size=len(data)) as digest:
        assert digest.result() == hashlib.sha256(data).hexdigest()
    with sequential.BackgroundSha256(path, size=len(data) + 1) as digest:
        with pytest.raises(InputError, match=f"{path.name}: is {len(data)} bytes, {len(data) + 1} when its header"):
            digest.result()


def test_known_sha256_is_the_hub_cache_blob_name(tmp_path):
    """A snapshot file links to blobs/<sha256>; anything else is not known without reading it."""
    oid = hashlib.sha256(b"weights").hexdigest()
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / oid).write_bytes(b"weights")
    (tmp_path / "snapshots").mkdir()
    (tmp_path / "snapshots" / "model.safetensors").symlink_to(tmp_path / "blobs" / oid)
    assert sequential.known_sha256(tmp_path / "snapshots" / "model.safetensors") == oid
    (tmp_path / "blobs" / "0123abcd").write_bytes(b"a git blob: sha1-named, not LFS")
    assert sequential.known_sha256(tmp_path / "blobs" / "0123abcd") is None
    assert sequential.known_sha256(tmp_path / "blobs" / oid) == oid
    plain, _ = _payload(tmp_path)
    assert sequential.known_sha256(plain) is None


def test_read_at_reads_any_range_and_names_a_short_file(tmp_path, small_blocks):
    path, data = _payload(tmp_path, size=10_000)
    source = sequential.SourceFile(path)
    view = memoryview(bytearray(3000))
    source.read_at(5000, view)
    assert bytes(view) == data[5000:8000]
    source.read_at(0, view[:10])
    assert bytes(view[:10]) == data[:10]
    with pytest.raises(InputError, match=f"{path.name}: ended 2000 bytes early"):
        source.read_at(9_000, view)
    source.close()


def test_mapped_file_names_a_file_that_ends_early(tmp_path, small_blocks):
    path, data = _payload(tmp_path, size=10_000)
    with pytest.raises(InputError, match=f"{path.name}: ends at 10000 bytes, before the tensor at 9000\\+3000"):
        sequential.MappedFile(path).read(9_000, 3_000)


@pytest.mark.parametrize("refuse_direct", [False, True])
def test_hashing_writer_writes_every_byte_in_order(tmp_path, small_blocks, monkeypatch, refuse_direct):
    """Blocks are written by several threads at their own offsets; the file is the bytes in order."""
    monkeypatch.setattr(budget, "WRITERS", 3)
    out = tmp_path / "out.bin"
    pieces = [random.Random(i).randbytes(n) for i, n in enumerate((10, 4096, 1, 9000, 0, 4086, 12_289, 40_000))]
    refused, real = [], os.pwrite
    if refuse_direct:  # the first write fails with EINVAL, like a filesystem accepting O_DIRECT at open only
        def pwrite(fd, data, offset):
            if not refused:
                refused.append(offset)
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(fd, data, offset)
        monkeypatch.setattr(blocks.os, "pwrite", pwrite)
    source_path, source_data = _payload(tmp_path, size=9000, seed=99)
    source = sequential.SourceFile(source_path)
    with hashing.HashingWriter(out) as writer_:
        for piece in pieces:
            writer_.write(piece)
        writer_.fill_from(source, 17, 8000)  # straight from the source into the staging blocks
        writer_.finish()
    source.close()
    pieces.append(source_data[17:8017])
    assert not refuse_direct or (refused and not writer_._blocks.direct)
    expected = b"".join(pieces)
    assert out.read_bytes() == expected
    assert writer_.sha256.hexdigest() == hashlib.sha256(expected).hexdigest() and writer_.written == len(expected)


def test_a_failing_write_is_raised_and_stops_the_writers(tmp_path, small_blocks, monkeypatch):
    before = threading.active_count()

    def pwrite(fd, data, offset):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(blocks.os, "pwrite", pwrite)
    with pytest.raises(OSError, match="Input/output error"):
        with hashing.HashingWriter(tmp_path / "out.bin") as writer_:
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


def test_write_shard_copies_ranges_and_renders_the_rest(tmp_path, small_blocks):
    path, data = _payload(tmp_path)
    shard = _shard(path, [5000, 0, 16_384, 1, 9000])
    transformed = dataclasses.replace(shard.tensors[2], action="transformed", transform="reverse")
    shard = dataclasses.replace(shard, tensors=shard.tensors[:2] + (transformed,) + shard.tensors[3:])
    digest = write_shard(tmp_path / "out.safetensors", shard, metadata={},
                                sources={path: sequential.SourceFile(path)},
                                render=lambda t, raw, out, companions: memoryview(bytes(raw[::-1])), on_bytes=lambda n: None)
    written = (tmp_path / "out.safetensors").read_bytes()
    header = headers.shard_header(shard, {})
    pieces = [data[t.source.offset:t.source.offset + t.source.nbytes] for t in shard.tensors]
    pieces[2] = pieces[2][::-1]
    assert written == header + b"".join(pieces) and digest == hashlib.sha256(written).hexdigest()


def _reverse_into(tensor, raw: memoryview, out: memoryview, companions: list) -> memoryview:
    out[:] = bytes(raw)[::-1]
    return out


def test_render_buffers_are_reused_across_shards_without_stale_bytes(tmp_path, small_blocks):
    """Shards of one conversion share RenderBuffers: the second shard renders into the first one's buffers (same
    sizes), and every byte written is its own."""
    path, data = _payload(tmp_path)
    buffers = render.RenderBuffers()
    handed_out = []
    original_get = buffers.get
    buffers.get = lambda n: handed_out.append(original_get(n)) or handed_out[-1]
    for name, sizes in (("one.safetensors", [3000, 7000, 3000]), ("two.safetensors", [7000, 3000, 7000])):
        shard = _shard(path, sizes)
        shard = dataclasses.replace(shard, tensors=tuple(
            dataclasses.replace(t, action="transformed", transform="reverse") for t in shard.tensors))
        write_shard(tmp_path / name, shard, metadata={}, sources={path: sequential.SourceFile(path)},
                           render=_reverse_into, on_bytes=lambda n: None, buffers=buffers)
        pieces = [data[t.source.offset:t.source.offset + t.source.nbytes][::-1] for t in shard.tensors]
        assert (tmp_path / name).read_bytes() == headers.shard_header(shard, {}) + b"".join(pieces)
    addresses = [ctypes.addressof(ctypes.c_char.from_buffer(b)) for b in handed_out]
    assert len(set(addresses)) < len(addresses)  # some buffer was handed out twice


def test_read_errors_surface_and_no_thread_is_left(tmp_path, small_blocks):
    path, data = _payload(tmp_path, size=20_000)
    before = threading.active_count()
    with pytest.raises(InputError, match="ended .* bytes early"):
        write_shard(tmp_path / "a.safetensors", _shard(path, [15_000, 9000]), metadata={},
                           sources={path: sequential.SourceFile(path)}, render=lambda t, raw, out, companions: memoryview(bytes(raw)),
                           on_bytes=lambda n: None)
    assert threading.active_count() == before


def test_an_interrupted_shard_stops_every_thread(tmp_path, small_blocks):
    path, data = _payload(tmp_path)
    before = threading.active_count()

    def fail(n: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_shard(tmp_path / "b.safetensors", _shard(path, [40_000]), metadata={},
                           sources={path: sequential.SourceFile(path)}, render=lambda t, raw, out, companions: memoryview(bytes(raw)),
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


@pytest.mark.parametrize("copier", ["mapping", "kernel", "buffers"])
@pytest.mark.parametrize("evict", ["none", "all", "middle"])
@pytest.mark.parametrize("size", [0, 1, 4096, 50_001])
def test_copy_file_is_exact_and_hashed_once_whatever_is_cached(tmp_path, small_blocks, monkeypatch, copier, evict,
                                                                size):
    """O_DIRECT from the mapped source, else copy_file_range, else through buffers; one sha256 of the source."""
    monkeypatch.setattr(placement, "COPY_RANGE_BYTES", 8192)
    used = []
    for name in ("_copy_from_mapping", "_copy_in_kernel", "_copy_through_buffers"):
        def spy(src, destination, real=getattr(placement, name), name=name):
            done = real(src, destination)
            used.append((name, done))
            return done
        monkeypatch.setattr(placement, name, spy)
    if copier != "mapping":
        monkeypatch.setattr(placement, "open_for_writing",
                            lambda path, real=blocks.open_for_writing: real(path, direct=False))
    if copier == "buffers":
        def no_copy_range(*args):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        monkeypatch.setattr(blocks.os, "copy_file_range", no_copy_range)
    path, data = _payload(tmp_path, size=size)
    if evict != "none":
        _evict(path, *((8192 + 100, 20_000) if evict == "middle" else ()))
    digest = placement.copy_file(path, tmp_path / "copy.bin", expected_size=size)
    assert (tmp_path / "copy.bin").read_bytes() == data and digest == hashlib.sha256(data).hexdigest()
    copied_by = next(name for name, done in used if done)
    expected = {"mapping": "_copy_from_mapping", "kernel": "_copy_in_kernel", "buffers": "_copy_through_buffers"}
    if size == 0:
        assert copied_by == "_copy_in_kernel", used  # nothing to map or read: the kernel path creates the file
    elif copier != "mapping" or _direct_io_works(tmp_path):
        assert copied_by == expected[copier], used


def _direct_io_works(directory: Path) -> bool:
    try:
        os.close(os.open(directory / "probe", os.O_WRONLY | os.O_CREAT | blocks.O_DIRECT))
        return True
    except OSError:
        return False


def test_copy_from_a_source_that_shrinks_midway_is_an_input_error(tmp_path, small_blocks, monkeypatch):
    """The kernel reads the mapping for the O_DIRECT write: pages past the new end fail it with EFAULT, never a
    SIGBUS in this process."""
    path, data = _payload(tmp_path, size=200_000)
    if not _direct_io_works(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    real = placement._write_mapped

    def truncate_then_write(mapping, fd, name):
        os.truncate(path, 10_000)
        real(mapping, fd, name)
    monkeypatch.setattr(placement, "_write_mapped", truncate_then_write)
    with pytest.raises(InputError, match="source.bin: .*changed while converting"):
        placement.copy_file(path, tmp_path / "copy.bin", expected_size=len(data))


def test_copy_file_refuses_a_source_that_changed_size(tmp_path, small_blocks):
    path, data = _payload(tmp_path, size=10_000)
    with pytest.raises(InputError, match="source.bin: is 10000 bytes, 12000 when its header was read"):
        placement.copy_file(path, tmp_path / "copy.bin", expected_size=12_000)


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


@pytest.mark.parametrize("in_child", [False, True], ids=["thread", "child-interpreter"])
def test_hashing_ahead_hashes_every_file_and_names_a_changed_size(tmp_path, monkeypatch, in_child):
    """Files at least HASH_IN_CHILD_BYTES are hashed by a child interpreter (no GIL shared with the writer); both
    ways give hashlib's digest, and a file shorter than its header said is an InputError naming it."""
    monkeypatch.setattr(sequential, "HASH_IN_CHILD_BYTES", 0 if in_child else 1 << 40)
    files = {}
    for index, size in enumerate((70_000, 5, 300_000)):
        path, data = _payload(tmp_path, size, seed=index)
        files[path.rename(tmp_path / f"f{index}")] = data
    from contextlib import ExitStack
    with ExitStack() as stack:
        pending = sequential.hashing_ahead({path: len(data) for path, data in files.items()}, stack, threads=2)
        assert {path: p.result() for path, p in pending.items()} == \
            {path: hashlib.sha256(data).hexdigest() for path, data in files.items()}
    short = tmp_path / "f2"
    with ExitStack() as stack:
        pending = sequential.hashing_ahead({short: len(files[short]) + 1}, stack, threads=2)
        with pytest.raises(InputError, match=f"f2: is {len(files[short])} bytes, {len(files[short]) + 1} when"):
            pending[short].result()


def test_hashing_stopped_before_it_started_raises_instead_of_waiting(tmp_path, monkeypatch):
    monkeypatch.setattr(sequential.os, "sched_getaffinity", lambda pid: {0})  # one hashing thread
    paths = {}
    for index in range(3):
        path, data = _payload(tmp_path, 10_000, seed=index)
        paths[path.rename(tmp_path / f"g{index}")] = len(data)
    from contextlib import ExitStack
    stack = ExitStack()
    pending = sequential.hashing_ahead(paths, stack, threads=2)
    stack.close()  # stops the thread: whatever it had not started must not block result() forever
    for item in pending.values():
        try:
            item.result()
        except RuntimeError as exc:
            assert "hashing was stopped before it" in str(exc)


def test_copy_bytes_copies_writable_and_read_only_sources(tmp_path):
    target = memoryview(sequential.page_aligned_buffer(4096))
    writable = bytearray(random.Random(1).randbytes(1000))
    blocks.copy_bytes(target[10:1010], memoryview(writable))
    assert bytes(target[10:1010]) == bytes(writable) and bytes(target[:10]) == bytes(10)
    frozen = random.Random(2).randbytes(500)
    blocks.copy_bytes(target[:500], memoryview(frozen))
    assert bytes(target[:500]) == frozen
