"""Routing on Hugging Face Mixture-of-Experts models: record the experts each router really chose, and replay
recorded ones (Routing Replay). common.trunk calls set_replay and recorded_routing around every scoring pass of a
--model; load_hf installs the interception (watch_routers); --routing-replay checks it first (check_replay). The toy
MoE (moe_model.py) does all of this in its own forward pass and never imports this module.
"""
import torch
import torch.nn.functional as F

import common
from common import check

# transformers has no shared router class, but every MoE family (Qwen2/3-MoE, Mixtral, OLMoE, GraniteMoE,
# DeepSeek-V3, ...) has a router module, named in `_can_record_outputs["router_logits"]`, with `top_k` and
# `num_experts` attributes and exactly one top-k over the experts with k = top_k in its forward. The gate
# rules around that top-k differ (softmax then top-k, top-k then softmax, sigmoid + bias + group-limited
# top-k), so instead of rewriting each router, that one call is intercepted while the router runs:
# recording keeps its indices; replay returns the recorded indices with the current scores gathered at
# them, and the family's own code turns those into gates, so the gates come from the current router and
# the router keeps learning. Reading top-k of the router logits instead would be wrong for DeepSeek-V3.


class RouterTopK(torch.overrides.TorchFunctionMode):
    """Active while one router runs; catches its top-k over the experts."""

    def __init__(self, router):
        super().__init__()
        self.router = router

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        k = args[1] if len(args) > 1 else kwargs.get("k")
        if func not in (torch.topk, torch.Tensor.topk) or k != self.router.top_k \
                or args[0].shape[-1] != self.router.num_experts or args[0].dim() != 2:   # [tokens, experts]
            return result
        self.router.chosen = result.indices                 # what the router chooses now [tokens, k]
        if self.router.replay is None:
            return result
        experts = self.router.replay.to(result.indices.device)
        return torch.return_types.topk((args[0].gather(-1, experts), experts))


def enter_router(router, args):
    router.topk_mode.__enter__()


def leave_router(router, args, output):
    router.topk_mode.__exit__(None, None, None)
    if isinstance(output, tuple) and router.chosen is not None:  # (router logits, gates, experts): logged only
        with torch.no_grad():
            router.aux_loss = load_balancing_loss(output[0][None], router.chosen[None])


def routers(model):
    """The router modules of a Hugging Face MoE model, in layer order ([] for a dense one)."""
    target = getattr(model, "_can_record_outputs", None) or {}
    target = target.get("router_logits")
    cls = getattr(target, "target_class", target)
    return [m for m in model.modules() if isinstance(cls, type) and isinstance(m, cls)
            and hasattr(m, "top_k") and hasattr(m, "num_experts")]


def watch_routers(model):
    """Install the interception on every router (hooks, so copies of the model keep working)."""
    for router in routers(model):
        router.topk_mode, router.replay, router.chosen, router.aux_loss = RouterTopK(router), None, None, None
        router.register_forward_pre_hook(enter_router)
        router.register_forward_hook(leave_router, always_call=True)
    return model


def set_replay(model, routing):
    """Experts for the next forward passes to use, [n_layers, B, S, k], or None for free routing. They
    stay set until the next call: activation checkpointing runs the forward again in the backward."""
    for i, router in enumerate(routers(model)):
        router.replay = None if routing is None else routing[i].reshape(-1, routing.shape[-1])
        router.chosen = None


def recorded_routing(model, shape):
    """The experts the routers chose in the last forward pass [n_layers, B, S, k] and the mean
    load-balancing loss, or (None, None) for a dense model or routers whose top-k was not seen."""
    found = routers(model)
    if not found or any(r.chosen is None for r in found):
        return None, None
    return (torch.stack([r.chosen.view(*shape, -1) for r in found]),
            torch.stack([r.aux_loss for r in found]).mean())


def load_balancing_loss(router_logits, chosen):
    """Switch Transformer's auxiliary loss, averaged over layers: E * sum_e (share of the k slots sent to
    expert e) * (mean router probability of e). router_logits [L, n, E], chosen [L, n, k]."""
    E = router_logits.shape[-1]
    share = F.one_hot(chosen, E).float().mean((1, 2))                   # [L, E]
    return (E * share * router_logits.float().softmax(-1).mean(1)).sum(-1).mean()


def check_replay(model):
    """--routing-replay on a Hugging Face model stops before training unless its routing can really be replayed:
    every router's top-k was caught, the output under the replay of its own choices is exactly that of free
    routing, and it changes under the replay of other experts (a hub kernel that bypasses the router module, for
    one, fails this)."""
    name = type(model).__name__
    check(routers(model), f"--routing-replay: no router module found in {name} (a dense model, or an MoE family "
                          f"this code cannot replay)")
    tokens = torch.arange(1, 9, device=next(model.parameters()).device)[None] % model.config.vocab_size
    with torch.no_grad():
        free, routing, _ = common.trunk(model, tokens, torch.ones_like(tokens))
        check(routing is not None, f"--routing-replay: the routers of {name} do not make the top-k choice this "
                                   f"code intercepts (a kernel may bypass them); it cannot be replayed")
        replayed = common.trunk(model, tokens, torch.ones_like(tokens), routing)[0]
        others = (routing + 1) % routers(model)[0].num_experts
        other = common.trunk(model, tokens, torch.ones_like(tokens), others)[0]
    set_replay(model, None)
    check(torch.equal(free, replayed) and not torch.equal(free, other),
          f"--routing-replay: replaying routing on {name} does not act as it should; it cannot be replayed")
