"""The peers' policy losses, run from their installed code, for the tests that cispo.py and sapo.py equal them.

verl 0.9.1: its package imports ray, which is not installed, so a loss function is taken from the source of
verl/trainer/ppo/core_algos.py (with agg_loss, and masked_sum and masked_mean from verl/utils/torch_functional.py),
its registering decorator left out, beside a stand-in for the ActorConfig it reads its settings from.
TRL 1.16: GRPOTrainer._compute_loss itself, called on a stand-in for the trainer (one process, no vLLM, no
gradient accumulation) whose forward pass returns the given log-probs. Each skips where its framework is absent."""
import ast
import importlib.util
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch


class VerlActorConfig:
    """What verl's CISPO and SAPO losses read of its ActorConfig (verl/workers/config/actor.py), set by keyword."""

    def __init__(self, **settings):
        self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high = 0.2, 0.2, 0.2      # verl's defaults
        self.tau_pos, self.tau_neg = 1.0, 1.05
        self.global_batch_info = {}                                    # one process: the batch's own counts
        self.__dict__.update(settings)


def functions_from(path, names):
    """The top-level functions `names` of a Python file, compiled without their decorators."""
    tree = ast.parse(path.read_text())
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert sorted(node.name for node in found) == sorted(names), f"{path} lacks one of {names}"
    for node in found:
        node.decorator_list = []
    return compile(ast.Module(body=found, type_ignores=[]), str(path), "exec")


def verl_policy_loss(name):
    """verl's core_algos.<name>, e.g. compute_policy_loss_cispo(old_log_prob=, log_prob=, advantages=,
    response_mask=, loss_agg_mode=, config=VerlActorConfig(...)) -> (loss, metrics)."""
    spec = importlib.util.find_spec("verl")    # finds the package without importing it (its dependencies are absent)
    if spec is None:
        pytest.skip("verl is not installed (pip install --no-deps verl==0.9.1)")
    root = Path(spec.origin).parent
    functional = {"torch": torch}
    exec(functions_from(root / "utils" / "torch_functional.py", ["masked_sum", "masked_mean"]), functional)
    namespace = {"torch": torch, "Optional": Optional, "Any": Any, "DictConfig": dict, "AlgoConfig": dict,
                 "ActorConfig": VerlActorConfig, "verl_F": SimpleNamespace(**functional)}
    exec(functions_from(root / "trainer" / "ppo" / "core_algos.py", ["agg_loss", name]), namespace)
    return namespace[name]


def trl_loss(config_kwargs, logp, old_logp, advantages, mask, ref_logp=None):
    """TRL's GRPOTrainer._compute_loss under GRPOConfig(**config_kwargs) for one minibatch: the loss, whose gradient
    reaches logp, and the metrics it logged. The normaliser of the token-level losses ("dapo", "cispo") is the tokens
    of all steps_per_generation minibatches over their number: here given as this one's tokens times that number."""
    for name in ("trl", "accelerate", "datasets", "pandas"):
        pytest.importorskip(name, reason=f"{name} is not installed: TRL's trainer needs it (pip install --no-deps "
                                         f"trl==1.16.0; pip install datasets==5.2.0)")
    from trl import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer
    args = GRPOConfig(**(dict(output_dir="unused", use_cpu=True, bf16=False, report_to="none") | config_kwargs))
    trainer = SimpleNamespace(
        args=args, loss_type=args.loss_type, beta=args.beta, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,   # as its __init__
        importance_sampling_level=args.importance_sampling_level, top_entropy_quantile=args.top_entropy_quantile,
        off_policy_mask_threshold=args.off_policy_mask_threshold, use_vllm=False,
        vllm_importance_sampling_correction=False, aux_loss_enabled=False, _entropy_bonus_enabled=False,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x),
        _metrics=defaultdict(lambda: defaultdict(list)),
        _get_per_token_logps_and_entropies=lambda *a, **kw: (logp, torch.zeros_like(logp), None))
    n = len(mask)
    inputs = {"prompt_ids": torch.zeros(n, 0, dtype=torch.long), "prompt_mask": torch.zeros(n, 0, dtype=torch.long),
              "completion_ids": torch.zeros(mask.shape, dtype=torch.long), "completion_mask": mask,
              "advantages": advantages, "old_per_token_logps": old_logp,
              "num_items_in_batch": mask.sum() * args.steps_per_generation}
    if ref_logp is not None:
        inputs["ref_per_token_logps"] = ref_logp
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss, {key: values[-1] for key, values in trainer._metrics["train"].items()}
