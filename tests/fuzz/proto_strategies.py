"""Hypothesis strategies for any protobuf message, built from its descriptor alone, so the
gRPC fuzzer follows the .proto files as they change without a strategy written per message.

`messages(descriptor)` walks `Descriptor.fields` and draws well-typed but arbitrary values:
integers over the field's whole range (its edges drawn often), floats with nan / ±inf /
subnormals, strings empty / odd code points / huge, bytes, open enums (unknown numbers too),
bounded repeated fields, nested messages to a bounded depth, and fields with presence
(`optional`, messages) set or unset. `overrides` replaces the strategy of named fields
(dotted paths: "sampling.max_tokens") where a test needs values that reach further in.

`wire_bytes(descriptor, valid)` is for a raw-bytes serializer: random bytes, a valid message's
serialization mutated (bit flips, truncation, splices, duplicated spans), or hand-built wire
records (any field number and wire type, overlong varints, lengths past the end)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

T = FieldDescriptor
INT_RANGES: dict[int, tuple[int, int]] = {
    T.TYPE_INT32: (-(2**31), 2**31 - 1),
    T.TYPE_SINT32: (-(2**31), 2**31 - 1),
    T.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    T.TYPE_INT64: (-(2**63), 2**63 - 1),
    T.TYPE_SINT64: (-(2**63), 2**63 - 1),
    T.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    T.TYPE_UINT32: (0, 2**32 - 1),
    T.TYPE_FIXED32: (0, 2**32 - 1),
    T.TYPE_UINT64: (0, 2**64 - 1),
    T.TYPE_FIXED64: (0, 2**64 - 1),
}
HUGE_CHARS = 300_000  # past every prompt-size limit (and a 1 MiB message once repeated)


def integers(lo: int, hi: int) -> st.SearchStrategy[int]:
    """The whole range, with its edges and the small numbers near 0 drawn often."""
    edges = sorted({lo, hi, max(lo, min(hi, 0)), max(lo, min(hi, 1)), max(lo, min(hi, -1))})
    return st.one_of(
        st.sampled_from(edges),
        st.integers(max(lo, -300), min(hi, 300)),
        st.integers(lo, hi),
    )


def floats(width: int) -> st.SearchStrategy[float]:
    special = [0.0, -0.0, 1.0, -1.0, 1e-45, 1e-38, 3.4e38, float("inf"), -float("inf")]
    return st.one_of(
        st.sampled_from(special),
        st.just(float("nan")),
        st.floats(width=width, allow_nan=True, allow_infinity=True, allow_subnormal=True),
    )


def texts(max_size: int = 64) -> st.SearchStrategy[str]:
    """Strings protobuf accepts (valid UTF-8): empty, short arbitrary, NUL / control /
    combining / private-use / astral characters, replacement characters where invalid
    bytes once were, and huge repetitions."""
    odd = st.sampled_from(["\x00", "\ufffd", "\u202e", "\u0301", "\U0010ffff", "\ue000", "\n"])
    return st.one_of(
        st.just(""),
        st.text(max_size=max_size),
        st.lists(st.one_of(odd, st.characters(codec="utf-8")), max_size=max_size).map("".join),
        st.builds(
            lambda c, n: c * n,
            st.sampled_from(["a", "\U0001f600", " ", "<"]),
            st.integers(1_000, HUGE_CHARS),
        ),
    )


def binaries(max_size: int = 64) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.just(b""),
        st.binary(max_size=max_size),
        st.builds(lambda n: b"\xff" * n, st.integers(1_000, 70_000)),
    )


def scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    if field.type in INT_RANGES:
        return integers(*INT_RANGES[field.type])
    if field.type == T.TYPE_BOOL:
        return st.booleans()
    if field.type == T.TYPE_FLOAT:
        return floats(32)
    if field.type == T.TYPE_DOUBLE:
        return floats(64)
    if field.type == T.TYPE_STRING:
        return texts()
    if field.type == T.TYPE_BYTES:
        return binaries()
    if field.type == T.TYPE_ENUM:  # proto3 enums are open: unknown numbers are legal
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), integers(-(2**31), 2**31 - 1))
    raise TypeError(f"{field.full_name}: no strategy for field type {field.type}")


def messages(
    descriptor: Descriptor,
    overrides: Mapping[str, st.SearchStrategy[Any]] | None = None,
    max_repeated: int = 8,
    max_depth: int = 3,
) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`'s type with every field drawn as the module says."""
    return _messages(descriptor, dict(overrides or {}), "", max_repeated, max_depth)


def _messages(
    descriptor: Descriptor,
    overrides: dict[str, st.SearchStrategy[Any]],
    prefix: str,
    max_repeated: int,
    depth: int,
) -> st.SearchStrategy[Message]:
    cls = GetMessageClass(descriptor)
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        path = prefix + field.name
        if path in overrides:
            fields[field.name] = overrides[path]
            continue
        if field.type == T.TYPE_MESSAGE:
            if depth <= 0:
                fields[field.name] = st.none()
                continue
            value: st.SearchStrategy[Any] = _messages(
                field.message_type, overrides, path + ".", max_repeated, depth - 1
            )
        else:
            value = scalar(field)
        if field.is_repeated:
            fields[field.name] = st.lists(value, max_size=max_repeated)
        elif field.has_presence:  # optional scalars and messages: set or unset
            fields[field.name] = st.none() | value
        else:
            fields[field.name] = value
    return st.fixed_dictionaries(fields).map(lambda values: build(cls, values))


def build(cls: Callable[[], Message], values: Mapping[str, Any]) -> Message:
    message = cls()
    for name, value in values.items():
        if value is None:
            continue
        field = message.DESCRIPTOR.fields_by_name[name]
        if field.type == T.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
            entries = getattr(message, name)  # a map: its entries drawn as key/value messages
            for entry in value:
                if field.message_type.fields_by_name["value"].type == T.TYPE_MESSAGE:
                    entries[entry.key].CopyFrom(entry.value)
                else:
                    entries[entry.key] = entry.value
        elif field.type == T.TYPE_MESSAGE:
            if field.is_repeated:
                getattr(message, name).extend(value)
            else:
                getattr(message, name).CopyFrom(value)
        elif field.is_repeated:
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)
    return message


# ---- raw bytes -------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    n &= 2**64 - 1
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


@st.composite
def wire_records(draw: st.DrawFn, field_numbers: list[int]) -> bytes:
    """Hand-built wire records: known and unknown field numbers with any wire type, and
    payloads that lie (overlong varints, lengths past the end, groups never closed)."""
    out = bytearray()
    for _ in range(draw(st.integers(1, 8))):
        number = draw(st.sampled_from(field_numbers) | st.integers(1, 2**29 - 1))
        wire_type = draw(st.integers(0, 7))
        out += _varint(number << 3 | wire_type)
        kind = draw(st.integers(0, 4))
        if kind == 0:
            out += _varint(draw(st.integers(0, 2**64 - 1)))
        elif kind == 1:  # an overlong varint: 11 continuation bytes
            out += b"\xff" * 10 + b"\x01"
        elif kind == 2:  # a length, then fewer (or more) bytes than it says
            body = draw(st.binary(max_size=32))
            out += _varint(draw(st.integers(0, 2**32))) + body
        elif kind == 3:
            out += draw(st.binary(min_size=1, max_size=16))
        # kind 4: the tag alone, its payload missing
    return bytes(out)


@st.composite
def mutated(draw: st.DrawFn, valid: st.SearchStrategy[Message]) -> bytes:
    """A valid message's serialization, then a few random byte-level edits."""
    return draw(mutated_bytes(valid.map(lambda m: m.SerializeToString())))


@st.composite
def mutated_bytes(draw: st.DrawFn, valid: st.SearchStrategy[bytes]) -> bytes:
    """Valid bytes (a message, an address blob), then a few random byte-level edits."""
    data = bytearray(draw(valid))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.integers(0, 4))
        at = draw(st.integers(0, len(data))) if data else 0
        if op == 0 and data:  # flip bits of one byte
            i = min(at, len(data) - 1)
            data[i] ^= draw(st.integers(1, 255))
        elif op == 1:  # truncate
            del data[at:]
        elif op == 2:  # insert random bytes
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == 3 and data:  # duplicate a span (repeats fields, breaks lengths)
            end = draw(st.integers(at, len(data)))
            data[at:at] = data[at:end]
        elif op == 4:  # a byte that starts a multi-byte varint or an invalid UTF-8 run
            data[at:at] = draw(st.sampled_from([b"\x80", b"\xff", b"\xc3\x28", b"\xed\xa0\x80"]))
    return bytes(data)


def wire_bytes(descriptor: Descriptor, valid: st.SearchStrategy[Message]) -> st.SearchStrategy:
    numbers = [f.number for f in descriptor.fields]
    return st.one_of(
        st.binary(max_size=256),
        mutated(valid),
        wire_records(numbers),
    )
