"""Run-directory outputs: TensorBoard event files decoded by protobuf itself, the SVG plot."""

import io
import struct

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from jaxrec.jobs.run_log import Progress, ScalarWriter, crc32c, svg_plot


def _event_classes():
    """tensorflow's Event / Summary messages (the fields used), built with protobuf

    (installed with orbax-checkpoint): an independent decoder of the format."""

    f = descriptor_pb2.FileDescriptorProto(name="ev.proto", package="tensorflow")
    value = f.message_type.add(name="Value")
    value.field.add(name="tag", number=1, type=9, label=1)
    value.field.add(name="simple_value", number=2, type=2, label=1)
    summary = f.message_type.add(name="Summary")
    summary.field.add(name="value", number=1, type=11, label=3, type_name=".tensorflow.Value")
    event = f.message_type.add(name="Event")
    event.field.add(name="wall_time", number=1, type=1, label=1)
    event.field.add(name="step", number=2, type=3, label=1)
    event.field.add(name="file_version", number=3, type=9, label=1)
    event.field.add(name="summary", number=5, type=11, label=1, type_name=".tensorflow.Summary")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Event"))


def _records(data: bytes):
    out, i = [], 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i : i + 8])
        out.append(data[i + 12 : i + 12 + n])
        i += 12 + n + 4
    return out


def test_crc32c_known_vector():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value


def test_scalar_events_decode_with_protobuf(tmp_path):
    event_cls = _event_classes()
    w = ScalarWriter(tmp_path)
    w.add_scalars({"train/loss": 0.5, "eval/auc": 0.75}, step=3)
    w.add_scalars({"train/loss": 0.25}, step=2**40)  # int64 steps
    w.close()
    events = [event_cls.FromString(r) for r in _records(w.path.read_bytes())]
    assert events[0].file_version == "brain.Event:2"
    got = [(e.step, v.tag, v.simple_value) for e in events[1:] for v in e.summary.value]
    assert got == [(3, "train/loss", 0.5), (3, "eval/auc", 0.75), (2**40, "train/loss", 0.25)]


def test_svg_plot_and_progress():
    svg = svg_plot({"loss": [(1, 0.7), (2, 0.6), (3, 0.55)], "auc": [(2, 0.7)]}, "run")
    assert svg.startswith("<svg") and svg.count("<polyline") == 2
    stream = io.StringIO()
    p = Progress(4, every=2, stream=stream)
    for step in range(1, 5):
        p.update(step, step * 8, loss=0.5)
    lines = stream.getvalue().splitlines()
    assert [ln.split()[1] for ln in lines] == ["2/4", "4/4"] and "samples/s" in lines[-1]
