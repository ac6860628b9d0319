"""Weight placement and the prefetch pipeline.

Every decoder layer lives in one tier (a `Policy`): "device" layers are read once and stay on the compute
device; "host" layers are read once into host RAM; "nvme" layers are read on every pass from the checkpoint
files, or from --offload-dir's converted spill files (tiers/spill/spilling.py) when the checkpoint stores them in
another dtype. The head stays on the device, and so does the embedding, unless the policy leaves it in storage
(tiers/weights/embedding.py: a step then reads its tokens' rows). The engine asks for layers in order with `acquire` and
hands them back with `release`; layers off the device pass through a ring of buffers (tiers/weights/ring.py) that
reads and copies them ahead of compute, wrapping around to the first ones of the next step, so memory never
grows with model size or run length, and resident layers are never read again.

Two paths, chosen by the device. Direct (a CPU device): NVMe reads land straight in device slots, and host
layers are computed from where they were read. Staged (a CUDA device, or any device when asked): every byte
reaches the device through pinned host RAM and the copy engine (tiers/copy.py): a streamed layer goes NVMe ->
pinned staging slot -> device slot, a host layer is copied from its pinned buffer every pass, and tensors stored
in another dtype are converted on the device after their copy. Bytes read from disk and bytes copied host ->
device are both counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from offload.common.config import Policy
from offload.common.errors import OffloadError
from offload.common.progress import Progress
from offload.common.tier import Tier
from offload.kernels.linear import pack_weight, packing_pays
from offload.kernels.quant_linear import SCALES_SUFFIX
from offload.tiers.copy import CopyEngine, make_copy_engine
from offload.tiers.device import DeviceTier
from offload.tiers.host import HostTier
from offload.tiers.io.base import ReadBackend
from offload.tiers.memory import MemoryTier
from offload.tiers.weights.checkpoint import TORCH_DTYPES, held_dtype
from offload.tiers.weights.embedding import HEAD, TABLE, StoredEmbedding
from offload.tiers.weights.layout import CONVERT_PIECE, GroupLayout, ModelLayout, Weights, load_buffer_bytes
from offload.tiers.weights.ring import DirectRing, Ring, StagedRing, convert, read, take
from offload.tiers.weights.slot import slot_layout


@dataclass(frozen=True, slots=True)
class WeightStats:
    resident_bytes: int  # bytes of weights held on the device for the whole run
    host_bytes: int  # bytes of weights held in host RAM for the whole run
    streamed_bytes_per_pass: int  # bytes read from storage for one pass over the layers
    h2d_bytes_per_pass: int  # bytes copied host -> device for one pass (staged path; 0 on the direct one)
    embed_rows_read: int  # token rows read from storage so far (a stored embedding; 0 when it is resident)
    bytes_read: int  # bytes read from the checkpoint so far (loading and streaming)
    h2d_bytes: int  # bytes copied host -> device so far (loading and streaming)
    read_seconds: float  # wall time with at least one read in flight
    stall_seconds: float  # time the engine waited in acquire() for a read


class WeightStore:
    """Every weight tensor where the policy puts it, and the ring the others pass through (see the module docstring).

    staged: None takes the staged path exactly when the device is not the CPU; True forces it on the CPU too
    (the same code then runs with synchronous copies, which is how it is tested on CPU-only machines).
    prepack: on the direct CPU path, pack resident matrices for the GEMM (kernels.linear.pack_weight); None does
    where kernels.linear.packing_pays measured it faster. Streamed layers stay dense: they change every pass.
    fuse: on the direct CPU path, what becomes of a resident layer's weights (the family's stacking of projections
    that share an input: new tensors, charged in place of the read buffer); streamed layers keep theirs.
    packable: which float matrices (by short name) `prepack` may pack: those the family multiplies as linear
    weights [out, in] (None: every one).
    shared: on the direct CPU path, the embedding's and head's groups ("embed", "head": their tensors by short name)
    as another store of the same weights holds them (a `self` draft's, offload/draft_core.py): taken as they are and
    charged to the device tier, not read (the table then stays resident: place_weights' `table_held`).
    """

    def __init__(
        self,
        layout: ModelLayout,
        backend: ReadBackend,
        policy: Policy,
        device_tier: DeviceTier,
        host_tier: HostTier,
        dtype: torch.dtype,
        staged: bool | None = None,
        prepack: bool | None = None,
        embed_backend: ReadBackend | None = None,
        fuse: Callable[[Weights], Weights] | None = None,
        packable: Callable[[str], bool] | None = None,
        shared: dict[str, Weights] | None = None,
    ) -> None:
        if len(policy.layer_tiers) != len(layout.layers):
            raise ValueError(f"policy places {len(policy.layer_tiers)} layers, the model has {len(layout.layers)}")
        self.backend, self.policy, self.dtype = backend, policy, dtype
        self.device_tier, self.host_tier = device_tier, host_tier
        self.device = device_tier.device
        self.staged = self.device.type != "cpu" if staged is None else staged
        if not self.staged and self.device.type != "cpu":
            raise ValueError(f"reads land in device memory only on a CPU device, not on {self.device}: use staged")
        self.copier: CopyEngine | None = make_copy_engine(self.device) if self.staged else None
        # resident matrices packed for the CPU's GEMM (None: wherever kernels.linear measures that it pays)
        cpu_direct = not self.staged and self.device.type == "cpu"
        self.prepack = cpu_direct and (packing_pays(dtype) if prepack is None else prepack)
        self.packable = packable or (lambda name: True)
        self.stall_seconds = 0.0  # time spent waiting for reads while loading
        self.h2d_bytes = 0  # bytes copied host -> device while loading
        self.layouts = layout.layers
        # direct path: on a CPU device host RAM is what the compute reads, so a host layer needs no copy
        kept = (Tier.DEVICE,) if self.staged else (Tier.DEVICE, Tier.HOST)
        resident = [i for i, t in enumerate(policy.layer_tiers) if t in kept]
        ring = {i: g for i, g in enumerate(self.layouts) if i not in resident}
        if ring and policy.ring_slots < 2:  # the Policy checks this for "nvme" layers, not for staged "host" ones
            raise OffloadError(
                f"policy: on {self.device} layers kept in host RAM pass through the device ring, which needs at "
                f"least 2 slots, got {policy.ring_slots}"
            )
        # the token table stays in storage (tiers/weights/embedding.py) where the policy says; else it loads first
        self.embed_backend = embed_backend or backend  # what reads the rows of a table left in storage
        self.table: StoredEmbedding | None = None
        if policy.embed_tier == Tier.NVME:
            rows_tier = device_tier if not self.staged else host_tier  # where its reads land
            self.table = StoredEmbedding(layout.embed, self.embed_backend, rows_tier, dtype, self.device)
        groups = [layout.head, *(self.layouts[i] for i in resident)]
        if self.table is None:
            groups.insert(0, layout.embed)
        given = self._shared(layout, shared or {})  # by group: taken from another store, not read
        progress = Progress("loading", sum(g.slot_bytes for g in groups if id(g) not in given))
        try:
            if self.staged:
                loaded = self._load_staged(groups, progress)
            else:
                tiers = [device_tier, *(self._tier(policy.layer_tiers[i]) for i in resident)]
                # layers may be packed for the CPU's GEMM; the head stays dense, its logits float32 (kernels.linear)
                packs = [False] + [self.prepack] * len(resident)
                fuses = [None] + [fuse] * len(resident)  # the layers', not the head's
                if self.table is None:  # the embedding is a table of rows, not a product
                    tiers, packs, fuses = [device_tier, *tiers], [False, *packs], [None, *fuses]
                loaded = []
                for group, *how in zip(groups, tiers, packs, fuses, strict=True):
                    if id(group) in given:
                        loaded.append(given[id(group)])
                        continue
                    loaded.append(self._load_direct(group, *how))
                    progress.advance(group.slot_bytes)
        finally:
            progress.close()
        self.embed: Weights = loaded.pop(0) if self.table is None else {}
        self.head, *layers = loaded
        if self.table is None:
            self.head.setdefault(HEAD, self.embed[TABLE])  # tied embeddings
        self._resident: dict[int, Weights] = dict(zip(resident, layers, strict=True))
        self._ring: Ring
        if self.staged:
            tiers = {i: policy.layer_tiers[i] for i in ring}
            self._ring = StagedRing(ring, tiers, backend, self.copier, device_tier, host_tier, dtype, policy.ring_slots)
        else:
            self._ring = DirectRing(ring, backend, device_tier, dtype, policy.ring_slots)

    def _shared(self, layout: ModelLayout, shared: dict[str, Weights]) -> dict[int, Weights]:
        """The groups of `shared` (by id of the group's layout), each tensor charged to the device tier. Each must be
        one this store holds resident on the direct path, every tensor given in the shape and dtype it would load
        (else ValueError: the caller charged its budget for weights this store would not take)."""
        groups = {"head": layout.head, "embed": layout.embed}
        taken: dict[int, Weights] = {}
        for name, given in shared.items():
            group = groups[name]
            tensors = {t.short: given.get(t.short) for t in group.tensors}
            fits = all(
                (g := tensors[t.short]) is not None
                and g.dtype == held_dtype(t.dtype, self.dtype)
                and tuple(g.shape) == tuple(t.shape)
                for t in group.tensors
            )
            if self.staged or (name == "embed" and self.table is not None) or not fits:
                raise ValueError(f"a shared {name} group is taken resident, on the direct path, as this store loads it")
            for short, t in tensors.items():
                if not self.device_tier.adopt(t):
                    raise OffloadError(
                        f"--device-memory budget of {self.device_tier.capacity} bytes cannot hold {short} "
                        f"({t.numel() * t.element_size()} bytes)"
                    )
            taken[id(group)] = tensors
        return taken

    def _tier(self, name: str) -> MemoryTier:
        return self.device_tier if name == Tier.DEVICE else self.host_tier

    def _load_direct(
        self, layout: GroupLayout, tier: MemoryTier, prepack: bool, fuse: Callable[[Weights], Weights] | None
    ) -> Weights:
        """Read a group once into `tier` and keep it; tensors in another dtype are converted (charged to `tier`).
        With `fuse`, its weights become what `fuse` makes of them; with `prepack`, its matrices are packed for
        `kernels.linear`. Either way the tensors leave the read buffer, which goes."""
        buf = None
        if load_buffer_bytes(layout, self.dtype) < layout.slot_bytes:  # converted a piece at a time
            out = self._load_converting(layout, tier)
        else:
            buf = take(tier, layout.slot_bytes, "resident weights")
            self._wait(read(self.backend, layout, buf))
            out = convert(layout.views(buf), self.dtype, tier, keep=[])
        fused = fuse(out) if fuse is not None else out
        packable = self._packable if prepack else None
        if fused.keys() != out.keys() or packable and any(packable(n, t) for n, t in fused.items()):
            return _rehomed(out, fused, buf, tier, packable)
        base = None if buf is None else buf.untyped_storage().data_ptr()
        if buf is not None and all(t.untyped_storage().data_ptr() != base for t in out.values()):
            tier.free(buf)  # every tensor was converted: the read buffer is garbage, and must not stay charged
        return out

    def _packable(self, name: str, t: torch.Tensor) -> bool:
        return _packable(name, t) and self.packable(name)

    def _load_converting(self, layout: GroupLayout, tier: MemoryTier) -> Weights:
        """A group whose every tensor converts to the compute dtype, read through a buffer of CONVERT_PIECE bytes:
        each piece converted into the tensor's place before the next is read, so that loading never holds the
        stored copy of the group beside the converted one (a float32 table of 113 MB run in bfloat16: 57 MB)."""
        staging = take(tier, load_buffer_bytes(layout, self.dtype), "a buffer converting resident weights")
        out: Weights = {}
        try:
            for t in layout.tensors:
                stored = TORCH_DTYPES[t.dtype][0]
                dest = torch.empty(t.shape, dtype=self.dtype)
                if not tier.adopt(dest):
                    raise OffloadError(
                        f"--{tier.name}-memory budget of {tier.capacity} bytes cannot hold {t.short} converted to "
                        f"{str(self.dtype).removeprefix('torch.')} ({dest.numel() * dest.element_size()} bytes)"
                    )
                path, offset = layout.file_offset(t)
                flat, per = dest.view(-1), CONVERT_PIECE // stored.itemsize
                for start in range(0, flat.numel(), per):
                    end = min(start + per, flat.numel())
                    request = self.backend.submit(
                        path, offset + start * stored.itemsize, (end - start) * stored.itemsize, staging
                    )
                    self._wait([request])
                    raw = request.wait()  # bytes; a piece that starts off the dtype's alignment is copied first
                    flat[start:end] = (raw.clone() if raw.storage_offset() % stored.itemsize else raw).view(stored)
                out[t.short] = dest
        finally:
            tier.free(staging)
        return out

    def _load_staged(self, groups: list[GroupLayout], progress: Progress) -> list[Weights]:
        """Read groups once, one at a time, through a pinned staging buffer into packed device buffers."""
        packed = [slot_layout(g, self.dtype) for g in groups]
        staging = take(self.host_tier, max(g.slot_bytes for g in groups), "a staging buffer for loading weights")
        convert_bytes = max(p.convert_bytes for p in packed)
        scratch = take(self.device_tier, convert_bytes, "a buffer for dtype conversion") if convert_bytes else None
        try:
            out = []
            for group, p in zip(groups, packed, strict=True):
                buf = take(self.device_tier, p.nbytes, "resident weights")
                self._wait(read(self.backend, group, staging))
                self.copier.copy(p.copies(staging, buf, scratch)).synchronize()  # the staging buffer is reused next
                self.h2d_bytes += p.copy_bytes
                out.append(p.views(buf))
                progress.advance(group.slot_bytes)
            return out
        finally:
            self.copier.synchronize()
            self.host_tier.free(staging)
            if scratch is not None:
                self.device_tier.free(scratch)

    def _wait(self, requests: list) -> None:
        start = time.perf_counter()
        for r in requests:
            r.wait()
        self.stall_seconds += time.perf_counter() - start

    # ---- the engine's verbs ----------------------------------------------------------------------

    def embedding(self, token_ids: list[torch.Tensor]) -> tuple[Weights, list[torch.Tensor]]:
        """The embedding weights that a step's token ids (one tensor per micro-batch) index, and the ids to index
        them with: the resident table and the ids as given, or the distinct rows read from storage for them and
        each token's row among those."""
        if self.table is None:
            return self.embed, token_ids
        rows, index = self.table.lookup(torch.cat(token_ids))
        return {TABLE: rows}, list(index.split([len(t) for t in token_ids]))

    @property
    def resident(self) -> dict[int, Weights]:
        """The layers kept in memory for the whole run, by index: their weights as computed with."""
        return dict(self._resident)

    def acquire(self, layer: int) -> Weights:
        """Layer `layer`'s weights on the device, usable by compute issued from now on; waits only if its read is
        not done yet (a copy is waited for by the compute stream, not by the host)."""
        if layer in self._resident:
            return self._resident[layer]
        return self._ring.acquire(layer)

    def release(self, layer: int) -> None:
        """The engine has issued the last compute that reads `layer` this step: its slot may be refilled after it."""
        if layer not in self._resident:
            self._ring.release(layer)

    def settle(self) -> None:
        """Wait for reads and copies in flight, so that `stats` counts them; streaming goes on afterwards."""
        self._ring.settle()

    def close(self) -> None:
        """Wait for reads and copies in flight (their buffers must outlive them)."""
        self._ring.close()
        if self.table is not None:
            self.table.close()

    @property
    def stats(self) -> WeightStats:
        def total(tier: str) -> int:
            return sum(self.layouts[i].tensor_bytes for i, t in enumerate(self.policy.layer_tiers) if t == tier)

        # by object: a tied head is the embedding itself, and a packed weight has no data pointer
        fixed = {id(t): t.numel() * t.element_size() for t in (*self.embed.values(), *self.head.values())}
        streamed = [i for i, t in enumerate(self.policy.layer_tiers) if t == Tier.NVME]
        copied = [i for i in range(len(self.layouts)) if i not in self._resident] if self.staged else []
        return WeightStats(
            resident_bytes=total(Tier.DEVICE) + sum(fixed.values()),
            host_bytes=total(Tier.HOST),
            streamed_bytes_per_pass=sum(self.layouts[i].read_bytes for i in streamed),
            h2d_bytes_per_pass=sum(slot_layout(self.layouts[i], self.dtype).copy_bytes for i in copied),
            embed_rows_read=self.table.rows_read if self.table is not None else 0,
            bytes_read=self.backend.bytes_read
            + (self.embed_backend.bytes_read if self.embed_backend is not self.backend else 0),
            h2d_bytes=self.h2d_bytes + self._ring.h2d_bytes,
            read_seconds=self.backend.read_seconds,
            stall_seconds=self.stall_seconds + self._ring.stall_seconds,
        )


def _rehomed(
    loaded: Weights,
    weights: Weights,
    buf: torch.Tensor | None,
    tier: MemoryTier,
    prepack: Callable[[str, torch.Tensor], bool] | None,
) -> Weights:
    """`weights` (what became of `loaded`, views of `buf` and converted copies charged on their own; no buf: all
    converted) out of `buf`: the matrices `prepack` accepts packed by kernels.linear.pack_weight (None: none), the
    rest copied out of `buf`; charged to `tier` in place of `buf` and of the copies no longer kept."""
    base = buf.untyped_storage().data_ptr() if buf is not None else None
    out = {}
    for n, t in weights.items():
        if prepack and prepack(n, t):
            out[n] = pack_weight(t)
        else:
            out[n] = t.clone() if t.untyped_storage().data_ptr() == base else t
    kept = {id(t) for t in out.values()}
    charged = {id(t): t for t in loaded.values() if t.untyped_storage().data_ptr() != base}  # converted copies
    for t in charged.values():
        if id(t) not in kept:
            tier.free(t)  # replaced
    if buf is not None:
        tier.free(buf)
    for n, t in out.items():
        if id(t) not in charged and not tier.adopt(t):
            raise OffloadError(
                f"--{tier.name}-memory budget of {tier.capacity} bytes cannot hold {n} as the CPU multiplies it "
                f"({t.numel() * t.element_size()} bytes; {tier.used} already in use)"
            )
    return out


def _packable(name: str, t: torch.Tensor) -> bool:
    """A float weight matrix: what kernels.linear.pack_weight reorders (quantized weights and their scales keep the
    layout their matmul reads)."""
    return t.dim() == 2 and t.is_floating_point() and not name.endswith(SCALES_SUFFIX)
