"""Experts of mixture-of-experts layers, cached on the device by (layer, expert) and read on a miss.

With expert streaming a sparse layer's dense part (attention, norms, router, shared expert) is placed and streamed
like any layer by the WeightStore; its routed experts live here. Each expert is one GroupLayout of its three
matrices (and their scales when quantized), read from the checkpoint in few aligned runs into one of `slots`
equal buffers taken from the device tier once, so the cache never holds more than its own budget, and the device
tier's budget is never exceeded either. Tensors stored in another float dtype are converted into a second buffer
of the slot, taken with it.

Eviction is least-frequently-used, ties broken by the layer cycle. Frequency is an expert's selection count over the
whole run (kept after it is evicted), the same count the prefetcher ranks by; routers favour the same experts step
after step, so the experts selected most often are the ones worth keeping. The layer-major step visits the layers
in a cycle, so among experts selected as often the one evicted is the one whose layer comes back last: the layer
just fetched (Belady's choice for a cycle). A recency order would evict the expert needed next (least recently used
is, in a cycle longer than the cache, the next one up).

Prefetches come in two kinds: by frequency (an expert may displace only one selected less often) and guesses (the
experts the next sparse layer's router would choose for the current hidden state, offload/model/expert_streaming.py),
which may displace any expert not in use and are kept until their layer is fetched.

On a CUDA device (the staged path) this cache's buffers are pinned host RAM (the host tier, --expert-host-memory)
and experts are computed from a second, smaller cache of device slots (tiers/experts/expert_slots.py) that copies them
from here, or, cold ones, on the CPU from here (offload/model/expert_streaming.py); a buffer then also waits for
its last copy to the device before it takes another expert.

Invariants: an expert a `fetch` returns is never evicted by that call, nor by a `prefetch` before the next fetch
(compute may still read it); a buffer takes a new read only once the reads into it, and the copies from it, have
landed.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields

import torch

from offload.common.errors import OffloadError
from offload.tiers.copy import Event
from offload.tiers.io.base import ReadBackend, ReadRequest
from offload.tiers.memory import MemoryTier, take
from offload.tiers.weights.checkpoint import TORCH_DTYPES
from offload.tiers.weights.landing import LandingBuffers
from offload.tiers.weights.layout import GroupLayout, Weights
from offload.tiers.weights.ring import read

Key = tuple[int, int]  # (layer, expert)


@dataclass(frozen=True, slots=True)
class ExpertStats:
    hits: int = 0  # experts a fetch found cached or already being read (by a prefetch)
    misses: int = 0  # experts a fetch had to read
    bytes_read: int = 0  # bytes read from storage for experts (misses and prefetches)
    prefetches: int = 0  # expert reads started by prefetch
    prefetch_used: int = 0  # of those, the ones a fetch asked for before they were evicted
    stall_seconds: float = 0.0  # time a fetch waited for expert reads
    device_hits: int = 0  # of the hits, experts a fetch found on the device (staged path; else every hit is)
    h2d_bytes: int = 0  # bytes copied host -> device for experts (staged path)
    cpu_runs: int = 0  # experts run on the CPU from host RAM instead of copied to the device (staged path)

    def __sub__(self, other: ExpertStats) -> ExpertStats:
        return ExpertStats(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.hits + self.misses, 1)

    @property
    def prefetch_accuracy(self) -> float:
        return self.prefetch_used / max(self.prefetches, 1)


@dataclass(slots=True)
class _Entry:
    slot: int  # index of its buffer
    requests: list[ReadRequest]  # reads in flight; empty once landed
    weights: Weights | None  # set once landed
    prefetched: bool  # read by prefetch, not asked for by a fetch since
    started: int  # how many entries' reads the cache had started before this one's: orders a fetch's landing
    copied: Event | None = None  # the last copy from its buffer to the device (staged path)


class ExpertCache:
    """Every routed expert of the model, `slots` of them on the device at a time (see the module docstring).

    layouts: (layer, expert) -> the expert's read plan, tensors named "gate_proj", "up_proj", "down_proj" (and
    "*.scales"); budget: bytes of the device tier this cache may take (its buffers are all taken here).
    """

    def __init__(
        self,
        layouts: dict[Key, GroupLayout],
        backend: ReadBackend,
        tier: MemoryTier,
        budget: int,
        dtype: torch.dtype,
        flag: str = "--expert-cache-memory",
    ) -> None:
        self.layouts, self.backend, self.tier, self.dtype, self.budget = layouts, backend, tier, dtype, budget
        read_bytes = max(g.slot_bytes for g in layouts.values())
        convert_bytes = max(_convert_bytes(g, dtype) for g in layouts.values())
        self.slot_cost = slot_cost(layouts, tier, dtype)  # bytes
        self.slots = budget // self.slot_cost
        if self.slots == 0:
            raise OffloadError(f"{flag} of {budget} bytes holds no expert (one expert takes {self.slot_cost} bytes)")
        what = f"the expert cache ({flag})"
        # page-locked by the read backend where it reads into those without a bounce copy (tiers/weights/landing.py):
        # else every miss in flight held a locked copy of its expert beside its slot (8 at a prefill's layer)
        self._landing = LandingBuffers(tier, backend, read_bytes, self.slots, what)
        self._bufs = self._landing.buffers
        self._scratch = [take(tier, convert_bytes, what, flag) if convert_bytes else None for _ in range(self.slots)]
        self._free = list(range(self.slots - 1, -1, -1))  # slot indices; pop() takes the lowest
        self._entries: dict[Key, _Entry] = {}
        # the cached experts by selection count, then layer: where `_slot` looks for the lowest-ranked one without
        # scanning every entry (a fine-grained mixture caches thousands; DeepSeek-V3 misses ~8 a layer per token)
        self._by_count: dict[int, dict[int, set[int]]] = {}
        self._starts = 0  # entries whose reads were started, over the whole run
        self._experts: dict[int, list[int]] = {}  # layer -> its experts, ascending
        for layer, e in sorted(layouts):
            self._experts.setdefault(layer, []).append(e)
        self._cycle = max(self._experts) + 1  # layers in the cycle
        self.selections: Counter[Key] = Counter()  # fetches that asked for each expert, over the whole run
        self._pinned: set[Key] = set()  # what the last start asked for
        self._layer = 0  # the layer of the last start
        self._ahead: set[Key] = set()  # guessed experts of layers not started since the guess
        self._stats = dict.fromkeys((f.name for f in fields(ExpertStats)), 0)
        self._stats["stall_seconds"] = 0.0

    @property
    def stats(self) -> ExpertStats:
        return ExpertStats(**self._stats)

    def cached(self) -> list[Key]:
        """The experts in the cache (landed or being read), in key order."""
        return sorted(self._entries)

    def fetch(self, layer: int, experts: list[int]) -> Mapping[int, Weights]:
        """The weights of `experts` of `layer` (at most `slots` of them), usable until the next fetch: `start`, then
        `land`."""
        self.start(layer, experts)
        return self.land(layer, experts)

    def start(self, layer: int, experts: list[int], on_device: list[int] = ()) -> None:
        """Begin a fetch of `experts` of `layer` (at most `slots` of them): count the selection, pin the experts
        (released by the next start) and start every miss's reads, none waited for. `on_device`: more experts of
        the fetch, found in the device slots (staged path): counted as selected and hit, not looked up here."""
        if len(experts) > self.slots:
            raise ValueError(f"fetch of {len(experts)} experts from a cache of {self.slots} slots")
        keys = [(layer, e) for e in experts]
        self._pinned = set(keys)
        self._layer = layer
        self._ahead = {k for k in self._ahead if k[0] != layer}  # this layer's guesses are settled now
        selected = [*keys, *((layer, e) for e in on_device)]
        cached = [k for k in selected if k in self._entries]
        for k in cached:
            self._unindex(k)
        self.selections.update(selected)
        for k in cached:
            self._index(k)
        self._stats["hits"] += len(on_device)
        self._stats["device_hits"] += len(on_device)
        for k in keys:
            entry = self._entries.get(k)
            if entry is None:
                self._stats["misses"] += 1
                self._start(k, self._slot(self._pinned, None), prefetched=False)
            else:
                self._stats["hits"] += 1
                self._stats["prefetch_used"] += entry.prefetched
                entry.prefetched = False

    def land(self, layer: int, experts: list[int]) -> Mapping[int, Weights]:
        """The weights of `experts` of `layer`, as the last `start` asked for them. The mapping waits for an
        expert's reads only when it is looked up, and its order is the order to run them in: those landed first,
        then by when their reads started; so compute on the ready ones overlaps the reads of the rest."""
        entries = {e: self._entries[(layer, e)] for e in experts}
        order = sorted(experts, key=lambda e: (bool(entries[e].requests), entries[e].started))
        return _Landing(self, order, layer)

    def prefetch(self, layer: int, experts: list[int], guess: bool = False) -> None:
        """Start reading those of `experts` of `layer` not cached, without waiting. Each takes a free slot, or the
        slot of an expert selected less often than it; one that finds neither is skipped. A `guess` (the next
        layer's router's choice) may take any slot the last start did not pin and no other guess holds, and is
        itself kept from other prefetches and, while another slot can be taken, from misses until its layer's
        next start."""
        for e in experts:
            k = (layer, e)
            if k in self._entries:
                if guess:
                    self._ahead.add(k)
                continue
            slot = self._slot(self._pinned | self._ahead, None if guess else self.selections[k])
            if slot is None:
                continue
            self._start(k, slot, prefetched=True)
            self._stats["prefetches"] += 1
            if guess:
                self._ahead.add(k)

    def landed(self, layer: int, expert: int) -> bool:
        """Whether a cached expert's reads were waited for already (a lookup would not wait)."""
        return not self._entries[(layer, expert)].requests

    def weights(self, layer: int, expert: int) -> Weights:
        """A fetched expert's weights where this cache holds them, in the compute dtype (waits for its reads)."""
        key = (layer, expert)
        return self._land(key, self._entries[key])

    def raw(self, layer: int, expert: int) -> torch.Tensor:
        """The buffer a fetched expert was read into, as read (waits for its reads): what a copy to the device
        takes (staged path); `copied` must then be told the copy's event."""
        key = (layer, expert)
        entry = self._entries[key]
        self._wait_reads(entry)
        return self._bufs[entry.slot]

    def copied(self, layer: int, expert: int, event: Event, nbytes: int) -> None:
        """A copy of `nbytes` from the expert's buffer (`raw`) ends at `event`: the buffer takes no new read before."""
        self._entries[(layer, expert)].copied = event
        self._stats["h2d_bytes"] += nbytes

    def count(self, name: str, n: int = 1) -> None:
        """Add n to one of the ExpertStats counters (the staged path's device level counts here too)."""
        self._stats[name] += n

    def rank(self, key: Key) -> tuple:
        """An expert's place in the eviction order, lowest first: selected least often, then the layer that comes
        back last in the layer cycle (the device slots evict by it too)."""
        # the current layer's experts come back after all the others'
        return self.selections[key], -((key[0] - self._layer - 1) % self._cycle), key

    def predict(self, layer: int, n: int) -> list[int]:
        """The (at most n) experts of `layer` selected most often so far, most often first (ties: lower number);
        never-selected experts are not predicted."""
        ranked = sorted(self._experts.get(layer, []), key=lambda e: (-self.selections[(layer, e)], e))
        return [e for e in ranked[:n] if self.selections[(layer, e)]]

    def settle(self) -> None:
        """Wait for reads in flight (prefetches), so that the backend's byte counters include them."""
        for entry in self._entries.values():
            for r in entry.requests:
                r.wait()
            entry.requests = []

    def close(self) -> None:
        """Wait for reads in flight (their buffers must outlive them), then give the slots back."""
        self.settle()
        self._landing.close()

    # ---- internals ---------------------------------------------------------------------------------

    def _slot(self, keep: set[Key], below: int | None) -> int | None:
        """A free slot, else the slot of the least frequently selected expert outside `keep` (of those, the one whose
        layer comes back last: the lowest `rank`), evicted; with `below` (a prefetch), only one selected fewer than
        `below` times and not guessed ahead. Without `below` (a miss), a guessed expert goes only when nothing else
        can. None when there is none."""
        if self._free:
            return self._free.pop()
        victim = self._lowest(keep | self._ahead, below)
        if victim is None and below is None:
            victim = self._lowest(keep, None)
        if victim is None:
            return None
        self._ahead.discard(victim)
        self._unindex(victim)
        entry = self._entries.pop(victim)
        for r in entry.requests:  # a prefetch still landing in the buffer
            r.wait()
        if entry.copied is not None:  # a copy to the device still reading it
            entry.copied.synchronize()
        return entry.slot

    def _lowest(self, excluded: set[Key], below: int | None) -> Key | None:
        """The cached expert of lowest `rank` outside `excluded` (selected fewer than `below` times, if given)."""
        for count in sorted(self._by_count):
            if below is not None and count >= below:
                return None
            layers = self._by_count[count]
            for back in range(self._cycle):  # the current layer's experts come back last, then the one before it
                layer = (self._layer - back) % self._cycle
                free = [e for e in layers.get(layer, ()) if (layer, e) not in excluded]
                if free:
                    return layer, min(free)
        return None

    def _index(self, key: Key) -> None:
        self._by_count.setdefault(self.selections[key], {}).setdefault(key[0], set()).add(key[1])

    def _unindex(self, key: Key) -> None:
        count = self.selections[key]
        layers = self._by_count[count]
        layers[key[0]].discard(key[1])
        if not layers[key[0]]:
            del layers[key[0]]
            if not layers:
                del self._by_count[count]

    def _start(self, key: Key, slot: int, prefetched: bool) -> None:
        layout = self.layouts[key]
        self._entries[key] = _Entry(slot, read(self.backend, layout, self._bufs[slot]), None, prefetched, self._starts)
        self._index(key)
        self._starts += 1
        self._stats["bytes_read"] += layout.read_bytes

    def _wait_reads(self, entry: _Entry) -> None:
        if entry.requests:
            start = time.perf_counter()
            for r in entry.requests:
                r.wait()
            self._stats["stall_seconds"] += time.perf_counter() - start
            entry.requests = []

    def _land(self, key: Key, entry: _Entry) -> Weights:
        if entry.weights is None:
            self._wait_reads(entry)
            views = self.layouts[key].views(self._bufs[entry.slot])
            entry.weights = _converted(views, self.dtype, self._scratch[entry.slot])
        return entry.weights


class _Landing(Mapping[int, Weights]):
    """A fetch's experts (ExpertCache.land): each landed when looked up, iterated in the order to run them."""

    def __init__(self, cache: ExpertCache, order: list[int], layer: int) -> None:
        self._cache, self._order, self._layer = cache, order, layer

    def __getitem__(self, expert: int) -> Weights:
        if expert not in self._order:
            raise KeyError(expert)
        return self._cache.weights(self._layer, expert)

    def __iter__(self) -> Iterator[int]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


def slot_cost(layouts: dict[Key, GroupLayout], tier: MemoryTier, dtype: torch.dtype) -> int:
    """Bytes of `tier` one slot of an ExpertCache over `layouts` takes: the largest expert as read, and the scratch
    its tensors stored in another float dtype take converted to `dtype`."""
    read_bytes = max(g.slot_bytes for g in layouts.values())
    convert_bytes = max(_convert_bytes(g, dtype) for g in layouts.values())
    return tier.footprint(read_bytes) + (tier.footprint(convert_bytes) if convert_bytes else 0)


_CONVERT_ALIGN = 64  # bytes; each converted tensor starts at a multiple of this in the slot's scratch buffer


def _needs_convert(code: str, dtype: torch.dtype) -> bool:
    stored = TORCH_DTYPES[code][0]
    return stored.is_floating_point and stored != dtype


def _convert_bytes(layout: GroupLayout, dtype: torch.dtype) -> int:
    """Bytes of scratch the tensors of `layout` stored in another float dtype take converted to `dtype`."""
    converted = [t.nbytes // TORCH_DTYPES[t.dtype][1] * dtype.itemsize for t in layout.tensors]
    return sum(_rounded(n) for n, t in zip(converted, layout.tensors, strict=True) if _needs_convert(t.dtype, dtype))


def _rounded(nbytes: int) -> int:
    return -(-nbytes // _CONVERT_ALIGN) * _CONVERT_ALIGN


def _converted(views: Weights, dtype: torch.dtype, scratch: torch.Tensor | None) -> Weights:
    """`views` with float tensors of another dtype copied, converted to `dtype`, into `scratch`."""
    out, offset = {}, 0
    for name, view in views.items():
        if not view.dtype.is_floating_point or view.dtype == dtype:
            out[name] = view
            continue
        nbytes = view.numel() * dtype.itemsize
        target = scratch[offset : offset + nbytes].view(dtype).reshape(view.shape)
        out[name] = target.copy_(view)
        offset += _rounded(nbytes)
    return out
