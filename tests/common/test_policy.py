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


def test_fill_places_layers_in_tiers_in_order():
    policy = Policy.fill([4, 4, 4, 4, 4], device_room=8, host_room=4, ring_slots=2)
    assert policy.layer_tiers == (Tier.DEVICE, Tier.DEVICE, Tier.HOST, Tier.NVME, Tier.NVME)
    assert policy == Policy(("device", "device", "host", "nvme", "nvme"), ring_slots=2)
    assert policy.counts == (2, 1, 2) and policy.ring_slots == 2
    assert Policy.fill([4, 4], 8, 0, ring_slots=2).ring_slots == 0  # nothing streams


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
