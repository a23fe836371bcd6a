"""The daemon's own msgpack codec and frame reader against the msgpack package, and
against arbitrary bytes (property-based)."""

import struct

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from sandman_ray.daemon.sandmand.wire import (
    MAX_FRAME, CodecError, FrameReader, encode_frame, pack_native, unpack_native)

scalars = (st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 64 - 1)
           | st.floats(allow_nan=False) | st.text() | st.binary())
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=20)
    | st.dictionaries(st.text() | st.binary(), inner, max_size=20),
    max_leaves=60)


@given(values)
def test_native_pack_is_byte_identical_to_msgpack(value):
    assert pack_native(value) == msgpack.packb(value, use_bin_type=True)


@given(values)
def test_native_unpack_reads_what_msgpack_writes(value):
    assert unpack_native(msgpack.packb(value, use_bin_type=True)) == value


def test_large_sizes_use_the_wide_formats():
    for value in ("x" * 70000, b"y" * 70000, list(range(70000)), {str(i): i for i in range(70000)}):
        packed = pack_native(value)
        assert packed == msgpack.packb(value, use_bin_type=True)
        assert unpack_native(packed) == value


def test_float32_is_decoded():
    assert unpack_native(b"\xca" + struct.pack(">f", 1.5)) == 1.5


@settings(max_examples=500)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_raise_codec_error(data):
    try:
        unpack_native(data)
    except CodecError:
        pass


@pytest.mark.parametrize("data, message", [
    (b"\xdd\xff\xff\xff\xff", "count"),            # array of 4 G elements in 5 bytes
    (b"\xdf\x00\x01\x00\x00", "count"),            # map of 65536 pairs
    (b"\xc6\xff\xff\xff\xff", "truncated"),        # 4 GiB of bin announced
    (b"\xc1", "unsupported"),                      # reserved type byte
    (b"\xd4\x01\x02", "unsupported"),              # ext types are refused
    (b"\x81\x01\x02", "map key"),                  # int map key
    (b"\xa2\xff\xfe", "utf-8"),                    # invalid utf-8 in a str
    (b"\xc0\xc0", "extra data"),                   # two values in one frame
    (b"\x91" * 100 + b"\xc0", "nested"),           # nesting deeper than the limit
])
def test_hostile_values_are_refused_without_allocating(data, message):
    with pytest.raises(CodecError, match=message):
        unpack_native(data)


def test_unencodable_values_raise_codec_error():
    with pytest.raises(CodecError):
        pack_native(object())
    with pytest.raises(CodecError):
        pack_native(2 ** 64)


@given(st.lists(values, min_size=1, max_size=8), st.data())
def test_frame_reader_reassembles_any_chunking(messages, data):
    stream = b"".join(encode_frame({"v": m}) for m in messages)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    reader, frames, last = FrameReader(), [], 0
    for cut in cuts + [len(stream)]:
        frames += reader.feed(stream[last:cut])
        last = cut
    assert [unpack_native(f)["v"] for f in frames] == messages
    assert not reader.buf


def test_frame_reader_refuses_a_length_over_the_limit():
    with pytest.raises(CodecError, match="exceeds"):
        FrameReader().feed(struct.pack(">I", MAX_FRAME + 1))
    small = FrameReader(max_frame=10)
    with pytest.raises(CodecError):
        small.feed(struct.pack(">I", 11) + b"x" * 11)
