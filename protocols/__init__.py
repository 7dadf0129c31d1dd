"""The language actors and learner speak: typed messages, their codec, and transports."""

from cadence.protocols.codec import DEFAULT_MAX_BYTES, SCHEMA_VERSION, Codec, decode, encode
from cadence.protocols.errors import (
    ForeignMessage,
    InvalidMessage,
    MalformedMessage,
    MessageTooLarge,
    ProtocolError,
    SchemaVersionMismatch,
)
from cadence.protocols.messages import Control, EngineTimings, Message, RolloutGroup, WeightsPublished
from cadence.protocols.ragged import Packed, Ragged
from cadence.protocols.receiver import Receiver
from cadence.protocols.transport import (
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
