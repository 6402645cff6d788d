"""Graduating: the same run in verl or TRL. --print-verl prints verl's command, --print-trl TRL's code, and
--export-verl-data writes --data as verl's parquet files; none of them trains. verl_reward and trl_reward score in
those frameworks as the scripts do. common.run_main imports this module only when one of those flags is given.
"""
import sys
from pathlib import Path

import common
from common import UsageError, check

ROOT = Path(__file__).resolve().parent.parent   # where common.py is: the printed command and code run from there


def graduate(algorithm, args):
    """Print this run's settings as a verl command or TRL code, or write --data as verl's parquet files; no training.
    Without --model the printed run is still a pretrained model's (MODEL): its learning rate is --model's default,
    not the toy's, unless --lr is given."""
    if args.model is None and args.lr is None:
        args.lr = common.MODEL_LR
    common.check_common_args(args, min_group_size=1 if algorithm == "ppo" else 2)
    if args.export_verl_data:
        export_verl_data(args)
    if args.print_verl:
        print(verl_command(algorithm, args))
    if args.print_trl:
        print(trl_code(algorithm, args))


def lacking(modules):
    """A comment naming the files of extras/ among `modules` that this copy lacks beside common.py, or none."""
    missing = [f"extras/{name}.py" for name in modules if not (ROOT / "extras" / f"{name}.py").is_file()]
    return [f"# this copy lacks {common.listed(missing)}, which the code below needs: copy "
            f"{'them' if len(missing) > 1 else 'it'} from the project beside common.py"] if missing else []


def model_lr_note(args):
    """Without --model or --lr: a comment saying which learning rate is printed, and why not the toy's."""
    rate = lambda lr: f"{lr:.0e}".replace("e-0", "e-")                # 1e-06 -> 1e-6
    if args.model or args.lr != common.MODEL_LR:
        return []
    return [f"# the learning rate is {rate(args.lr)}, --model's default; the toy's {rate(common.TOY_LR)} would break a "
            f"pretrained model"]


def verl_data_paths(args):
    folder = args.export_verl_data or "verl_data"
    return f"{folder}/train.parquet", f"{folder}/test.parquet"


def verl_overrides(algorithm, args):
    """verl 0.9.1's Hydra overrides for this run, one a line; a line starting with # says what verl has no key for, or
    what to do first. tests/test_graduating.py composes them in the installed verl's own config."""
    actor, rollout, model = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.model."
    P, G, k = args.prompts_per_step, args.group_size, args.minibatches
    lines = [f"algorithm.adv_estimator={'gae' if algorithm == 'ppo' else 'grpo'}",
             f"data.train_batch_size={P}", f"{rollout}n={G}"]
    if P % k == 0:  # verl counts a minibatch in prompts, each with its G completions
        lines.append(f"{actor}ppo_mini_batch_size={P // k}")
    else:
        lines.append(f"# --minibatches {k}: verl splits a batch by prompts, and {P} prompts do not split into {k}")
    if args.model:
        lines.append(f"{model}path={args.model}")
    else:
        lines.append("# the toy MoE is not a Hugging Face model: give --model and --data")
    if args.data:
        train, test = verl_data_paths(args)
        lines += [f"data.train_files={train}", f"data.val_files={test}"]
    max_new_tokens = args.max_new_tokens or (256 if args.data else None)
    if max_new_tokens:
        lines.append(f"data.max_response_length={max_new_tokens}")
    # One GPU, and verl's micro-batches (memory only: gradients accumulate to the same minibatch) of 4 rows or fewer.
    rows = P // k * G if P % k == 0 else G
    micro = next(m for m in (4, 2, 1) if rows % m == 0)
    lines += ["trainer.n_gpus_per_node=1", "trainer.nnodes=1", f"trainer.total_training_steps={args.steps}",
              "trainer.total_epochs=100000",  # epochs over the data would otherwise end the run first
              f"{rollout}name=vllm", f"{actor}ppo_micro_batch_size_per_gpu={micro}",
              f"{rollout}log_prob_micro_batch_size_per_gpu={micro}",
              f"{actor}optim.lr={args.lr}", f"{actor}optim.weight_decay=0.0",
              f"{actor}optim.clip_grad={args.max_grad_norm}",
              f"{rollout}temperature={args.temperature}", f"data.seed={args.seed}",
              f"{model}enable_gradient_checkpointing={args.gradient_checkpointing}",
              f"{actor}clip_ratio_c=10000.0"]  # verl's dual clip (3.0) caps the loss of A < 0 tokens; none here
    if algorithm in ("grpo", "ppo"):  # verl reads clip_ratio only where these two are null, and they are 0.2
        lines += [f"{actor}clip_ratio_low={args.clip_eps}", f"{actor}clip_ratio_high={args.clip_eps}"]
    elif algorithm == "gspo":
        lines += [f"{actor}policy_loss.loss_mode=gspo", f"{actor}clip_ratio_low={args.clip_eps_low}",
                  f"{actor}clip_ratio_high={args.clip_eps_high}"]
        if args.token_level:
            lines.append("# --token-level: verl has GSPO's sequence level only; with one advantage per sequence, as "
                         "here, GSPO-token is the same loss")
    elif algorithm == "cispo":  # verl clamps the weight to [1 - low, 1 + high]: low 1.0 is no floor (a ratio is > 0)
        lines += [f"{actor}policy_loss.loss_mode=cispo",
                  f"{actor}clip_ratio_low={1.0 if args.clip_eps_low is None else args.clip_eps_low}",
                  f"{actor}clip_ratio_high={round(args.ratio_cap - 1, 10)}"]
    elif algorithm == "sapo":
        lines += [f"{actor}policy_loss.loss_mode=sapo", f"{actor}tau_pos={args.tau_pos}",
                  f"{actor}tau_neg={args.tau_neg}"]
    else:
        lines += [f"{actor}clip_ratio_low={args.clip_eps_low}",
                  f"{actor}clip_ratio_high={args.clip_eps_high if args.clip_higher else args.clip_eps_low}"]
    token_level = algorithm in ("ppo", "cispo") or algorithm == "dapo" and args.token_level_loss
    lines.append(f"{actor}loss_agg_mode={'token-mean' if token_level else 'seq-mean-token-mean'}")
    if algorithm in ("grpo", "cispo", "sapo"):
        lines.append(f"{actor}use_kl_loss={args.beta > 0}")
        if args.beta > 0:
            lines += [f"{actor}kl_loss_coef={args.beta}", f"{actor}kl_loss_type=low_var_kl",  # low_var_kl: k3
                      f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}"]
    else:
        lines.append(f"{actor}use_kl_loss=False")
    if algorithm == "dapo":
        if args.dynamic_sampling:
            lines += ["algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=reward",  # the shaped one
                      f"# --max-generation-rounds {args.max_generation_rounds}: verl's trainer refills the batch "
                      f"without a cap (it ignores filter_groups.max_num_gen_batches)"]
        if args.overlong_shaping:
            buffer = args.overlong_buffer or max(1, (max_new_tokens or 8) // 4)
            cfg = "+reward.reward_kwargs.overlong_buffer_cfg."
            lines += ["reward.reward_manager.name=dapo", f"+reward.reward_kwargs.max_resp_len={max_new_tokens or 8}",
                      f"{cfg}enable=True", f"{cfg}len={buffer}", f"{cfg}penalty_factor=1.0", f"{cfg}log=False"]
        if args.overlong_filtering:
            lines.append("# --overlong-filtering: verl has no switch that masks truncated answers out of the loss")
    if algorithm == "ppo":
        lines += ["algorithm.use_kl_in_reward=True", f"algorithm.kl_ctrl.kl_coef={args.beta_kl}",
                  f"algorithm.gamma={args.gamma}", f"algorithm.lam={args.lam}", f"{actor}ppo_epochs={args.epochs}",
                  f"critic.ppo_epochs={args.epochs}", f"critic.optim.lr={args.critic_lr}",
                  "critic.optim.weight_decay=0.0",
                  f"critic.optim.clip_grad={args.max_grad_norm}", f"critic.cliprange_value={args.value_clip}",
                  f"critic.ppo_micro_batch_size_per_gpu={micro}",
                  f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}"]
        if P % k == 0:
            lines.append(f"critic.ppo_mini_batch_size={P // k}")
        if args.model:
            lines.append(f"critic.model.path={args.model}")
    if args.lora_r:
        lines += [f"{model}lora_rank={args.lora_r}", f"{model}lora_alpha={args.lora_alpha}",
                  f"{model}target_modules=all-linear"]
        if algorithm == "ppo":
            lines += [f"critic.model.lora_rank={args.lora_r}", f"critic.model.lora_alpha={args.lora_alpha}"]
    lines += verl_rollout_correction(args)
    if getattr(args, "routing_replay", False):
        lines += ["# --routing-replay: verl replays experts only in its Megatron and VeOmni engines:",
                  f"#   {actor}megatron.router_replay.mode=R2 or {actor}veomni.router_replay.mode=R2"]
    if args.data or args.reward:
        lines.append("# verl does not tell the reward whether an answer was cut off at the limit: it is scored as "
                     "finished (here a cut answer scores 0)")
        lines.append(f"reward.custom_reward_function.path={Path(__file__).resolve()}")
        lines.append("reward.custom_reward_function.name=verl_reward")
        if args.reward:
            lines.append(f"+reward.custom_reward_function.reward_kwargs.reward={args.reward}")
    return lines


def verl_rollout_correction(args):
    """--rollout-correction as verl's algorithm.rollout_correction: rollout_is, the level (token, sequence), and
    rollout_is_threshold, one bound to truncate at, or "low_high" to mask outside (verl masks between two bounds only).
    Where they differ from TRL's, a # line says so."""
    key, mode = "algorithm.rollout_correction.", common.correction_mode(args)
    lines = []
    if args.sampler == "policy":
        lines.append("# here the sampler is the policy: a dense model's old log-probs after the first minibatch are "
                     "the sampler's own (no separate pass); verl's algorithm.rollout_correction.bypass_mode=True does "
                     "so with vLLM's, which differ from the learner's")
    if mode == "none":
        return lines + [f"{key}rollout_is=null"]
    level, _, kind = mode.partition("_")
    high, low = args.rollout_correction_max, args.rollout_correction_min
    if kind == "mask" and low is None:
        return lines + [f"# --rollout-correction {mode}: verl masks the ratios outside two bounds only "
                        f"({key}rollout_is_threshold=LOW_{high}); give --rollout-correction-min"]
    threshold = f"{low}_{high}" if kind == "mask" else high
    lines += [f"{key}rollout_is={level}", f"{key}rollout_is_threshold={threshold}"]
    if kind == "truncate" and low is not None:
        lines.append(f"# --rollout-correction-min {low}: verl truncates the ratios from above only")
    return lines + ["# verl's rollout_is_threshold defaults to 2.0 and TRL's vllm_importance_sampling_clip_max to 3.0: "
                    "both are set to --rollout-correction-max here"]


def verl_command(algorithm, args):
    """--print-verl: the command, one override a line, with what to do first and what verl lacks as # lines."""
    head = []
    if args.data:
        train, test = verl_data_paths(args)
        head.append(f"# first, --data as verl's parquet: python {algorithm}.py --model {args.model} --data {args.data} "
                    f"--eval-size {args.eval_size} --export-verl-data {Path(train).parent}")
    if args.data or args.reward:                          # verl_reward scores with extras/rewards.py
        head += [f"# run from {ROOT}: the reward (extras/graduate.py's verl_reward) imports common.py from there",
                 *lacking(["rewards"])]
    overrides = verl_overrides(algorithm, args)
    notes = model_lr_note(args) + [line for line in overrides if line.startswith("#")]
    keys = [line for line in overrides if not line.startswith("#")]
    return "\n".join(head + notes + ["python3 -m verl.trainer.main_ppo \\"] +
                     [f"    {key} \\" for key in keys[:-1]] + [f"    {keys[-1]}"])


def verl_reward(data_source, solution_str, ground_truth, extra_info=None, reward=None):
    """verl's reward function signature, scoring as this project does: the answer reward, or with `reward` (verl's
    +reward.custom_reward_function.reward_kwargs.reward=FILE.py:NAME) your --reward function. verl does not say
    whether the answer was cut off at the length limit, so it counts as finished."""
    from extras.rewards import answer_reward, load_reward
    return float((load_reward(reward) if reward else answer_reward)(solution_str, str(ground_truth), True))


def trl_reward(max_new_tokens, reward=None):
    """A reward function with TRL's signature (reward_funcs=[trl_reward(L)]) that scores as this project does: the
    answer reward, or your --reward FILE.py:NAME, against the dataset's "answer" column, an answer cut off at the
    limit L scoring 0. TRL gives the completion's token ids up to its end token: fewer than L means it ended (one
    whose end token is exactly the L-th counts as cut off)."""
    from extras.rewards import answer_reward, load_reward
    score = load_reward(reward) if reward else answer_reward

    def reward_function(completions, answer, completion_ids, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]   # chat: the reply's text
        return [float(score(text, str(a), len(ids) < max_new_tokens))
                for text, a, ids in zip(texts, answer, completion_ids)]
    reward_function.__name__ = score.__name__              # TRL logs each reward under its function's name
    return reward_function


def trl_config_kwargs(algorithm, args):
    """GRPOConfig's keyword arguments for this run (TRL 1.16): P x G completions a generation, split into
    --minibatches optimizer steps (steps_per_generation) of P x G / k completions each."""
    P, G, k = args.prompts_per_step, args.group_size, args.minibatches
    kwargs = {"num_generations": G, "per_device_train_batch_size": P * G // k, "steps_per_generation": k,
              "gradient_accumulation_steps": 1, "num_iterations": 1, "learning_rate": args.lr,
              "max_grad_norm": args.max_grad_norm, "temperature": args.temperature, "max_steps": args.steps * k,
              "max_completion_length": args.max_new_tokens or 256, "seed": args.seed,
              "top_p": 1.0, "top_k": 0, "lr_scheduler_type": "constant", "weight_decay": 0.0,
              # transformers 5.25's name. The old one, gradient_checkpointing, warns that it goes in v6, even left
              # out (TRL sets it to True by default); this one, given, sets both.
              "activation_checkpointing": args.gradient_checkpointing}
    if algorithm == "grpo":
        kwargs |= {"loss_type": "grpo", "epsilon": args.clip_eps, "epsilon_high": args.clip_eps, "beta": args.beta}
    elif algorithm == "gspo":
        kwargs |= {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": args.clip_eps_low,
                   "epsilon_high": args.clip_eps_high, "beta": 0.0}
    elif algorithm == "cispo":  # epsilon_high is the cap itself here; left out, it would be epsilon's 0.2
        kwargs |= {"loss_type": "cispo", "epsilon_high": args.ratio_cap, "beta": args.beta}
    elif algorithm == "sapo":
        kwargs |= {"loss_type": "sapo", "sapo_temperature_pos": args.tau_pos, "sapo_temperature_neg": args.tau_neg,
                   "beta": args.beta}
    else:
        # Token-level: "bnpo" divides by this minibatch's tokens, as dapo.py does (TRL's "dapo" by the average
        # minibatch's: the same only with one minibatch).
        kwargs |= {"loss_type": "bnpo" if args.token_level_loss else "grpo", "epsilon": args.clip_eps_low,
                   "epsilon_high": args.clip_eps_high if args.clip_higher else args.clip_eps_low, "beta": 0.0,
                   "mask_truncated_completions": args.overlong_filtering}
    if kwargs["beta"] > 0:  # TRL's default multiplies the KL term by the ratio, which changes its gradient even at 1
        kwargs["use_bias_correction_kl"] = False
    mode = common.correction_mode(args)          # TRL corrects only where vLLM samples (use_vllm=True)
    kwargs["vllm_importance_sampling_correction"] = mode != "none"
    if mode != "none":
        kwargs |= {"vllm_importance_sampling_mode": mode,
                   "vllm_importance_sampling_clip_max": args.rollout_correction_max,
                   "vllm_importance_sampling_clip_min": args.rollout_correction_min}
    return kwargs


def trl_code(algorithm, args):
    """--print-trl: Python that builds GRPOConfig and GRPOTrainer with this run's settings and trains, on a GPU or the
    CPU, with or without a chat template."""
    if algorithm == "ppo":
        return "# TRL 1.16 has no PPO trainer (removed in 1.0); verl has one: python ppo.py ... --print-verl"
    kwargs = trl_config_kwargs(algorithm, args)
    notes = []
    if algorithm == "dapo" and args.dynamic_sampling:
        notes.append("# Dynamic Sampling: TRL has none (it trains on groups whose rewards are all equal: advantage 0)")
    if getattr(args, "routing_replay", False):
        notes.append("# --routing-replay: TRL has no Routing Replay")
    if algorithm == "gspo" and args.token_level:
        notes.append("# --token-level: TRL has GSPO's sequence level only; with one advantage per sequence, as here, "
                     "GSPO-token is the same loss")
    if algorithm == "cispo" and args.clip_eps_low is not None:
        notes.append("# --clip-eps-low: TRL's cispo caps the weight from above only (verl's clamps both sides)")
    if kwargs["vllm_importance_sampling_correction"]:
        notes.append("# the rollout correction (vllm_importance_sampling_*): TRL applies it only where vLLM samples "
                     "(use_vllm=True), and then always recomputes the old log-probs, as --sampler bf16 does here")
    elif args.sampler == "policy":
        notes.append("# vllm_importance_sampling_correction=False: here the sampler is the policy; with vLLM (use_vllm="
                     "True) TRL's default corrects the gap (sequence_mask, clip 3.0: --sampler bf16 here)")
    if algorithm == "cispo" and args.minibatches > 1:
        notes.append("# loss_type=\"cispo\" divides by the average minibatch's token count, cispo.py by this "
                     "minibatch's: the same with --minibatches 1")
    rewards = [f"graduate.trl_reward({kwargs['max_completion_length']}{f', {args.reward!r}' if args.reward else ''})"]
    if algorithm == "dapo" and args.overlong_shaping:
        buffer = args.overlong_buffer or max(1, kwargs["max_completion_length"] // 4)
        rewards.append(f"get_soft_overlong_punishment({kwargs['max_completion_length']}, {buffer})")
    model = args.model or "MODEL"
    # trl_reward scores with extras/rewards.py; --data's rows are read and split by extras/hf_models.py (which imports
    # hf_routing.py and rewards.py)
    needs = ["rewards"] + (["hf_models", *common.EXTRAS_NEEDS["hf_models"]] if args.data else [])
    lines = lacking(dict.fromkeys(needs)) + model_lr_note(args) + notes + [
        f"# run from {ROOT}, where common.py and extras/ are",
        "import torch",
        "from datasets import Dataset",
        *(["from transformers import AutoTokenizer"] if args.data else []),
        "from trl import GRPOConfig, GRPOTrainer",
        *(["from trl.rewards import get_soft_overlong_punishment"] if len(rewards) > 1 else []),
        *(["from peft import LoraConfig"] if args.lora_r else []),
        "import common",
        f"from extras import graduate{', hf_models' if args.data else ''}",
        "",
        "gpu = torch.cuda.is_available()  # bf16 autocast on a GPU, else fp32 (the scripts: bf16 where a CPU has it)",
        "config = GRPOConfig(",
        '    output_dir="runs/trl",',
        "    bf16=gpu,",
        "    use_cpu=not gpu,",
        *[f"    {key}={value!r}," for key, value in kwargs.items()],
        ")",
    ]
    if args.data:
        # TRL's conversational rows raise without a chat template: there the scripts feed the plain prompt.
        lines += [f"tokenizer = AutoTokenizer.from_pretrained({model!r})",
                  f"train, held_out = common.split_eval(hf_models.read_jsonl({args.data!r}), {args.eval_size})",
                  "# a chat turn where the model has a chat template, else the plain prompt, as the scripts do",
                  "chat = lambda p: [{\"role\": \"user\", \"content\": p}] if tokenizer.chat_template else p",
                  "to_rows = lambda rows: Dataset.from_list([{\"prompt\": chat(p), \"answer\": a} for p, a in rows])"]
    else:
        lines.append("# the toy task is not a Hugging Face data set: give --model and --data")
    lines += ["trainer = GRPOTrainer(",
              f"    model={model!r},",
              *(["    processing_class=tokenizer,"] if args.data else []),
              f"    reward_funcs=[{', '.join(rewards)}],",
              "    args=config,",
              "    train_dataset=to_rows(train)," if args.data else "    train_dataset=...,",
              *([f"    peft_config=LoraConfig(r={args.lora_r}, lora_alpha={args.lora_alpha}, lora_dropout=0.0, "
                 f"target_modules=\"all-linear\"),"] if args.lora_r else []),
              ")", "trainer.train()"]
    return "\n".join(lines)


def export_verl_data(args):
    """--export-verl-data DIR: --data's rows, split as the scripts split them (--eval-size held out), as the parquet
    files verl reads: a chat `prompt`, `data_source`, and the answer in `reward_model.ground_truth`."""
    check(args.data is not None, "--export-verl-data needs --data (a JSONL file of {\"prompt\", \"answer\"} rows)")
    # hf_models (its JSONL reader; the toy needs none) before pyarrow: a copy lacking the file hears of that first
    hf_models = common.side_module("hf_models", "--export-verl-data")
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise UsageError("--export-verl-data needs pyarrow, which is not installed: pip install pyarrow") from None
    train, held_out = common.split_eval(hf_models.read_jsonl(args.data), args.eval_size)
    folder = Path(args.export_verl_data)
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("test", held_out)):
        table = pyarrow.Table.from_pylist([
            {"data_source": "llm-rl-reference", "prompt": [{"role": "user", "content": prompt}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": answer}, "extra_info": {"split": name, "index": i}}
            for i, (prompt, answer) in enumerate(rows)])
        pyarrow.parquet.write_table(table, folder / f"{name}.parquet")
    print(f"wrote {folder / 'train.parquet'} ({len(train)} rows) and {folder / 'test.parquet'} ({len(held_out)} rows)",
          file=sys.stderr)
