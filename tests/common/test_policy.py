"""Policy and the Tier enum its placements are written in: the tiers read as their names, and the embedding rule
(Policy.choose_embedding) that the engine's placement and the cost model share."""

from __future__ import annotations

import json

import pytest

from offload.common.config import Policy
from offload.common.errors import OffloadError
from offload.common.tier import Tier


def test_a_tier_reads_as_its_name():
    assert list(Tier) == ["device", "host", "nvme"]
    assert {"host": 1}[Tier.HOST] == 1 and {Tier.NVME: 2}["nvme"] == 2
    assert json.dumps({Tier.DEVICE: [Tier.NVME]}) == '{"device": ["nvme"]}'
    assert f"{Tier.HOST}|{Tier.DEVICE:>8}|" == "host|  device|"


def test_fill_counts_layers_in_tier_order_and_spreads_those_off_the_device():
    """As many layers as fit on the device, then in host RAM, the rest streamed; the streamed ones, then those in
    host RAM, spread evenly through the model, so that each is read while the resident layers before it compute."""
    policy = Policy.fill([4, 4, 4, 4, 4], device_room=8, host_room=4, ring_slots=2)
    assert policy.layer_tiers == (Tier.DEVICE, Tier.NVME, Tier.HOST, Tier.NVME, Tier.DEVICE)
    assert policy == Policy(("device", "nvme", "host", "nvme", "device"), ring_slots=2)
    assert policy.counts == (2, 1, 2) and policy.ring_slots == 2
    assert policy == Policy.from_counts(2, 1, 2, ring_slots=2)
    assert Policy.fill([4, 4], 8, 0, ring_slots=2).ring_slots == 0  # nothing streams
    streamed = [i for i, t in enumerate(Policy.fill([1] * 56, 42, 0, 2).layer_tiers) if t == Tier.NVME]
    assert len(streamed) == 14 and all(3 <= b - a <= 5 for a, b in zip(streamed, streamed[1:], strict=False))


def test_layers_of_different_sizes_keep_the_fill_order_where_the_spread_would_not_fit():
    # the big last layers stream; spread, a big one would land on the device and overflow it
    policy = Policy.fill([1, 1, 1, 4, 4], device_room=3, host_room=0, ring_slots=2)
    assert policy.layer_tiers == (Tier.DEVICE, Tier.DEVICE, Tier.DEVICE, Tier.NVME, Tier.NVME)


def test_a_policy_names_only_tiers():
    with pytest.raises(OffloadError, match="tier 'disk' is not one of device, host, nvme"):
        Policy(("device", "disk"))
    with pytest.raises(OffloadError, match="embedding tier 'host' is not one of device, nvme"):
        Policy(("device",), embed_tier="host")


def test_the_embedding_is_stored_only_where_fewer_layers_are_off_the_device():
    resident = Policy.from_counts(2, 0, 2, ring_slots=2)
    fewer = Policy.from_counts(3, 0, 1, ring_slots=2)
    assert Policy.choose_embedding(resident, fewer, host_copied=True) == Policy(
        fewer.layer_tiers, ring_slots=2, embed_tier=Tier.NVME
    )
    assert Policy.choose_embedding(resident, resident, host_copied=True) is resident  # a tie keeps it resident
    assert Policy.choose_embedding(resident, None, host_copied=True) is resident
    assert Policy.choose_embedding(None, fewer, host_copied=True).embed_tier == Tier.NVME
    assert Policy.choose_embedding(None, None, host_copied=True) is None
    # host layers count as off the device only where they are copied there every pass
    in_host, one_fewer = Policy.from_counts(2, 2, 0, ring_slots=2), Policy.from_counts(3, 1, 0, ring_slots=2)
    assert Policy.choose_embedding(in_host, one_fewer, host_copied=False) is in_host
    assert Policy.choose_embedding(in_host, one_fewer, host_copied=True).embed_tier == Tier.NVME
