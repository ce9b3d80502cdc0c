"""What a training job leaves in its run directory: TensorBoard scalars, a plot, a progress line.

TensorBoard reads ``events.out.tfevents.*`` files: TFRecord framing (length,
masked CRC32C, payload, masked CRC32C) around ``Event`` protocol buffers. The
few fields a scalar needs are encoded here by hand, so jaxrec writes files
TensorBoard opens without depending on TensorFlow, tensorboard or protobuf.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


# ----- CRC32C (Castagnoli), as TFRecord frames use it -----
def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(payload: bytes) -> bytes:
    """One TFRecord frame around ``payload``."""
    header = struct.pack("<Q", len(payload))
    return (
        header + struct.pack("<I", _masked(header)) + payload + struct.pack("<I", _masked(payload))
    )


# ----- the protobuf fields of Event / Summary / Summary.Value -----
def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1  # int64 two's complement, as protobuf encodes negatives
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire: int, body: bytes) -> bytes:
    key = _varint((number << 3) | wire)
    return key + (_varint(len(body)) + body if wire == 2 else body)


def scalar_event(tag: str, value: float, step: int, wall_time: float) -> bytes:
    """``Event(wall_time, step, summary=Summary(value=[Value(tag, simple_value)]))``."""
    value_msg = _field(1, 2, tag.encode()) + _field(2, 5, struct.pack("<f", value))
    summary = _field(1, 2, value_msg)
    return (
        _field(1, 1, struct.pack("<d", wall_time))
        + _field(2, 0, _varint(step))
        + _field(5, 2, summary)
    )


class ScalarWriter:
    """Appends scalars to a TensorBoard event file in ``log_dir`` (``tensorboard --logdir``)."""

    def __init__(self, log_dir: str | os.PathLike):
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        self.path = Path(log_dir) / name
        self._file = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        version = _field(1, 1, struct.pack("<d", time.time())) + _field(3, 2, b"brain.Event:2")
        self._file.write(tfrecord(version))

    def add_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        now = time.time()
        for tag, value in scalars.items():
            self._file.write(tfrecord(scalar_event(tag, float(value), int(step), now)))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


# ----- an SVG line plot (no plotting dependency) -----
def svg_plot(series: Mapping[str, Sequence[tuple[float, float]]], title: str) -> str:
    """One small panel per series (``name -> [(step, value), ...]``), stacked vertically."""
    w, h, pad = 480, 160, 40
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h * len(series) + 30}" '
        'font-family="sans-serif" font-size="11">',
        f'<text x="{pad}" y="18" font-size="13">{title}</text>',
    ]
    for i, (name, points) in enumerate(series.items()):
        top = 30 + i * h
        parts.append(f'<text x="{pad}" y="{top + 12}">{name}</text>')
        parts.append(
            f'<rect x="{pad}" y="{top + 18}" width="{w - 2 * pad}" height="{h - 48}" '
            'fill="none" stroke="#999"/>'
        )
        if len(points) < 1:
            continue
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
        y0, y1 = min(ys), max(ys) if max(ys) > min(ys) else min(ys) + 1
        sx = lambda x: pad + (x - x0) / (x1 - x0) * (w - 2 * pad)  # noqa: B023
        sy = lambda y: top + h - 30 - (y - y0) / (y1 - y0) * (h - 48)  # noqa: B023
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="#1f77b4" stroke-width="1.5"/>')
        parts.append(f'<text x="{pad}" y="{top + h - 14}">{x0:g}</text>')
        parts.append(f'<text x="{w - pad}" y="{top + h - 14}" text-anchor="end">{x1:g}</text>')
        parts.append(f'<text x="{w - pad + 2}" y="{sy(y1):.1f}">{y1:.4g}</text>')
        parts.append(f'<text x="{w - pad + 2}" y="{sy(y0):.1f}">{y0:.4g}</text>')
    parts.append("</svg>")
    return "\n".join(parts)


# ----- a progress line -----
class Progress:
    """``step i/N  loss  samples/s`` on one line on a terminal, every ``every`` steps elsewhere."""

    def __init__(self, total: int | None, *, every: int = 50, stream=None):
        self.total, self.every = total, every
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._start = time.perf_counter()

    def update(self, step: int, samples: int, **values: float | int) -> None:
        if not self.tty and step % self.every and step != self.total:
            return
        rate = samples / max(time.perf_counter() - self._start, 1e-9)
        total = f"/{self.total}" if self.total else ""
        shown = "  ".join(f"{k} {v}" if isinstance(v, int) else f"{k} {v:.4f}"
                          for k, v in values.items())  # fmt: skip
        line = f"step {step}{total}  {shown}  {rate:,.0f} samples/s"
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
