"""gpt-oss: the Llama layer with biased attention projections, a learned attention sink per head, sliding and full
attention layers alternating (`layer_types`), YaRN rotary scaling, and a mixture of experts in every layer.

The mixture, as transformers' GptOssForCausalLM computes it:

    logits = router(x) + bias                   the chosen: top-k of the logits, weighted by their softmax
    gate_up = x @ W_gate_up[e] + b_gate_up[e]   [tokens, 2 x intermediate]: gate and up interleaved, column by column
    gate = min(gate, limit); up = clamp(up, -limit, limit)
    out = ((up + 1) * gate * sigmoid(alpha * gate)) @ W_down[e] + b_down[e]

The checkpoint stacks each matrix over the experts; each expert is read as its row of those tensors (TensorSpec.row),
so a layer streams whole or, with an expert cache, by expert like the other mixtures. Two forms:
- bfloat16 or float32, as transformers saves them: [experts, hidden, 2 x intermediate] and [experts, intermediate,
  hidden], input-major;
- MXFP4, as the published checkpoints store them (config.json's quantization_config says "mxfp4"):
  `*_blocks` [experts, out, in / 32, 16] and `*_scales` [experts, out, in / 32], 4.25 bits a weight, read and held
  as stored, each chosen expert's products run on its codes (kernels/mxfp4_linear.py: on CUDA a Triton kernel that
  decodes them in registers; elsewhere each matrix dequantized just before its product).
"""

from __future__ import annotations

import torch

from offload.common.model_config import ModelSpec
from offload.kernels.mxfp4 import BLOCK
from offload.kernels.mxfp4_linear import mxfp4_linear
from offload.model.llama import LlamaFamily
from offload.model.moe import routed_experts
from offload.model.registry import LayerInput
from offload.tiers.weights.checkpoint import TensorSpec
from offload.tiers.weights.layout import Weights

EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")  # one row each per expert
MXFP4_TENSORS = (
    *("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias"),
    *("down_proj_blocks", "down_proj_scales", "down_proj_bias"),
)


class GptOssFamily(LlamaFamily):
    def layer_tensors(self, spec: ModelSpec, layer: int) -> dict[str, TensorSpec]:
        t = super().layer_tensors(spec, layer)
        for name in ("gate_proj", "up_proj", "down_proj"):  # the dense MLP's
            del t[name]
        p, h = f"model.layers.{layer}.", spec.hidden_size
        t["sinks"] = TensorSpec(p + "self_attn.sinks", (spec.num_heads,))
        t["router"] = TensorSpec(p + "mlp.router.weight", (spec.num_experts, h))
        t["router_bias"] = TensorSpec(p + "mlp.router.bias", (spec.num_experts,))
        for e in range(spec.num_experts):
            for name, (shape, dtype) in expert_shapes(spec).items():
                t[f"expert{e}.{name}"] = TensorSpec(p + f"mlp.experts.{name}", shape, dtype, row=e)
        return t

    def packable(self, short: str) -> bool:
        return not short.startswith("expert")  # the experts' matrices are input-major: x @ W, not linear(x, W)

    def _mlp(
        self, spec: ModelSpec, layer: int, w: Weights, x: torch.Tensor, inp: LayerInput, hidden: torch.Tensor
    ) -> torch.Tensor:
        names = MXFP4_TENSORS if spec.mxfp4_experts else EXPERT_TENSORS
        return routed_experts(spec, w, x, inp.experts, hidden, x.dtype, clamped_swiglu, names)


def expert_shapes(spec: ModelSpec) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """One expert's tensors (its row of each stacked tensor): name -> (shape, safetensors dtype; None: any float)."""
    h, i = spec.hidden_size, spec.expert_size
    if not spec.mxfp4_experts:
        return {"gate_up_proj": ((h, 2 * i), None), "gate_up_proj_bias": ((2 * i,), None)} | {
            "down_proj": ((i, h), None),
            "down_proj_bias": ((h,), None),
        }
    out = {}
    for name, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
        out[f"{name}_blocks"] = ((rows, cols // BLOCK, BLOCK // 2), "U8")
        out[f"{name}_scales"] = ((rows, cols // BLOCK), "U8")
        out[f"{name}_bias"] = ((rows,), None)
    return out


def clamped_swiglu(spec: ModelSpec, w: Weights, x: torch.Tensor) -> torch.Tensor:
    """One gpt-oss expert over x [tokens, hidden] (module docstring): its matrices, input-major or in MXFP4 (output-
    major: kernels/mxfp4_linear.py, the Triton kernel reading the codes on CUDA, each dequantized whole elsewhere),
    and their biases."""
    if "gate_up_proj_blocks" in w:  # [tokens, 2 x intermediate]
        gate_up = mxfp4_linear(x, w["gate_up_proj_blocks"], w["gate_up_proj_scales"], w["gate_up_proj_bias"])
    else:
        gate_up = torch.addmm(w["gate_up_proj_bias"], x, w["gate_up_proj"])  # [tokens, 2 x intermediate]
    limit = spec.swiglu_limit
    gate, up = gate_up[:, ::2].clamp(max=limit), gate_up[:, 1::2].clamp(min=-limit, max=limit)
    glu = (up + 1) * (gate * torch.sigmoid(gate * spec.swiglu_alpha))
    if "down_proj_blocks" in w:
        return mxfp4_linear(glu, w["down_proj_blocks"], w["down_proj_scales"], w["down_proj_bias"])
    return torch.addmm(w["down_proj_bias"], glu, w["down_proj"])


FAMILY = GptOssFamily()
