"""Errors raised when bytes on the wire are not a valid Cadence message.

Every error is a `ProtocolError` (a `ValueError`), so a consumer can catch one type; the subclasses
say which kind of problem it was, so a receiver can count them separately.
"""


class ProtocolError(ValueError):
    """Bytes or a message that does not follow the Cadence protocol."""


class MalformedMessage(ProtocolError):
    """Bytes that are truncated or not MessagePack at all."""


class MessageTooLarge(ProtocolError):
    """An encoded message larger than the codec's `max_bytes`."""


class SchemaVersionMismatch(ProtocolError):
    """A Cadence envelope written under a different schema version."""


class ForeignMessage(ProtocolError):
    """Valid MessagePack that is not ours: wrong envelope or magic, or an unknown message type."""


class InvalidMessage(ProtocolError):
    """A known message type whose fields are missing, mistyped, or inconsistent."""
