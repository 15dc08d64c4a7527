"""Placement over several nodes without a cluster (the two-node run itself: test_multinode.py): the
actor's devices are spread over --actor-num-nodes nodes, and embedded engines listen where other
nodes reach them."""

import pytest

from slime.ray import engine_actor, placement


class FakeGroup:
    def __init__(self, bundles, strategy, name):
        self.bundles, self.strategy, self.name = bundles, strategy, name


@pytest.fixture
def groups(monkeypatch):
    made = []

    def fake_placement_group(bundles, strategy, name):
        made.append(FakeGroup(bundles, strategy, name))
        return made[-1]

    monkeypatch.setattr(placement, "placement_group", fake_placement_group)
    monkeypatch.setattr(placement, "_wait_ready", lambda group, what: None)
    return made


def test_actor_devices_spread_over_the_requested_nodes(groups):
    spread = placement._make_group(4, gpu=True, name="slime-actor", num_nodes=2)
    assert groups[-1].strategy == "STRICT_SPREAD" and groups[-1].bundles == [{"GPU": 2, "CPU": 2}] * 2
    assert spread.bundle_indices == [0, 0, 1, 1] and spread.gpus_per_bundle == 1  # ranks 0-1 node A, 2-3 node B
    one_node = placement._make_group(2, gpu=False, name="slime-rollout")
    assert groups[-1].strategy == "PACK" and groups[-1].bundles == [{"CPU": 1}] * 2
    assert one_node.bundle_indices == [0, 1]
    with pytest.raises(ValueError, match="3 devices cannot be split evenly over 2 nodes"):
        placement._make_group(3, gpu=True, name="slime-actor", num_nodes=2)


def test_embedded_engines_listen_on_the_node_ip_only_in_a_multi_node_cluster(monkeypatch):
    node_ip = "127.0.0.3"
    monkeypatch.setattr(engine_actor.ray.util, "get_node_ip_address", lambda: node_ip)
    monkeypatch.setattr(engine_actor.ray, "nodes", lambda: [{"Alive": True}, {"Alive": False}])
    assert engine_actor.engine_host() == "127.0.0.1"  # one live node: 127.0.0.1
    monkeypatch.setattr(engine_actor.ray, "nodes", lambda: [{"Alive": True}, {"Alive": True}])
    assert engine_actor.engine_host() == "127.0.0.3"  # this node's (loopback) address, reachable from the others
    node_ip = "10.1.2.3"  # a real second machine: no unauthenticated engine on the network
    with pytest.raises(RuntimeError, match="loopback addresses only.*10.1.2.3.*--rollout-backend sglang"):
        engine_actor.engine_host()
