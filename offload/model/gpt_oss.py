"""gpt-oss: the Llama layer with biased attention projections, a learned attention sink per head, sliding and full
attention layers alternating (`layer_types`), YaRN rotary scaling, and a mixture of experts in every layer.

The mixture, as transformers' GptOssForCausalLM computes it:

    logits = router(x) + bias                   the chosen: top-k of the logits, weighted by their softmax
    gate_up = x @ W_gate_up[e] + b_gate_up[e]   [tokens, 2 x intermediate]: gate and up interleaved, column by column
    gate = min(gate, limit); up = clamp(up, -limit, limit)
    out = ((up + 1) * gate * sigmoid(alpha * gate)) @ W_down[e] + b_down[e]

The checkpoint stacks each matrix over the experts, as transformers saves them ([experts, hidden, 2 x intermediate]
and [experts, intermediate, hidden], input-major); each expert is read as its row of those tensors
(TensorSpec.row), so a layer streams whole or, with an expert cache, by expert like the other mixtures. The published
MXFP4 experts are not read (config.json's quantization_config names them and is refused); a bfloat16 or float32
checkpoint runs.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from offload.common.model_config import ModelSpec
from offload.model.llama import LlamaFamily, project
from offload.model.moe import experts_forward
from offload.model.registry import LayerInput
from offload.tiers.checkpoint import TensorSpec
from offload.tiers.layout import Weights

EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")  # one row each per expert


class GptOssFamily(LlamaFamily):
    def layer_tensors(self, spec: ModelSpec, layer: int) -> dict[str, TensorSpec]:
        t = super().layer_tensors(spec, layer)
        for name in ("gate_proj", "up_proj", "down_proj"):  # the dense MLP's
            del t[name]
        p, h, i = f"model.layers.{layer}.", spec.hidden_size, spec.expert_size
        t["sinks"] = TensorSpec(p + "self_attn.sinks", (spec.num_heads,))
        t["router"] = TensorSpec(p + "mlp.router.weight", (spec.num_experts, h))
        t["router_bias"] = TensorSpec(p + "mlp.router.bias", (spec.num_experts,))
        shapes = dict(zip(EXPERT_TENSORS, ((h, 2 * i), (2 * i,), (i, h), (h,)), strict=True))
        for e in range(spec.num_experts):
            for name, shape in shapes.items():
                t[f"expert{e}.{name}"] = TensorSpec(p + f"mlp.experts.{name}", shape, row=e)
        return t

    def packable(self, short: str) -> bool:
        return not short.startswith("expert")  # the experts' matrices are input-major: x @ W, not linear(x, W)

    def _mlp(
        self, spec: ModelSpec, layer: int, w: Weights, x: torch.Tensor, inp: LayerInput, hidden: torch.Tensor
    ) -> torch.Tensor:
        def fetch(chosen: list[int], last: bool, rows: list[int]) -> Mapping[int, Weights]:
            if inp.experts is None:
                return {e: {name: w[f"expert{e}.{name}"] for name in EXPERT_TENSORS} for e in chosen}
            return inp.experts.fetch(chosen, hidden if last else None, rows)

        per_fetch = spec.num_experts if inp.experts is None else inp.experts.capacity
        logits = project(spec, w, "router", x, "router_bias")
        return experts_forward(spec, x, logits, fetch, x.dtype, per_fetch=per_fetch, expert=clamped_swiglu)


def clamped_swiglu(spec: ModelSpec, w: Weights, x: torch.Tensor) -> torch.Tensor:
    """One gpt-oss expert over x [tokens, hidden] (module docstring): w's input-major matrices and their biases."""
    gate_up = torch.addmm(w["gate_up_proj_bias"], x, w["gate_up_proj"])  # [tokens, 2 x intermediate]
    limit = spec.swiglu_limit
    gate, up = gate_up[:, ::2].clamp(max=limit), gate_up[:, 1::2].clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * spec.swiglu_alpha)
    return torch.addmm(w["down_proj_bias"], (up + 1) * glu, w["down_proj"])


FAMILY = GptOssFamily()
