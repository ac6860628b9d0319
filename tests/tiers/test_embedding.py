"""A token embedding left in storage: its rows read on demand equal the table's, the placement leaves it there only
where that puts fewer layers off the device (and never a table the head is tied to), and a model run with it
generates exactly what the resident model does."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_checkpoint
from offload.api import LLM
from offload.common.config import EngineConfig, Policy, SamplingParams
from offload.common.errors import OffloadError
from offload.model.registry import model_tensors
from offload.tiers.device import DeviceTier
from offload.tiers.io.buffered import BufferedReader
from offload.tiers.io.direct import PreadBackend
from offload.tiers.weights.checkpoint import Checkpoint
from offload.tiers.weights.embedding import StoredEmbedding, read_buffer_bytes, storable
from offload.tiers.weights.layout import model_layout
from offload.tiers.weights.placement import group_cost, place_weights

VOCAB = 32768  # x hidden 64 x 4 bytes: an 8 MiB table, worth dozens of this model's layers
LAYERS = 6
RING = 3
KV = 1 << 20
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)
PROMPTS = [[1, 5, 9, 32000, 17, 5], [1, 44, 45, 46, 47, 32767, 0, 50, 51]]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def wide_vocab(tmp_path_factory):
    path = tmp_path_factory.mktemp("wide_vocab")
    make_checkpoint(path, "llama", num_hidden_layers=LAYERS, vocab_size=VOCAB)
    return path


@pytest.fixture(scope="module")
def resident(wide_vocab):
    llm = LLM(wide_vocab, EngineConfig(ring_slots=RING, kv_cache_bytes=KV))
    out = [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)]
    llm.close()
    return out


def layout_of(path):
    from offload.model.loader import load_spec

    spec, family = load_spec(path)
    with BufferedReader() as reader:
        return model_layout(Checkpoint(path, reader), model_tensors(family, spec))


def costs(path) -> dict[str, int]:
    layout = layout_of(path)
    cost = functools.partial(group_cost, dtype=torch.float32, tier=DeviceTier(None, CPU), staged=False)
    layers = [cost(g) for g in layout.layers]  # alignment makes some a block bigger
    return {"embed": cost(layout.embed), "head": cost(layout.head), "layer": max(layers), "layers": sum(layers)}


def test_rows_read_from_storage_are_the_tables_rows_in_any_order_with_repeats(wide_vocab):
    table = load_file(wide_vocab / "model.safetensors")["model.embed_tokens.weight"]
    layout = layout_of(wide_vocab)
    tier = DeviceTier(None, torch.device("cpu"))
    with PreadBackend(threads=2) as backend:
        # a buffer of 4 blocks: rows 256 bytes each, so a lookup of many rows takes several rounds of reads
        stored = StoredEmbedding(layout.embed, backend, tier, torch.bfloat16, torch.device("cpu"), buffer_bytes=4 << 12)
        ids = torch.tensor([7, 7, 8, 9, 10, 0, VOCAB - 1, 300, 5000, 4999, 5001, 7] + list(range(100, 180)))
        rows, index = stored.lookup(ids)
        assert rows.dtype == torch.bfloat16 and rows.shape == (len(set(ids.tolist())), 64)
        assert torch.equal(rows[index], table[ids].to(torch.bfloat16))
        assert stored.rows_read == len(set(ids.tolist()))
        assert backend.bytes_read < 100 * 4096  # rows, not the 8 MiB table
        with pytest.raises(IndexError, match=f"token id {VOCAB} is outside the embedding's {VOCAB} rows"):
            stored.lookup(torch.tensor([3, VOCAB]))
        stored.close()
        stored.close()  # harmless
        with pytest.raises(RuntimeError, match="closed"):
            stored.lookup(torch.tensor([3]))
    assert tier.used == 0


def test_a_lookup_that_needs_most_rows_reads_the_table_in_a_few_large_pieces(wide_vocab):
    table = load_file(wide_vocab / "model.safetensors")["model.embed_tokens.weight"]
    layout = layout_of(wide_vocab)
    with PreadBackend(threads=2) as backend:
        stored = StoredEmbedding(layout.embed, backend, DeviceTier(None, CPU), torch.float32, CPU)  # 2 MiB buffer
        submitted = []
        submit = backend.submit
        backend.submit = lambda *a: submitted.append(a[2]) or submit(*a)
        ids = torch.arange(0, VOCAB, 3)  # every third row: the gaps read along, in pieces of 8,160 rows (2 MiB)
        rows, index = stored.lookup(ids)
        assert torch.equal(rows[index], table[ids])
        assert len(submitted) == 5 and sum(submitted) <= table.numel() * 4  # 32,768 rows
        submitted.clear()
        rows, index = stored.lookup(torch.tensor([5, 20000, 5]))  # far apart: a read each, of one row
        assert torch.equal(rows[index], table[[5, 20000, 5]]) and submitted == [256, 256]
        stored.close()


def test_placement_leaves_the_table_in_storage_only_where_it_buys_layers(wide_vocab):
    layout, c = layout_of(wide_vocab), costs(wide_vocab)
    buffer = DeviceTier(None, torch.device("cpu")).footprint(read_buffer_bytes(layout.embed))

    def place(budget: int) -> Policy:
        return place_weights(layout, torch.float32, DeviceTier(budget, torch.device("cpu")), host(), RING)

    # room for the table, the head and every layer: nothing streams, the table stays
    assert place(c["embed"] + c["head"] + c["layers"]) == Policy(("device",) * LAYERS)
    # the table's bytes buy every layer a budget with it resident would stream all but one of
    one = place(c["embed"] + c["head"] + (RING + 1) * c["layer"])
    assert one.embed_tier == "nvme" and one.counts == (LAYERS, 0, 0)
    # too small for the table at all: still runs, the table read by rows, two layers resident
    two = place(c["head"] + buffer + (RING + 2) * c["layer"])
    assert two == Policy(Policy.from_counts(2, 0, LAYERS - 2, RING).layer_tiers, RING, "nvme")
    # and one byte less than the buffer needs is a clear error
    with pytest.raises(OffloadError, match="--device-memory is too small"):
        place(c["head"] + buffer + RING * c["layer"] - 1)


def test_a_table_the_process_holds_anyway_stays_resident(wide_vocab):
    """A `self` draft's table, shared with the target, is resident whatever the budget: storing it would read rows
    of a table already in memory."""
    layout, c = layout_of(wide_vocab), costs(wide_vocab)
    budget = c["embed"] + c["head"] + (RING + 1) * c["layer"]  # where the table alone would go to storage (above)
    policy = place_weights(layout, torch.float32, DeviceTier(budget, CPU), host(), RING, table_held=True)
    assert policy.embed_tier == "device" and policy.counts == (1, 0, LAYERS - 1)


def test_a_shared_group_is_taken_as_loaded_or_refused(wide_vocab):
    from offload.tiers.weights.weight_store import WeightStore

    layout = layout_of(wide_vocab)
    table = load_file(wide_vocab / "model.safetensors")["model.embed_tokens.weight"]
    policy = Policy(("device",) * LAYERS)
    tier = DeviceTier(None, CPU)
    with PreadBackend(threads=2) as backend:
        store = WeightStore(layout, backend, policy, tier, host(), torch.float32, shared={"embed": {"embed": table}})
        others = sum(g.tensor_bytes for g in (layout.head, *layout.layers))
        assert store.embed["embed"] is table and backend.bytes_read < others + table.numel() * 4 // 2  # not read
        assert tier.used >= table.numel() * 4 + others  # charged all the same
        store.close()
        for wrong in (table.to(torch.bfloat16), table[:-1]):  # another dtype or shape than the store's own
            with pytest.raises(ValueError, match="shared embed"):
                WeightStore(layout, backend, policy, DeviceTier(None, CPU), host(), torch.float32,
                            shared={"embed": {"embed": wrong}})  # fmt: skip


def host():
    from offload.tiers.host import HostTier

    return HostTier(None)


def test_a_head_tied_to_the_table_keeps_it_resident(tmp_path):
    make_checkpoint(tmp_path, "qwen2", num_hidden_layers=LAYERS, vocab_size=VOCAB)  # qwen2: tied head
    layout = layout_of(tmp_path)
    assert not storable(layout.embed, layout.head)
    cost = functools.partial(group_cost, dtype=torch.float32, tier=DeviceTier(None, CPU), staged=False)
    budget = cost(layout.embed) + cost(layout.head) + (RING + 1) * cost(layout.layers[0])
    policy = place_weights(layout, torch.float32, DeviceTier(budget, torch.device("cpu")), host(), RING)
    assert policy.embed_tier == "device" and policy.counts == (1, 0, LAYERS - 1)


@pytest.mark.parametrize("path", ["direct", "staged"])
def test_a_model_with_its_table_in_storage_generates_what_the_resident_model_does(wide_vocab, resident, path):
    from offload import build
    from offload.tiers.weights.weight_store import WeightStore

    c = costs(wide_vocab)
    budget = KV + c["head"] + (RING + 2) * c["layer"]  # no room for the table
    config = EngineConfig(ring_slots=RING, kv_cache_bytes=KV, device_memory=budget + (2 << 20) + 8192)
    with pytest.MonkeyPatch.context() as mp:
        if path == "staged":  # the rows land in host RAM, then are copied
            mp.setattr(build, "WeightStore", functools.partial(WeightStore, staged=True))
            mp.setattr(build, "place_weights", functools.partial(place_weights, staged=True))
            config = dataclasses.replace(config, device_memory=budget)
        llm = LLM(wide_vocab, config)
        try:
            assert llm.placement.embed_tier == "nvme" and llm.placement.counts[0] < LAYERS
            assert [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)] == resident
            stats = llm.stats().weights
            # each step reads its tokens' distinct rows: the two prompts' (13) at once, then one or two per step
            steps = PARAMS.max_new_tokens - 1
            assert 13 + steps <= stats.embed_rows_read <= 13 + 2 * steps
            assert (
                not llm.parts.weights.store.embed
                and stats.resident_bytes <= c["head"] + llm.placement.counts[0] * c["layer"]
            )
        finally:
            llm.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_table_in_storage_generates_what_the_resident_model_does(wide_vocab):
    """The staged path as CUDA runs it: rows read into host RAM, converted and copied to the device per step."""
    base = LLM(wide_vocab, EngineConfig(ring_slots=RING, kv_cache_bytes=KV, device="cuda"))
    want = [c.token_ids for c in base.generate_ids(PROMPTS, PARAMS)]
    base.close()
    c = costs(wide_vocab)  # CPU footprints, at least what CUDA charges; the 8 MiB table cannot fit beside them
    budget = KV + c["head"] + (RING + 2) * c["layer"]
    llm = LLM(wide_vocab, EngineConfig(ring_slots=RING, kv_cache_bytes=KV, device="cuda", device_memory=budget))
    try:
        assert llm.parts.weights.store.staged and llm.placement.embed_tier == "nvme"
        assert [c.token_ids for c in llm.generate_ids(PROMPTS, PARAMS)] == want
        assert llm.stats().weights.embed_rows_read >= 13  # the prompts' distinct tokens, then the new ones
        assert llm.placement.device_peak <= llm.placement.device_budget
    finally:
        llm.close()
