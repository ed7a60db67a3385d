"""Issue 7: fuzz the readers of untrusted bytes. Whatever a safetensors file, an index or a config.json holds,
reading it ends in a result or an InputError (a one-line message naming the file), never another exception.

Bounded: fixed max_examples, deadline=None, derandomized so a run is repeatable; the whole module takes a
few seconds. Explicit @example rows keep the inputs that once broke a reader.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from _helpers_robustness import pack_safetensors, small_preset
from converter.errors import InputError
from converter.gemma4 import read_spec
from converter.read.checkpoint import INDEX_NAME, read_checkpoint
from converter.read.safetensors_header import DTYPES, read_header
from matrix.synthetic import assistant_config, target_config

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


# ---------------------------------------------------------------------------------------------- strategies

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)

small_ints = st.integers(-4, 70)
dtypes = st.one_of(st.sampled_from(sorted(DTYPES)), st.sampled_from(["C64", "F4", "bf16", ""]), json_values)
shapes = st.one_of(st.lists(st.integers(0, 6), max_size=3), st.lists(st.one_of(small_ints, json_scalars),
                                                                     max_size=3), json_values)
offsets = st.one_of(st.lists(small_ints, min_size=2, max_size=2), st.lists(small_ints, max_size=3), json_values)
entries = st.one_of(st.fixed_dictionaries({"dtype": dtypes, "shape": shapes, "data_offsets": offsets}),
                    st.fixed_dictionaries({"dtype": st.sampled_from(["U8", "BF16", "F32"]),
                                           "shape": st.lists(st.integers(0, 4), max_size=2),
                                           "data_offsets": st.lists(st.integers(0, 40), min_size=2, max_size=2)
                                           .map(sorted)}),
                    json_values)
headers = st.dictionaries(st.one_of(st.text(max_size=6), st.just("__metadata__")),
                          st.one_of(entries, st.dictionaries(st.text(max_size=4), json_values, max_size=3)),
                          max_size=5)


@st.composite
def safetensors_files(draw) -> bytes:
    """Mostly plausible files: a JSON header (true or lying length prefix, padding) and a data region."""
    raw = json.dumps(draw(headers)).encode() + b" " * draw(st.integers(0, 7))
    length = draw(st.one_of(st.just(len(raw)), st.just(len(raw)), st.integers(0, 2**64 - 1),
                            st.integers(max(len(raw) - 4, 0), len(raw) + 4)))
    data = draw(st.binary(max_size=64))
    return pack_safetensors(raw, data, length=length)[:draw(st.one_of(st.none(), st.integers(0, 80)))]


# ---------------------------------------------------------------------------------------------- headers

def _read(path: Path, blob: bytes):
    path.write_bytes(blob)
    try:
        return read_header(path)
    except InputError as exc:
        assert str(path) in str(exc) and "\n" not in str(exc)
        return None


def _check_result(header, blob: bytes) -> None:
    """What a header the reader accepts must guarantee: every tensor inside the file, none overlapping."""
    if header is None:
        return
    end = header.data_start
    for ref in header.tensors:
        assert ref.offset >= end and ref.offset + ref.nbytes <= len(blob)
        count = 1
        for dim in ref.shape:
            count *= dim
        assert ref.nbytes == count * DTYPES[ref.dtype][1]
        end = ref.offset + ref.nbytes
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in header.metadata.items())


@FUZZ
@given(blob=st.binary(max_size=96))
@example(blob=struct.pack("<Q", 2**63) + b"{}")
@example(blob=struct.pack("<Q", 6) + b'{"a":1')
def test_random_bytes(scratch: Path, blob: bytes) -> None:
    _check_result(_read(scratch / "random.safetensors", blob), blob)


@FUZZ
@given(blob=safetensors_files())
@example(blob=pack_safetensors(b"[" * 50_000 + b"]" * 50_000))  # deep nesting: RecursionError inside json
@example(blob=pack_safetensors(b'{"t": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1' + b"0" * 5000 + b"]}}"))
@example(blob=pack_safetensors(b'{"t": {"dtype": ["U8"], "shape": [1], "data_offsets": [0, 1]}}', b"\x00"))
@example(blob=pack_safetensors(b'{"__metadata__": {"format": 1}}'))
@example(blob=pack_safetensors(b'{"__metadata__": [], "t": {"dtype": "U8", "shape": [], "data_offsets": [0, 1]}}',
                               b"\x00"))
def test_hostile_headers(scratch: Path, blob: bytes) -> None:
    _check_result(_read(scratch / "hostile.safetensors", blob), blob)


# ---------------------------------------------------------------------------------------------- index

def _tensor_file(names: list[str]) -> bytes:
    header = {name: {"dtype": "U8", "shape": [2], "data_offsets": [2 * i, 2 * i + 2]} for i, name in enumerate(names)}
    return pack_safetensors(header, bytes(2 * len(names)))


@pytest.fixture(scope="module")
def indexed_dir(scratch: Path) -> Path:
    """config.json + two tiny shards; each example writes its own index next to them."""
    root = scratch / "indexed"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(target_config(small_preset(), dialect="legacy", multimodal=False)))
    (root / "a.safetensors").write_bytes(_tensor_file(["x", "y"]))
    (root / "b.safetensors").write_bytes(_tensor_file(["z"]))
    return root


VALID_MAP = {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"}
shard_names = st.one_of(st.sampled_from(["a.safetensors", "b.safetensors", "c.safetensors", "", ".", "..",
                                         "../a.safetensors", "/etc/passwd", "a.safetensors/", "sub/a.safetensors",
                                         "a\x00.safetensors"]), st.text(max_size=8), json_scalars)
weight_maps = st.one_of(
    st.dictionaries(st.sampled_from(["x", "y", "z", "w", ""]), shard_names, max_size=5),
    st.builds(lambda extra: {**VALID_MAP, **extra}, st.dictionaries(st.text(max_size=3), shard_names, max_size=2)),
    json_values)
indexes = st.one_of(st.fixed_dictionaries({"metadata": json_values, "weight_map": weight_maps}),
                    st.fixed_dictionaries({"weight_map": weight_maps}), json_values)


@FUZZ
@given(index=indexes, raw=st.one_of(st.none(), st.binary(max_size=40)))
@example(index={"weight_map": VALID_MAP}, raw=None)
@example(index={"weight_map": {**VALID_MAP, "x": "a\x00.safetensors"}}, raw=None)
@example(index=None, raw=b"\xff\xfe")
def test_index(indexed_dir: Path, index, raw: bytes | None) -> None:
    path = indexed_dir / INDEX_NAME
    path.write_bytes(raw if raw is not None else json.dumps(index).encode())
    try:
        checkpoint = read_checkpoint(indexed_dir)
    except InputError as exc:
        assert "\n" not in str(exc)
        return
    assert checkpoint.indexed and set(checkpoint.tensors) == {"x", "y", "z"}


# ---------------------------------------------------------------------------------------------- config

def _paths(document, prefix=()):
    """Every (key path) into nested dicts of a config, so one value can be replaced."""
    if isinstance(document, dict):
        for key, value in document.items():
            yield (*prefix, key)
            yield from _paths(value, (*prefix, key))


BASES = [target_config(small_preset(), dialect="legacy", multimodal=True),
         target_config(small_preset(), dialect="per_layer_config", multimodal=False),
         assistant_config(small_preset(), dialect="both")]


@st.composite
def mutated_configs(draw) -> dict:
    """A real config with one to three values replaced by arbitrary JSON (or deleted)."""
    config = json.loads(json.dumps(draw(st.sampled_from(BASES))))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(sorted(_paths(config), key=str)))
        parent = config
        for key in path[:-1]:
            parent = parent[key]
        if not isinstance(parent, dict) or path[-1] not in parent:
            continue
        if draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(json_values)
    return config


@FUZZ
@given(config=st.one_of(mutated_configs(), st.dictionaries(st.text(max_size=8), json_values, max_size=4)))
@example(config={**BASES[0], "text_config": {**BASES[0]["text_config"], "layer_types": [1, "x"]}})
@example(config={**BASES[0], "text_config": {**BASES[0]["text_config"], "layer_types": [{}]}})
@example(config={**BASES[0], "quantization_config": ["fp8"]})
@example(config={**BASES[1], "per_layer_config": {"5": {"head_dim": "8"}}})
@example(config={**BASES[1], "num_kv_shared_layers": "two"})
def test_config(config: dict) -> None:
    try:
        spec = read_spec(config, source="config.json")
    except InputError as exc:
        assert str(exc).startswith("config.json: ") and "\n" not in str(exc)
        return
    attention = spec.attention
    for layer in attention.layers:
        assert isinstance(layer.head_dim, int) and layer.head_dim > 0
        assert isinstance(layer.num_kv_heads, int) and layer.num_kv_heads > 0
    assert 0 <= attention.num_kv_shared_layers <= len(attention.layer_types)
    assert spec.quantization is None or isinstance(spec.quantization, dict)
