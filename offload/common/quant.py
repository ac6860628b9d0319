"""How a checkpoint's linear weights are quantized: config.json's `quantization_config`, as `offload convert` writes
it and the engine runs it (the math and the layouts are kernels/quant_matmul.py's and kernels/quant_linear.py's)."""

from __future__ import annotations

from dataclasses import dataclass, field

from offload.common.errors import OffloadError

QUANT_METHOD = "offload"  # config.json's quantization_config.quant_method for checkpoints `offload convert` writes
BITS = (4, 8)
# gguf: the matrices as a GGUF file holds them, Q4_0, Q4_1 or Q8_0 blocks read in place (kernels/gguf_linear.py,
# offload/gguf/in_place.py); bits and group_size then say 4 and 32 (the blocks' own)
LAYOUTS = ("cpu", "triton", "gguf")
GROUP_SIZES = (32, 64, 128)
MIN_GROUP = 32  # an input width no group size divides down to this stays unquantized


@dataclass(frozen=True, slots=True)
class WeightQuant:
    """How a checkpoint's linear weights are quantized (config.json's quantization_config)."""

    bits: int  # 4 | 8
    group_size: int  # input features sharing a scale: 32 | 64 | 128, or 0 for one scale per output channel
    layout: str  # "cpu" | "triton"
    # checkpoint names of projection weights ("model.layers.3.mlp.down_proj.weight") kept in a float dtype: a GGUF
    # import keeps there the matrices this format cannot hold exactly (offload/gguf/importer.py)
    unquantized: frozenset[str] = field(default=frozenset())
    # gguf: each head's q and k rows in llama.cpp's interleaved order ([head_dim / 2, 2] where Hugging Face has
    # [2, head_dim / 2]); the model puts their products back in Hugging Face's order before the rotary
    interleaved_qk: bool = False
    # gguf: bits a weight of the layer matrices takes as stored, their scales included (Q4_0 4.5, Q4_1 5, Q8_0 8.5)
    stored_bits: float = 0.0
    # gguf read in place: bits a weight of the token table and of the head as the engine holds them, their file's
    # blocks (0: a float tensor, held in the compute dtype)
    embed_bits: float = 0.0
    head_bits: float = 0.0

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {BITS}, got {self.bits!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.group_size not in (0, *GROUP_SIZES):
            raise ValueError(f"group_size must be one of {GROUP_SIZES} (or 0: per channel), got {self.group_size!r}")
        if self.bits == 4 and self.group_size == 0:
            raise ValueError("int4 needs a group size (32, 64 or 128): one scale per channel loses too much")
        if self.layout == "gguf" and (self.bits, self.group_size) != (4, 32):
            raise ValueError(
                f"the gguf layout is bits 4, group_size 32 (its blocks'), got {self.bits}, {self.group_size}"
            )
        if self.bits == 8 and self.layout == "cpu" and self.group_size != 0:
            raise ValueError(
                "int8 in the cpu layout has one scale per output channel (torch's int8 CPU matmul takes one per row); "
                "use the triton layout for group-wise int8"
            )

    @property
    def name(self) -> str:
        group = "channel" if self.group_size == 0 else f"g{self.group_size}"
        return f"int{self.bits}-{group}-{self.layout}"

    @property
    def code_dtype(self) -> str:
        """The safetensors dtype code of the stored codes."""
        return "U8" if self.bits == 4 else "I8"

    def group(self, in_features: int) -> int | None:
        """The group size used for a weight with `in_features` inputs: the configured one, halved until it divides
        them (down to MIN_GROUP); None when none does (the weight stays in its float dtype)."""
        if self.group_size == 0:
            return in_features
        g = self.group_size
        while g >= MIN_GROUP:
            if in_features % g == 0:
                return g
            g //= 2
        return None

    def codes_shape(self, out_features: int, in_features: int) -> tuple[int, ...]:
        return (out_features, in_features // 2) if self.bits == 4 else (out_features, in_features)

    def scales_shape(self, out_features: int, in_features: int) -> tuple[int, ...]:
        groups = in_features // self.group(in_features)
        return (groups, out_features, 2) if self.bits == 4 else (groups, out_features)


def parse_quant(config: dict, source: str) -> WeightQuant | None:
    """The weights' quantization: only this engine's own format (`offload convert`) runs."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise OffloadError(f"{source}: field 'quantization_config' must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != QUANT_METHOD:
        raise OffloadError(
            f"{source}: quantization_config.quant_method {method!r} is not run by this engine (it runs its own "
            f"{QUANT_METHOD!r} checkpoints: `offload convert --model DIR --quant int4|int8 --out DIR` quantizes a "
            "float checkpoint; docs/quantization.md says why GPTQ and AWQ files are not read)"
        )
    unquantized = q.get("unquantized", [])
    if not isinstance(unquantized, list) or not all(isinstance(n, str) for n in unquantized):
        raise OffloadError(
            f"{source}: quantization_config.unquantized must be a list of tensor names, got {unquantized!r}"
        )
    try:
        extra = {"interleaved_qk": bool(q.get("interleaved_qk", False))}
        extra |= {k: float(q.get(k, 0)) for k in ("stored_bits", "embed_bits", "head_bits")}
        return WeightQuant(q["bits"], q["group_size"], q["layout"], frozenset(unquantized), **extra)
    except KeyError as exc:
        raise OffloadError(f"{source}: quantization_config has no field {exc.args[0]!r}") from None
    except (ValueError, TypeError) as exc:
        raise OffloadError(f"{source}: quantization_config: {exc}") from None
