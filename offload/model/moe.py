"""Mixtures of experts on the Llama layer: Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE (q/k norm).

Embedding, attention, norms and head are the Llama family's; a sparse layer's MLP is a router and
`num_experts` SwiGLU experts, of which each token runs its top `experts_per_token`:

    probs = softmax(router(x))                      float32, over every expert
    weights, chosen = topk(probs, k)                rescaled to sum to 1 where norm_topk_prob
    out = sum over chosen e of weights[e] * expert_e(x)

Tokens are grouped by expert, so each selected expert runs once over the tokens that chose it, and an
expert no token chose is never read: the router runs first, then the selected experts' weights are fetched
together (from the layer's weights, or, with expert streaming, from the ExpertSource in LayerInput, whose
reads of all the misses are then issued at once), then the experts run. Qwen-MoE configs may keep some layers
dense (mlp_only_layers, decoder_sparse_step); those layers hold the Llama MLP.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from offload.common.model_config import ModelSpec
from offload.kernels.quant_linear import SCALES_SUFFIX
from offload.model.llama import LlamaFamily, project, routed_swiglu, swiglu
from offload.model.registry import ExpertSource, LayerInput
from offload.tiers.weights.checkpoint import TensorSpec
from offload.tiers.weights.layout import Weights

EXPERT_MATRICES = ("gate_proj", "up_proj", "down_proj")
# the checkpoint's names for an expert's gate, up and down matrices
_MIXTRAL_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# transformers' Mixtral keeps the routing weights in float32 and scales the experts' outputs in float32;
# Qwen-MoE casts the weights to the compute dtype first (the same numbers in float32)
_FLOAT32_ROUTING = ("MixtralForCausalLM",)


class MoeFamily(LlamaFamily):
    def layer_tensors(self, spec: ModelSpec, layer: int) -> dict[str, TensorSpec]:
        t = super().layer_tensors(spec, layer)
        if not spec.sparse(layer):
            return t
        for name in EXPERT_MATRICES:  # the dense MLP's
            del t[name]
        return t | moe_tensors(spec, layer)

    def _mlp(
        self, spec: ModelSpec, layer: int, w: Weights, x: torch.Tensor, inp: LayerInput, hidden: torch.Tensor
    ) -> torch.Tensor:
        # the Llama layer around it: norms, attention, residuals
        return sparse_mlp(spec, w, x, inp.experts, hidden) if spec.sparse(layer) else swiglu(spec, w, x)


def moe_tensors(spec: ModelSpec, layer: int) -> dict[str, TensorSpec]:
    """A sparse layer's MLP: "router" [experts, hidden], "expert{e}.{gate,up,down}_proj" (named "*_proj" so
    `offload convert` quantizes them), and Qwen2-MoE's "shared.*_proj" with its "shared_gate" [1, hidden]."""
    h, i = spec.hidden_size, spec.expert_size
    shapes = {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    if spec.architecture == "MixtralForCausalLM":
        p = f"model.layers.{layer}.block_sparse_moe."
        names = _MIXTRAL_NAMES
    else:
        p = f"model.layers.{layer}.mlp."
        names = {m: m for m in EXPERT_MATRICES}
    t = {"router": TensorSpec(p + "gate.weight", (spec.num_experts, h))}
    for e in range(spec.num_experts):
        for m, shape in shapes.items():
            t[f"expert{e}.{m}"] = TensorSpec(p + f"experts.{e}.{names[m]}.weight", shape)
    if spec.shared_expert_size:
        s = spec.shared_expert_size
        for m, shape in {"gate_proj": (s, h), "up_proj": (s, h), "down_proj": (h, s)}.items():
            t[f"shared.{m}"] = TensorSpec(p + f"shared_expert.{m}.weight", shape)
        t["shared_gate"] = TensorSpec(p + "shared_expert_gate.weight", (1, h))
    return t


def sparse_mlp(
    spec: ModelSpec,
    w: Weights,
    x: torch.Tensor,
    experts: ExpertSource | None = None,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """The mixture's output for x [tokens, hidden] from one sparse layer's weights `w` -> [tokens, hidden]; its
    routed experts come from `experts` when given (the last fetch given `hidden`, the residual stream x is the
    norm of, to prefetch the next layer's experts by), else from `w`."""
    routing_dtype = torch.float32 if spec.architecture in _FLOAT32_ROUTING else x.dtype
    out = routed_experts(spec, w, x, experts, hidden, routing_dtype)
    if spec.shared_expert_size:
        gate = torch.sigmoid(project(spec, w, "shared_gate", x, "shared_gate_bias"))  # [tokens, 1]
        out = out + gate * swiglu(spec, sub_weights(w, "shared."), x)
    return out


def routed_experts(
    spec: ModelSpec,
    w: Weights,
    x: torch.Tensor,
    experts: ExpertSource | None,
    hidden: torch.Tensor | None,
    routing_dtype: torch.dtype,
    expert: Callable[[ModelSpec, Weights, torch.Tensor], torch.Tensor] = routed_swiglu,
    matrices: tuple[str, ...] = EXPERT_MATRICES,
) -> torch.Tensor:
    """The routed experts' part of a sparse layer (experts_forward) for x [tokens, hidden], the router being w's
    "router" (and "router_bias"): each chosen expert's `matrices` from `experts` when given (the last fetch given
    `hidden`, to prefetch the next layer's experts by), else from `w` ("expert{e}.<matrix>")."""

    def fetch(chosen: list[int], last: bool, rows: list[int]) -> Mapping[int, Weights]:
        if experts is None:
            return {e: sub_weights(w, f"expert{e}.", matrices) for e in chosen}
        return experts.fetch(chosen, hidden if last else None, rows)

    per_fetch = spec.num_experts if experts is None else experts.capacity
    if spec.routing.scoring == "sigmoid":  # DeepSeek-V3: the router in float32, as transformers keeps it
        logits = F.linear(x.float(), w["router"].float())
    else:
        logits = project(spec, w, "router", x, "router_bias")
    return experts_forward(spec, x, logits, fetch, routing_dtype, per_fetch, expert, w.get("score_bias"))


def experts_forward(
    spec: ModelSpec,
    x: torch.Tensor,
    router_logits: torch.Tensor,
    fetch: Callable[[list[int], bool, list[int]], Mapping[int, Weights]],
    routing_dtype: torch.dtype,
    per_fetch: int | None = None,
    expert: Callable[[ModelSpec, Weights, torch.Tensor], torch.Tensor] = routed_swiglu,
    score_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum over each token's top-k experts (`route`) of routing weight * expert(x), as x's dtype.

    x: [tokens, hidden]; router_logits: [tokens, experts]; fetch(experts, last, rows): each listed expert's
    "gate_proj", "up_proj", "down_proj" (and their scales when quantized), `last` telling the layer's last call,
    `rows` how many tokens each expert runs over. An expert whose weights are on another device (the CPU, for a
    cold expert on a CUDA machine) runs there on its tokens' rows, moved there and its output back. Every expert
    some token chose is fetched once, in ascending order, all in one call, or in calls of at most `per_fetch`
    experts (None: no limit), each batch run before the next is fetched. A batch's experts run in the order the
    fetched mapping gives (expert streaming puts those whose weights are ready first), and their outputs are
    added in ascending order whatever order they ran in, so the sums round alike. The routing weights are cast
    to `routing_dtype` before they scale the experts' outputs. `expert` computes one expert from its weights
    (a SwiGLU of "gate_proj", "up_proj", "down_proj", llama.routed_swiglu; gpt-oss's is its own).
    """
    k = spec.experts_per_token
    weights, chosen = route(spec, router_logits, score_bias)  # [tokens, k] each
    weights = weights.to(routing_dtype).flatten()  # [tokens * k]
    # the (token, slot) pairs sorted by expert: row r of the flattened [tokens, k] is token r // k
    order = torch.argsort(chosen.flatten(), stable=True)
    experts, counts = torch.unique_consecutive(chosen.flatten()[order], return_counts=True)
    chosen_experts, groups = experts.tolist(), order.split(counts.tolist())
    size = per_fetch or len(chosen_experts)
    out = torch.zeros_like(x)
    for start in range(0, len(chosen_experts), size):
        batch = chosen_experts[start : start + size]
        rows_of = dict(zip(batch, groups[start : start + size], strict=True))
        fetched = fetch(batch, start + size >= len(chosen_experts), [len(rows_of[e]) for e in batch])
        ran: dict[int, torch.Tensor] = {}  # outputs waiting for a lower expert's to be added first
        added = 0  # batch[:added] are in `out`
        for e in fetched:
            w, picked = fetched[e], rows_of[e]
            where = next(iter(w.values())).device  # the CPU for a cold expert run where its weights are
            y = expert(spec, w, x[picked // k].to(where)) * weights[picked, None].to(where)
            ran[e] = y.to(x.device)
            while added < len(batch) and batch[added] in ran:
                rows = rows_of[batch[added]]
                out.index_add_(0, rows // k, ran.pop(batch[added]).to(out.dtype))  # rows // k: distinct tokens
                added += 1
    return out


def route(
    spec: ModelSpec, router_logits: torch.Tensor, score_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights, as spec.routing says: (weights [tokens, k] float32, chosen [tokens,
    k]) for router_logits [tokens, experts]. Scores: a softmax over every expert, or each expert's sigmoid. The
    choice: the top k of the scores (plus `score_bias` [experts], DeepSeek-V3's correction) among the experts of each
    token's best `groups_kept` groups; the weights: the chosen scores (without the bias), renormalized where
    norm_topk_prob, times the routing scale."""
    r, k = spec.routing, spec.experts_per_token
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if r.scoring == "softmax" else torch.sigmoid(logits)
    choice = scores if score_bias is None else scores + score_bias.float()
    if r.groups_kept < r.groups:
        grouped = choice.view(len(choice), r.groups, -1)  # [tokens, groups, experts per group]
        best = grouped.amax(-1) if r.group_score == "max" else grouped.topk(2, dim=-1)[0].sum(-1)
        kept = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(r.groups_kept, dim=-1)[1], True)
        # DeepSeek-V2 zeroes the other groups' (positive) softmax scores, V3 rules its biased scores out
        dropped = 0.0 if r.scoring == "softmax" else float("-inf")
        choice = grouped.masked_fill(~kept[..., None], dropped).flatten(1)
    chosen = torch.topk(choice, k, dim=-1)[1]
    weights = scores.gather(1, chosen)
    if spec.norm_topk_prob:
        # DeepSeek-V3 adds 1e-20 to the sum of its sigmoid scores; softmax scores are never all zero
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if r.scoring == "sigmoid" else 0.0))
    return (weights * r.scale if r.scale != 1.0 else weights), chosen


def sub_weights(w: Weights, prefix: str, matrices: tuple[str, ...] = EXPERT_MATRICES) -> Weights:
    """`matrices` (the SwiGLU's by default; and their scales where quantized) stored in `w` under `prefix`, by their
    bare names."""
    out = {}
    for m in matrices:
        out[m] = w[prefix + m]
        scales = w.get(prefix + m + SCALES_SUFFIX)
        if scales is not None:
            out[m + SCALES_SUFFIX] = scales
    return out


FAMILY = MoeFamily()
