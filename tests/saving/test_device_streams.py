"""Which device and stream each CUDA copy runs on, with torch.cuda faked at the one seam
(:class:`zerostall.saving.snapshot.DeviceStreams` takes the ``cuda`` module): runs without a GPU."""

import contextlib

import torch

from zerostall.saving.snapshot import DeviceStreams, record_save_events


class FakeCuda:
    """Just enough of torch.cuda: a current device, per-device current streams, events."""

    def __init__(self):
        self.dev = 0
        self.current = {}  # device -> current stream
        self.log = []

    def current_device(self):
        return self.dev

    @contextlib.contextmanager
    def device(self, i):
        prev, self.dev = self.dev, i
        try:
            yield
        finally:
            self.dev = prev

    def Stream(self, device=None, priority=0):
        return FakeStream(self, self.dev if device is None else device, f"side{device}")

    def current_stream(self, i=None):
        i = self.dev if i is None else i
        return self.current.setdefault(i, FakeStream(self, i, f"default{i}"))

    @contextlib.contextmanager
    def stream(self, s):
        # torch.cuda.stream(s) makes s current on *its* device; it must be the current device
        assert s.device == self.dev, f"stream of device {s.device} made current on device {self.dev}"
        prev = self.current_stream(s.device)
        self.current[s.device] = s
        try:
            yield
        finally:
            self.current[s.device] = prev

    def Event(self, blocking=False):
        ev = FakeEvent(self)
        ev.blocking = blocking
        return ev


class FakeStream:
    def __init__(self, cuda, device, name):
        self.cuda, self.device, self.name = cuda, device, name

    def wait_event(self, ev):
        self.cuda.log.append(("wait", self.name, ev.recorded_on))


class FakeEvent:
    def __init__(self, cuda):
        self.cuda, self.recorded_on = cuda, None

    def record(self, stream=None):
        stream = stream or self.cuda.current_stream()
        assert stream.device == self.cuda.dev, "event recorded on another device's stream"
        self.recorded_on = stream.name
        self.cuda.log.append(("record", stream.name))

    def synchronize(self):
        self.cuda.log.append(("sync", self.recorded_on))


def test_each_copy_runs_on_its_own_devices_side_stream():
    cuda = FakeCuda()
    ds = DeviceStreams(cuda)
    seen = []

    def copy():
        seen.append((cuda.current_device(), cuda.current_stream().name))

    after = {i: FakeEvent(cuda) for i in (0, 1)}
    for i, ev in after.items():
        with cuda.device(i):
            ev.record(cuda.current_stream(i))
    cuda.log.clear()
    for dev in (torch.device("cuda", 1), torch.device("cuda", 0), torch.device("cuda", 1)):
        ds.run(dev, copy, after)
    assert seen == [(1, "side1"), (0, "side0"), (1, "side1")]
    assert cuda.current_device() == 0 and cuda.current_stream(1).name == "default1"  # restored
    # per copy: wait for the caller's save() event of that device, then record + wait on the
    # side stream's completion event before returning (bytes published only after)
    assert cuda.log == [("wait", "side1", "default1"), ("record", "side1"), ("sync", "side1"),
                        ("wait", "side0", "default0"), ("record", "side0"), ("sync", "side0"),
                        ("wait", "side1", "default1"), ("record", "side1"), ("sync", "side1")]
    assert sorted(ds._streams) == [0, 1]  # one side stream per device, reused
    # the snapshot thread sleeps on its completion events (cudaEventBlockingSync), never spins
    assert sorted(ds._done) == [0, 1] and all(ev.blocking for ev in ds._done.values())


def test_save_events_one_per_device_on_that_devices_current_stream():
    cuda = FakeCuda()

    class T:
        def __init__(self, dev):
            self.device = torch.device(dev)

    events = record_save_events([T("cuda:2"), T("cpu"), T("cuda:0"), T("cuda:2")], cuda=cuda)
    assert sorted(events) == [0, 2]
    assert events[2].recorded_on == "default2" and events[0].recorded_on == "default0"
    assert cuda.current_device() == 0


def test_device_without_index_uses_the_current_device():
    cuda = FakeCuda()
    cuda.dev = 3
    seen = []
    DeviceStreams(cuda).run(torch.device("cuda"), lambda: seen.append(cuda.current_stream().name))
    assert seen == ["side3"]
