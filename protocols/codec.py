"""Wire format for Cadence messages: a versioned MessagePack envelope (never pickle).

An encoded message is the MessagePack array `["cadence", SCHEMA_VERSION, body]`, where body is the
message Struct as a map whose `type` field names its kind. A well-formed message decodes in one
pass; one that fails is decoded again envelope first (the body kept as raw bytes), so a peer on
another schema version is reported as such even when its message shapes have changed, and only
then is the body decoded and validated. Unknown fields in a body are ignored, so adding an
optional field needs no version bump, nor does removing one that has a default (an older peer
fills the default in: Control's batch_size and max_staleness went this way); renaming, retyping,
or removing a required one does (bump SCHEMA_VERSION).

Every failure is a `ProtocolError` subclass whose text says what is wrong: truncated or malformed
bytes, a message over `max_bytes` (both sizes), another schema version (both versions), foreign
bytes (wrong envelope, magic, or message type), or an invalid field (named, with its index).
"""

from __future__ import annotations

import msgspec

from cadence.protocols.errors import (
    ForeignMessage,
    InvalidMessage,
    MalformedMessage,
    MessageTooLarge,
    ProtocolError,
    SchemaVersionMismatch,
)
from cadence.protocols.messages import MESSAGE_TYPES, Message

SCHEMA_VERSION = 2  # 2: RolloutGroup's per-token fields are packed arrays (protocols/ragged.py)
MAGIC = "cadence"
DEFAULT_MAX_BYTES = 64 * 1024 * 1024  # 64 MiB: ~4M completion tokens with logprobs

_KNOWN_TAGS = tuple(t.__struct_config__.tag for t in MESSAGE_TYPES)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "MAGIC",
    "SCHEMA_VERSION",
    "Codec",
    "ProtocolError",
    "decode",
    "encode",
]


class _Envelope(msgspec.Struct, array_like=True):
    """The outer frame; body is left undecoded until magic and version are checked."""

    magic: str
    version: int
    body: msgspec.Raw


class _Typed(msgspec.Struct, array_like=True):
    """The whole envelope in one pass: the fast path for a well-formed message."""

    magic: str
    version: int
    body: Message


class _TagOnly(msgspec.Struct):
    """Reads only the tag of a body, to tell an unknown message type from an invalid field."""

    type: str | None = None


class Codec:
    """Encodes and decodes Cadence messages, enforcing a size limit.

    Args:
      max_bytes: largest encoded message accepted, in bytes, on both encode and decode. Raise it on
        both ends together.
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_bytes < 1:
            raise ValueError(f"max_bytes: must be >= 1, got {max_bytes}")
        self.max_bytes = max_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._typed_decoder = msgspec.msgpack.Decoder(_Typed)
        self._envelope_decoder = msgspec.msgpack.Decoder(_Envelope)
        self._body_decoder = msgspec.msgpack.Decoder(Message)
        self._tag_decoder = msgspec.msgpack.Decoder(_TagOnly)

    def encode(self, msg: Message) -> bytes:
        """Returns the envelope bytes of `msg`.

        The message was validated when it was constructed, so it is not validated again here
        (that would double the cost for large groups); lists mutated after construction are caught
        by the receiver's decode-time validation.

        Raises:
          TypeError: msg is not a Cadence message.
          MessageTooLarge: the encoding exceeds max_bytes.
        """
        if not isinstance(msg, MESSAGE_TYPES):
            raise TypeError(f"cannot encode {type(msg).__name__}: not a Cadence message")
        data = self._encoder.encode((MAGIC, SCHEMA_VERSION, msg))
        if len(data) > self.max_bytes:
            raise MessageTooLarge(
                f"message too large: encoded {msg.__struct_config__.tag} is {len(data)} bytes, "
                f"over max_bytes {self.max_bytes}"
            )
        return data

    def decode(self, data: bytes | bytearray | memoryview) -> Message:
        """Returns the message in `data`, checked against the schema and validated.

        Raises:
          TypeError: data is not a bytes-like object.
          ProtocolError: one of its subclasses, saying what is wrong with data.
        """
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"decode expects bytes, got {type(data).__name__}")
        size = len(data)
        if size > self.max_bytes:
            raise MessageTooLarge(
                f"message too large: {size} bytes, over max_bytes {self.max_bytes}"
            )
        try:  # one pass; any failure is decoded again, envelope first, to say what is wrong
            typed = self._typed_decoder.decode(data)
            if typed.magic == MAGIC and typed.version == SCHEMA_VERSION:
                return typed.body
        except msgspec.DecodeError:
            pass
        # ValidationError subclasses DecodeError, so it must be caught first.
        try:
            envelope = self._envelope_decoder.decode(data)
        except msgspec.ValidationError as e:
            raise ForeignMessage(
                f"foreign message: not a Cadence envelope [magic, version, body] ({e})"
                f"{_json_hint(data)}"
            ) from None
        except msgspec.DecodeError as e:
            raise _malformed(data, e) from None
        if envelope.magic != MAGIC:
            raise ForeignMessage(
                f"foreign message: magic {envelope.magic!r} is not {MAGIC!r}"
            )
        if envelope.version != SCHEMA_VERSION:
            raise SchemaVersionMismatch(
                f"schema version mismatch: message has version {envelope.version}, "
                f"this codec speaks version {SCHEMA_VERSION}"
            )
        try:
            return self._body_decoder.decode(envelope.body)
        except msgspec.ValidationError as e:
            raise self._body_error(envelope.body, e) from None
        except msgspec.DecodeError as e:
            raise _malformed(data, e) from None

    def _body_error(self, body: msgspec.Raw, error: msgspec.ValidationError) -> ProtocolError:
        """Classifies a body that failed to decode (error path only, so it may parse again)."""
        if isinstance(error.__cause__, InvalidMessage):  # raised by a message's validate()
            return InvalidMessage(f"invalid message: {error}")  # keeps the path, e.g. `$.timings`
        try:
            tag = self._tag_decoder.decode(body).type
        except msgspec.ValidationError:
            return ForeignMessage(f"foreign message: body is not a map ({error})")
        if tag is None:
            return ForeignMessage("foreign message: body has no 'type' field")
        if tag not in _KNOWN_TAGS:
            return ForeignMessage(
                f"foreign message: unknown message type {tag!r} (known: {', '.join(_KNOWN_TAGS)})"
            )
        return InvalidMessage(f"invalid {tag} message: {error}")


def _malformed(data: bytes | bytearray | memoryview, error: msgspec.DecodeError) -> MalformedMessage:
    if not len(data):
        return MalformedMessage("truncated message: 0 bytes (empty)")
    what = "truncated" if "truncated" in str(error) else "malformed"
    return MalformedMessage(
        f"{what} message: {len(data)} bytes are not a complete MessagePack value ({error})"
        f"{_json_hint(data)}"
    )


def _json_hint(data: bytes | bytearray | memoryview) -> str:
    head = bytes(data[:1])
    return "; it looks like JSON, which Cadence does not speak" if head in (b"{", b"[") else ""


_DEFAULT_CODEC = Codec()


def encode(msg: Message) -> bytes:
    """Encodes `msg` with the default codec (max_bytes = DEFAULT_MAX_BYTES). See Codec.encode."""
    return _DEFAULT_CODEC.encode(msg)


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Decodes `data` with the default codec (max_bytes = DEFAULT_MAX_BYTES). See Codec.decode."""
    return _DEFAULT_CODEC.decode(data)
