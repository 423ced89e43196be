"""Hypothesis strategies for any protobuf message, built from its descriptor: every field of
every type (nested messages to a depth, repeated fields, oneofs, unknown enum values), with
values biased towards the edges a servicer must refuse cleanly (0, negatives, huge numbers,
NaN, empty and odd strings)."""
from __future__ import annotations

from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

_F = FieldDescriptor
_INT_RANGES = {
    _F.TYPE_INT32: (-(2**31), 2**31 - 1), _F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    _F.TYPE_SFIXED32: (-(2**31), 2**31 - 1), _F.TYPE_INT64: (-(2**63), 2**63 - 1),
    _F.TYPE_SINT64: (-(2**63), 2**63 - 1), _F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    _F.TYPE_UINT32: (0, 2**32 - 1), _F.TYPE_FIXED32: (0, 2**32 - 1),
    _F.TYPE_UINT64: (0, 2**64 - 1), _F.TYPE_FIXED64: (0, 2**64 - 1),
}
def _int(low: int, high: int) -> st.SearchStrategy[int]:
    """Small values are where real requests live (token ids, max_tokens); the bounds and the
    full range find overflows."""
    return st.one_of(st.integers(max(low, -3), min(high, 300)), st.sampled_from([low, high]),
                     st.integers(low, high))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _INT_RANGES:
        return _int(*_INT_RANGES[t])
    if t == _F.TYPE_BOOL:
        return st.booleans()
    if t in (_F.TYPE_FLOAT, _F.TYPE_DOUBLE):
        width = 32 if t == _F.TYPE_FLOAT else 64
        return st.one_of(st.floats(-5, 5, width=width), st.floats(width=width))
    if t == _F.TYPE_STRING:
        return st.text(max_size=40)
    if t == _F.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == _F.TYPE_ENUM:
        numbers = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(numbers), st.integers(-5, 50))
    raise TypeError(f"unhandled protobuf field type {t} ({field.full_name})")


def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any] | None:
    if field.type == _F.TYPE_MESSAGE:
        if depth <= 0:
            return None
        return messages(field.message_type, depth - 1)
    return _scalar(field)


def messages(descriptor: Descriptor, depth: int = 3) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`'s type with any subset of its fields set."""
    cls = _message_class(descriptor)
    parts: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        value = _value(field, depth)
        if value is None:
            continue
        if field.is_repeated:
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                continue  # no maps in Tandem's protos
            parts[field.name] = st.lists(value, max_size=6)
        else:
            parts[field.name] = value
    names = sorted(parts)

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        msg = cls()
        chosen = draw(st.lists(st.sampled_from(names), unique=True)) if names else []
        for name in chosen:
            field = descriptor.fields_by_name[name]
            oneof = field.containing_oneof
            if oneof is not None and msg.WhichOneof(oneof.name) is not None:
                continue  # one member per oneof (a later one would replace it)
            value = draw(parts[name])
            if field.is_repeated:
                getattr(msg, name).extend(value)
            elif field.type == _F.TYPE_MESSAGE:
                getattr(msg, name).CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg

    return build()


def _message_class(descriptor: Descriptor) -> type[Message]:
    return message_factory.GetMessageClass(descriptor)
