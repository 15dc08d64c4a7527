"""Colocated CPU weight push to two engines: every push, not only the first, reaches both engines.

Each engine is a separate process that opens the shared-memory bucket by name and drops it after copying,
as the embedded engine does. Pickling the bucket once for both engines gave its file back twice for one
reference taken, so it was unlinked and the second push failed with "unable to open shared memory object"."""

import contextlib
import multiprocessing
from argparse import Namespace

import pytest
import torch

from slime.backends.update_weight.tensor import TensorWeightUpdater
from slime.backends.update_weight.wire_format import deserialize_named_tensors, use_file_system_sharing


def _engine(conn):
    use_file_system_sharing()
    while (request := conn.recv()) is not None:
        try:
            named = deserialize_named_tensors(request["serialized_named_tensors"][0], request["load_format"])
            answer = {name: tensor.clone() for name, tensor in named}
            del named  # the engine keeps its copy, not the shared buffer
            conn.send(("ok", answer))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))


class _ProcessEngines:
    """EngineClient stand-in: each request goes to its engine process, answers are collected."""

    def __init__(self, conns):
        self.conns, self.received = conns, [[] for _ in conns]

    @contextlib.contextmanager
    def weight_update_session(self):
        yield

    def post_all(self, path, requests):
        for conn, request in zip(self.conns, requests):
            conn.send(request)
        for i, conn in enumerate(self.conns):
            status, answer = conn.recv()
            assert status == "ok", f"engine {i}: {answer}"
            self.received[i].append(answer)

    def close(self):
        pass


@pytest.mark.timeout(120)
def test_every_push_reaches_both_cpu_engines():
    ctx = multiprocessing.get_context("fork")  # the engines share no storage with the trainer: they open it by name
    pipes = [ctx.Pipe() for _ in range(2)]
    engines = [ctx.Process(target=_engine, args=(child,), daemon=True) for _, child in pipes]
    for engine in engines:
        engine.start()
    try:
        updater = TensorWeightUpdater(Namespace(rollout_backend="embedded"), ["http://a", "http://b"], [0, 0])
        updater.client = _ProcessEngines([parent for parent, _ in pipes])
        for push in range(3):
            buckets = [[("w1", torch.full((4, 3), float(push))), ("w2", torch.arange(5.0) + push)],
                       [("w3", torch.full((2,), push * 10.0))]]
            updater.update(iter(buckets), str(push))
        for received in updater.client.received:
            assert len(received) == 6  # 3 pushes x 2 buckets
            assert torch.equal(received[-2]["w2"], torch.arange(5.0) + 2) and torch.equal(received[-1]["w3"],
                                                                                        torch.full((2,), 20.0))
    finally:
        for parent, _ in pipes:
            parent.send(None)
        for engine in engines:
            engine.join(10)
