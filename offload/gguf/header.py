"""A GGUF file's shape for `offload plan`, from its header and tensor table alone: the ModelSpec the engine runs
(config.json as offload/gguf/in_place.py writes it for a file run in place, else as offload/gguf/importer.py's import
writes it) and its weights' bytes as the file stores them. No weight is
read, nothing is imported and nothing is written, so planning a file of many GB takes seconds."""

from __future__ import annotations

import re
from pathlib import Path

from gguf import GGUFReader

from offload.common.model_config import ModelSpec, parse_model_config
from offload.gguf.importer import import_shape, local_layout
from offload.gguf.in_place import in_place_config
from offload.gguf.metadata import open_gguf
from offload.planner.models import StoredType, StoredWeights

LAYER = re.compile(r"^blk\.\d+\.")
HEAD = ("output.", "output_norm.")


def gguf_shape(path: Path) -> tuple[ModelSpec, StoredWeights]:
    """The spec of the model in GGUF file `path` and its weights as stored; an OffloadError where the import would
    refuse the file. Imported bytes 0: the file runs in place."""
    reader = open_gguf(path)
    config, imported = in_place_config(reader, path), 0
    if config is None:
        config, imported = import_shape(reader, path, local_layout())
    return parse_model_config(config, str(path), name=path.stem), stored_weights(reader, path, imported)


def stored_weights(reader: GGUFReader, path: Path, imported_bytes: int) -> StoredWeights:
    """The bytes of `reader`'s tensors by type, and its largest unit (embeddings, a decoder layer or the head)."""
    by_type: dict[str, list[int]] = {}
    units = {"embeddings": 0, "decoder layer": 0, "head": 0}
    layers: dict[str, int] = {}
    for t in reader.tensors:
        nbytes = int(t.n_bytes)
        kind = by_type.setdefault(t.tensor_type.name, [0, 0])
        kind[0] += nbytes
        kind[1] += int(t.n_elements)
        if m := LAYER.match(t.name):
            layers[m[0]] = layers.get(m[0], 0) + nbytes
        elif t.name.startswith("token_embd."):
            units["embeddings"] += nbytes
        elif t.name.startswith(HEAD):
            units["head"] += nbytes
    units["decoder layer"] = max(layers.values(), default=0)
    largest = max(units, key=units.__getitem__)  # ties go to the first, as estimate_sizes' do
    types = sorted((StoredType(n, b, w) for n, (b, w) in by_type.items()), key=lambda t: (-t.nbytes, t.name))
    return StoredWeights(path.name, tuple(types), units[largest], largest, imported_bytes)
