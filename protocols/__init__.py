"""The language actors and learner speak: typed messages, their codec, and transports."""

from protocols.codec import DEFAULT_MAX_BYTES, SCHEMA_VERSION, Codec, decode, encode
from protocols.errors import (
    ForeignMessage,
    InvalidMessage,
    MalformedMessage,
    MessageTooLarge,
    ProtocolError,
    SchemaVersionMismatch,
)
from protocols.messages import Control, EngineTimings, Message, RolloutGroup, WeightsPublished
from protocols.ragged import Packed, Ragged
from protocols.receiver import Receiver
from protocols.transport import (
    BytesTransport,
    InProcessTransport,
    Transport,
    TransportClosed,
    TransportFull,
)

__all__ = [
    "DEFAULT_MAX_BYTES",
    "SCHEMA_VERSION",
    "BytesTransport",
    "Codec",
    "Control",
    "EngineTimings",
    "ForeignMessage",
    "InProcessTransport",
    "InvalidMessage",
    "MalformedMessage",
    "Message",
    "MessageTooLarge",
    "Packed",
    "ProtocolError",
    "Ragged",
    "Receiver",
    "RolloutGroup",
    "SchemaVersionMismatch",
    "Transport",
    "TransportClosed",
    "TransportFull",
    "WeightsPublished",
    "decode",
    "encode",
]
