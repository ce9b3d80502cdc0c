"""Reads TensorBoard event files back with tensorboardX's own protocol buffers."""

import struct
from pathlib import Path

from tensorboardX.proto.event_pb2 import Event


def read_scalars(log_dir: Path) -> list[tuple[int, str, float]]:
    """``(step, tag, value)`` of every scalar in ``log_dir``'s event files.

    The files are TFRecords (length, its CRC, payload, its CRC) of ``Event``
    messages; the CRCs are not checked here.
    """
    got = []
    for path in sorted(Path(log_dir).glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i : i + 8])
            event = Event.FromString(data[i + 12 : i + 12 + n])
            got += [(event.step, v.tag, v.simple_value) for v in event.summary.value]
            i += 12 + n + 4
    return got
