"""Watches a worker's load through its KvEvents stream (the worker's own stats, not guesses)."""
from __future__ import annotations

import threading
from collections.abc import Callable

import grpc

from tandem.v1 import kv_events_pb2, kv_events_pb2_grpc

Load = kv_events_pb2.WorkerLoad


class LoadWatcher:
    """Subscribes in a background thread; `wait_for(predicate)` blocks until a load report
    satisfies it (reports arrive whenever the worker's load changes)."""

    def __init__(self, address: str) -> None:
        self._channel = grpc.insecure_channel(address)
        stub = kv_events_pb2_grpc.KvEventsStub(self._channel)
        self._call = stub.Subscribe(kv_events_pb2.SubscribeRequest())
        self._cond = threading.Condition()
        self.loads: list[Load] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            for message in self._call:
                if message.WhichOneof("payload") == "load":
                    with self._cond:
                        self.loads.append(message.load)
                        self._cond.notify_all()
        except grpc.RpcError:
            pass  # closed by the test

    def wait_for(self, predicate: Callable[[Load], bool], timeout: float = 30) -> Load:
        with self._cond:
            ok = self._cond.wait_for(lambda: self.loads and predicate(self.loads[-1]), timeout)
            assert ok, f"no load report matched; last: {self.loads[-1] if self.loads else None}"
            return self.loads[-1]

    def close(self) -> None:
        self._call.cancel()
        self._channel.close()
