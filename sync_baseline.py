"""Synchronous Online DPO (Noukhovitch et al. 2024, "Asynchronous RLHF", arXiv 2410.18252).

The paper's baseline: async_dpo.py in lockstep (transformers' generate instead: benchmarks/sync_hf.py).
Round r of the loop in `main()` (right below Args):
  1. receive round r's completions, generated with the current weights (the learner waits);
  2. SYNC: nothing is requested now: the next round is requested after the updates (step 7);
  3. score the completions with the reward model: each prompt's best and worst form a DPO pair;
  4. the frozen reference's log-probs of the pairs;
  5. N mini-batches x T epochs of DPO steps;  6. log;  7. publish the weights, request round r+1;
  8. checkpoint (--save_every).
Every step thus trains on completions of its own weights (staleness 0, with N = T = 1).
Demo on CPU: `python sync_baseline.py --model tiny`. Diagram and reading guide: README.md.
"""
import contextlib
import functools
import math
import os
import random
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM

import tiny_world
from plumbing import checkpoint, core, generator_io, launch, lora, metrics
from plumbing.reward_models import check_score_heads, load_reward_models

TLDR_DATASET = "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
PRESETS = {  # --model: (SFT policy, proxy reward model, dataset) on the Hugging Face hub
    "pythia-410m": ("mnoukhov/pythia410m-sft-tldr", "mnoukhov/pythia410m-rm-tldr6.9b", TLDR_DATASET),
    "pythia-1b": ("mnoukhov/pythia1b-sft-tldr", "mnoukhov/pythia1b-rm-tldr6.9b", TLDR_DATASET),
    "pythia-2.8b": ("mnoukhov/pythia2.8b-sft-tldr", "mnoukhov/pythia2.8b-rm-tldr6.9b", TLDR_DATASET),
    "llama-3.1-8b-no-robots": ("allenai/open_instruct_dev", "vwxyzjn/reward_modeling__allenai_open_instruct_dev",
                               "HuggingFaceH4/no_robots"),  # a chat dataset: `messages`
}
# The paper's chatbot (its Table 7), for `torchrun --nproc_per_node 7 ... --fsdp` beside one vLLM GPU: the
# revisions it trained from, and 252 prompts a step, the nearest to its 256 that divides over 7 learners
PRESET_DEFAULTS = {"llama-3.1-8b-no-robots": dict(
    sft_model_revision="costa_finetune_tulu3_8b_norobot__meta-llama_Meta-Llama-3.1-8B__42__1725559869",
    reward_model_revision="reward_modeling__1__1725760619", eval_split="test", learning_rate=8e-7,
    beta=0.03, missing_eos_penalty=-10.0, response_length=1024, eval_response_length=1024,
    total_episodes=100_000, batch_size=252, per_device_train_batch_size=2, num_eval_prompts=252,
)}
# The chatbot with LoRA on one learner GPU beside vLLM's (docs/gpu.md: one GPU shared, or two): a rank-64 adapter
# on every linear layer at 10x the learning rate (the demo's sweep and the field's rule of thumb), 256 prompts a step
PRESETS["llama-3.1-8b-no-robots-lora"] = PRESETS["llama-3.1-8b-no-robots"]
PRESET_DEFAULTS["llama-3.1-8b-no-robots-lora"] = dict(
    PRESET_DEFAULTS["llama-3.1-8b-no-robots"], lora_rank=64, learning_rate=8e-6, batch_size=256)
# `--model tiny` swaps in defaults that train a locally built toy model on 2 CPU cores in minutes.
TINY_DEFAULTS = dict(
    lag_every=1, learning_rate=1e-4, response_length=16, max_prompt_length=64, total_episodes=1920,
    batch_size=32, per_device_train_batch_size=16, eval_every=15, num_eval_prompts=128,
    eval_response_length=16,
)


# Flags a resumed run may change: where and how it logs, and its evaluations (they draw no training
# sample). Any other difference from the checkpoint's run is refused, naming the flag.
MAY_DIFFER_ON_RESUME = {
    "exp_name", "track", "wandb_project", "wandb_entity", "output_dir", "save_model", "save_merged", "verbose",
    "tiny_dir", "vllm_gpu_memory_utilization", "generator_cores", "gradient_checkpointing", "save_every",
    "resume_from", "run_name", "rank", "lag_every", "eval_every", "num_eval_prompts", "num_final_eval_prompts",
    "eval_temperature", "eval_response_length"}


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment (learner and vLLM sampling)"""
    track: bool = False
    """log to Weights & Biases"""
    wandb_project: str = "async-rlhf"
    """the wandb project name"""
    wandb_entity: Optional[str] = None
    """the wandb entity (team) name"""
    output_dir: Optional[str] = None
    """where metrics.jsonl, the generator's log and the saved model go (default, filled in by
    resolve_args: runs/{run_name}, or the resumed run's folder)"""
    save_model: bool = False
    """save the final policy and tokenizer with save_pretrained to {output_dir}/model"""
    save_every: int = 0
    """checkpoint every this many optimizer steps, at a round's end (0: never; then SIGTERM too)"""
    resume_from: Optional[str] = None
    """continue the run in this folder (or its checkpoint folder) where its checkpoint left it"""
    verbose: bool = False
    """show vLLM's own log on the console (by default it goes to {output_dir}/generator.log)"""

    # Models and data
    model: Literal["tiny", "pythia-410m", "pythia-1b", "pythia-2.8b", "llama-3.1-8b-no-robots",
                   "llama-3.1-8b-no-robots-lora"] = "pythia-2.8b"
    """preset naming the SFT policy, reward model and dataset; `tiny`: a toy world built on CPU"""
    sft_model_path: Optional[str] = None
    """SFT policy (hub name or local folder), also the frozen reference (default: the preset's)"""
    sft_model_revision: Optional[str] = None
    """the SFT policy's hub revision: a branch, tag or commit (default: the latest; the preset's)"""
    reward_model_path: Optional[str] = None
    """reward model with a 1-label sequence-classification head (default: the preset's)"""
    reward_model_revision: Optional[str] = None
    """the reward model's hub revision (default: the latest; the preset's)"""
    dataset: Optional[str] = None
    """prompts with `query`, `reference_response` columns, or chats in a `messages` column
    (formatted with the policy's chat template); hub, folder or file (default: the preset's)"""
    eval_split: str = "validation"
    """the dataset's split to evaluate on (No Robots: `test`)"""
    gold_reward_model_path: Optional[str] = None
    """gold reward model, only for evaluation; `tiny` has its own"""
    reward_chat_template: bool = False
    """give the reward models prompt and completion as a chat in their tokenizer's chat template"""
    tiny_dir: str = tiny_world.SHIPPED["tldr"]
    """the toy world `--model tiny` runs on: the one in worlds/ (tiny_world.py builds others)"""

    # Algorithm specific arguments (paper defaults for TL;DR)
    learning_rate: float = 3e-6
    """learning rate of AdamW, decayed linearly to 0"""
    beta: float = 0.1
    """DPO beta: strength of the implicit KL penalty towards the SFT reference"""
    loss: Literal["dpo", "best_of_k_sft"] = "dpo"
    """`best_of_k_sft`: the paper's control, supervised fine-tuning on each prompt's best of K"""
    temperature: float = 0.7
    """sampling temperature; the learner divides its logits by it too, so its log-probs match"""
    num_samples: int = 2
    """K completions per prompt; the best and worst under the reward model form the DPO pair"""
    response_length: int = 128
    """maximum new tokens per completion"""
    max_prompt_length: int = 512
    """prompts longer than this keep their last tokens (where 'TL;DR:' sits)"""
    total_episodes: int = 131072
    """number of training prompts to consume (episodes)"""
    batch_size: int = 512
    """prompts per optimizer step, summed over all learner processes"""
    per_device_train_batch_size: int = 8
    """prompts per forward pass on one learner device; gradient accumulation makes up the rest"""
    num_mini_batches: int = 1
    """N: generate N mini-batches with one set of weights, then take N steps (off-policyness)"""
    num_epochs: int = 1
    """T: passes over each generated batch"""
    missing_eos_penalty: Optional[float] = -1.0
    """score of a completion that never emits EOS, instead of the reward model's (None: none)"""
    max_grad_norm: Optional[float] = None
    """clip gradients to this norm (off by default, as in the paper's TL;DR runs)"""
    lag_every: int = 10
    """log `lag/update`, the step's relative size, every this many steps (it copies the parameters to
    host memory and back: at 2.8B, 11 GB each way per rank)"""

    # Evaluation
    eval_every: int = 32
    """evaluate every this many optimizer steps (0: only before and after training)"""
    num_eval_prompts: int = 512
    """validation prompts per evaluation during training"""
    num_final_eval_prompts: Optional[int] = None
    """validation prompts in the final evaluation and the SFT policy's at step 0, every gain's baseline
    (default: the whole validation split)"""
    eval_temperature: float = 0.01
    """near-greedy sampling for evaluation"""
    eval_response_length: int = 128
    """maximum new tokens per evaluation completion"""

    # Systems
    dtype: Optional[Literal["bfloat16", "float16", "float32"]] = None
    """vLLM's and reward models' dtype, the learner's autocast (default, filled in by resolve_args:
    bfloat16 on GPU, float32 on CPU)"""
    gradient_checkpointing: Optional[bool] = None
    """recompute activations in the backward pass instead of storing them (default, filled in by
    resolve_args: on; tiny: off)"""
    vllm_gpu_memory_utilization: float = 0.9
    """fraction of GPU 0's memory vLLM may use (lower it when the learner shares that GPU)"""
    generator_cores: int = 1
    """CPU runs only: cores reserved for the generator; the learner gets the rest"""
    fsdp: bool = False
    """under torchrun, shard every model over the learners with FSDP2 (default: DDP)"""

    # LoRA (plumbing/lora.py)
    lora_rank: int = 0
    """train a rank-r LoRA adapter on the frozen SFT weights instead of every weight (0: full fine-tuning); the
    reference is then the base with the adapter off, and the hand-off carries the adapter only. --learning_rate is
    not changed for you: an adapter usually wants ~10x full fine-tuning's (docs/lora.md: 1e-3 against the demo's
    1e-4), as the -lora presets set it"""
    lora_alpha: Optional[float] = None
    """LoRA's scale: the adapter adds alpha / r x B A to each weight it targets (default: 2 r)"""
    lora_target_modules: Optional[list[str]] = None
    """the modules that get an adapter, by name (default: `all-linear`, every linear layer but the output)"""
    save_merged: bool = False
    """with --save_model and LoRA: also save the adapter merged into the base, to {output_dir}/model_merged"""

    # filled in at runtime by resolve_args, from the flags above
    run_name: str = ""
    """`{model}__{exp_name}__{seed}__{time}`"""
    rank: int = 0
    """this learner process's rank (torchrun); rank 0 talks to the generator"""
    world_size: int = 1
    """number of learner processes (torchrun)"""
    local_batch_size: int = 0
    """prompts per optimizer step on one learner process"""
    gradient_accumulation_steps: int = 0
    """forward passes per optimizer step on one learner process"""
    num_rounds: int = 0
    """generation rounds, each of num_mini_batches x batch_size prompts x num_samples completions"""
    num_steps: int = 0
    """optimizer steps in total"""
    world_hash: str = ""
    """the tiny world's hash (SHA-256 of its SHA256SUMS), printed at the start and logged; empty for hub models"""


def resolve_args(args: Args) -> Args:
    """Args' runtime fields, right after parsing: the learner ranks, the schedule's sizes, the
    precision, where the run logs, and the preset's models and data. It checks this script's own
    flags (core.check_flags those every script has)."""
    args.rank, args.world_size = int(os.getenv("RANK", "0")), int(os.getenv("WORLD_SIZE", "1"))
    if args.num_samples < 2:
        core.fail(f"--num_samples must be at least 2 (a DPO pair needs two), got {args.num_samples}")
    core.check_flags(args, positive=("temperature", "eval_temperature", "num_mini_batches", "num_epochs"),
                     round_prompts=args.batch_size * args.num_mini_batches)
    args.local_batch_size = args.batch_size // args.world_size
    args.gradient_accumulation_steps = args.local_batch_size // args.per_device_train_batch_size
    args.num_rounds = args.total_episodes // (args.batch_size * args.num_mini_batches)
    args.num_steps = args.num_rounds * args.num_mini_batches * args.num_epochs
    args.dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    if args.gradient_checkpointing is None:  # the toy models need none
        args.gradient_checkpointing = args.model != "tiny"
    args.run_name = f"{args.model}__{args.exp_name}__{args.seed}__{int(time.time())}"
    if args.output_dir is None:  # (resumed: the run's own folder)
        args.output_dir = (checkpoint.run_folder(args.resume_from) if args.resume_from
                           else os.path.join("runs", args.run_name))
    if args.model != "tiny" and args.model not in PRESETS:  # (a new --model value needs its preset)
        core.fail(f"--model {args.model}: no preset of that name (PRESETS has {sorted(PRESETS)})")
    if args.model == "tiny":  # the shipped world (or --tiny_dir's), each file checked against its SHA256SUMS
        sft, reward, data, gold, args.world_hash = tiny_world.tldr_world(args.tiny_dir)
    else:
        (sft, reward, data), gold = PRESETS[args.model], None
    args.sft_model_path, args.dataset = args.sft_model_path or sft, args.dataset or data
    args.reward_model_path = args.reward_model_path or reward
    # A hub revision (--sft_model_revision, the preset's) is fetched once: every loader reads its folder
    args.sft_model_path = core.hub_snapshot("sft_model", args.sft_model_path, args.sft_model_revision)
    args.reward_model_path = core.hub_snapshot("reward_model", args.reward_model_path, args.reward_model_revision)
    args.gold_reward_model_path = args.gold_reward_model_path or gold
    return args


def main(args: Args, cleanup: contextlib.ExitStack) -> None:
    core.check_model_paths(args, "sft_model_path", "reward_model_path", "gold_reward_model_path")
    check_score_heads(args, "reward_model_path", "gold_reward_model_path")  # (before vLLM starts)
    tokenizer = core.load_tokenizer(args.sft_model_path)  # (a chat dataset: formatted by its template)
    train_data, eval_data = core.load_prompt_splits(
        args.dataset, args.seed, names=("train", args.eval_split), tokenizer=tokenizer,
        tokenizer_path=args.sft_model_path, max_prompt_length=args.max_prompt_length)
    # Placement: vLLM owns GPU 0 of the first node; learner i takes GPU i + 1 there (GPU i on other
    # nodes), or, on one node with no GPU spare per learner, GPU i: rank 0 then sits beside vLLM.
    # On a CPU the generator gets the last --generator_cores cores and the learner the others.
    shares_gpu0 = core.shares_gpu0()  # (every rank answers the same)
    local_rank, node = int(os.getenv("LOCAL_RANK", "0")), int(os.getenv("GROUP_RANK", "0"))
    gpu = local_rank if shares_gpu0 or node > 0 else local_rank + 1
    device, generator_cores = core.learner_device(args.world_size, gpu, args.generator_cores)
    random.seed(args.seed), np.random.seed(args.seed), torch.manual_seed(args.seed)
    metrics_file = launch.start_run(args, cleanup, MAY_DIFFER_ON_RESUME)
    use_cuda, dtype = device.type == "cuda", getattr(torch, args.dtype)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=use_cuda and dtype != torch.float32)
    # The facts every step uses. A completion ends at EOS, or, in a chat dataset, at the template's
    # end-of-turn token (Llama 3.1's <|eot_id|>): sampling stops there, the EOS penalty follows it
    chat = "messages" in train_data.column_names
    run = core.Run(device, autocast, *core.special_ids(tokenizer, chat))

    # The generator (rank 0) starts first: sharing GPU 0, vLLM must measure the free memory first
    config = AutoConfig.from_pretrained(args.sft_model_path)
    with torch.device("meta"):  # the buffer's layout needs the config only, no weights
        weight_layout = weight_table(lora.add_adapter(AutoModelForCausalLM.from_config(config), args))
    generator = generator_io.Generator()  # (the other ranks get its messages from rank 0)
    if args.rank == 0:
        generator = start_generator(engine_kwargs(args, config, use_cuda), weight_layout, run.eos_id,
                                    None if use_cuda else generator_cores, args)
        cleanup.callback(generator.stop)
    if shares_gpu0:
        collect(generator, args)  # "ready": vLLM has taken its share of GPU 0

    # The policy trains in float32 (under autocast on GPU); the reference runs exactly as it does,
    # so that log pi - log pi_ref is 0 at step 0 on GPU as on CPU. Reward models load in `dtype`.
    # Each goes to the learner's device as it loads (--fsdp: sharded there block by block), so that
    # neither the host nor the device holds two whole models at a time (at 8B, 30 GiB each)
    policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=torch.float32)
    policy = lora.add_adapter(core.train_without_dropout(policy, args.gradient_checkpointing), args)
    policy = core.on_learner(policy, args, device)  # (LoRA: the base frozen, the adapter trains)
    if args.lora_rank:  # the reference is the SFT policy: with LoRA, the policy with its adapter off
        ref_policy = lora.AdapterOff(policy)  # (no second copy of the weights)
    else:
        ref_policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=torch.float32)
        ref_policy = core.on_learner(ref_policy.eval().requires_grad_(False), args, device)
    reward_models = {name: core.on_learner(model, args, device) for name, model in load_reward_models(
        args, tokenizer, (train_data, eval_data), dtype).items()}
    learner = core.shard_or_replicate(policy, args, device)  # (DDP or FSDP2: what the optimizer trains)
    trained = [p for p in learner.parameters() if p.requires_grad]  # (LoRA: the adapter's)
    core.check_hand_off(policy, weight_layout)  # (what trains is what the generator receives, by name)
    optimizer = torch.optim.AdamW(trained, lr=args.learning_rate, fused=use_cuda)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / args.num_steps)
    weight_buffer = None
    if args.rank == 0:  # ASYNC: the hand-off's buffer, allocated once the models are sharded
        weight_buffer = make_weight_buffer(weight_layout, dtype, device)
        submit(generator, dict(kind="weight_buffer", weight_buffer=weight_buffer,
                               adapter_config=lora.adapter_config(policy)))  # (LoRA: its settings)

    # The prompt order: a fresh shuffle of the training prompts for each pass over them, in rounds
    train_prompts = core.tokenize_prompts(tokenizer, train_data["query"], args.max_prompt_length)
    per_round = args.batch_size * args.num_mini_batches
    passes = -(-args.num_rounds * per_round // len(train_prompts))
    order = np.concatenate([np.random.permutation(len(train_prompts)) for _ in range(passes)])
    prompt_rounds = order[: args.num_rounds * per_round].reshape(args.num_rounds, per_round)
    # A round is N mini-batches of batch_size prompts, each split over the ranks: [N, ranks, local]
    my_prompts = np.arange(per_round).reshape(
        args.num_mini_batches, args.world_size, -1)[:, args.rank].ravel()  # this rank's positions
    eval_set = evaluation_set(eval_data, tokenizer, reward_models, args, run)
    eval_prompts = eval_set["prompts"][: eval_set["num_prompts"]]  # during training
    run_evaluation = functools.partial(
        score_evaluation, eval_set=eval_set, reward_models=reward_models, ref_policy=ref_policy,
        tokenizer=tokenizer, args=args, run=run, metrics_file=metrics_file)
    if not shares_gpu0:
        collect(generator, args)  # "ready": vLLM was built while we loaded our models

    # The loop's state, fresh or (--resume_from) where a checkpoint left it: the first round, the
    # policy's version (optimizer steps taken; 0: the SFT weights, vLLM's start), the version in the
    # weight buffer (the generator's), the last evaluation requested, and those not yet scored
    saved = dict(learner=learner, optimizer=optimizer, scheduler=scheduler,
                 weight_buffer=weight_buffer, metrics_file=metrics_file)  # what a checkpoint holds
    loop = (0, 0, 0, 0, [])
    if args.resume_from:
        loop = checkpoint.resume(args, **saved)
    first_round, version, buffer_version, last_eval, pending_evals = loop
    progress = cleanup.enter_context(tqdm(total=args.num_steps, initial=version, desc=args.exp_name,
                                          disable=args.rank != 0, dynamic_ncols=True))

    if not args.resume_from:  # evaluate the SFT policy, then start the clock; on the final evaluation's
        submit(generator, eval_request(0, eval_set["prompts"], args))  # prompts: the gains' baseline
        run_evaluation(collect(generator, args), training_start=None)
    training_start = time.time()
    first_prompts = [train_prompts[i] for i in prompt_rounds[first_round]]
    submit(generator, train_request(first_round, buffer_version, first_prompts, args))
    for eval_version in pending_evals:  # (resumed: evaluations that were queued behind it)
        submit(generator, eval_request(eval_version, eval_prompts, args))
    sync_start = sync_end = time.time()  # (round 0: sampled with the SFT weights, nothing to publish)
    for round_index in range(first_round, args.num_rounds):
        # 1. Receive this round's batch, sampled with the current weights (evaluations first)
        round_start = wait_start = time.time()
        eval_seconds = 0.0
        while (batch := collect(generator, args))["kind"] == "eval":
            eval_seconds += run_evaluation(batch, training_start=training_start)
            pending_evals.pop(0)
        wait_end = time.time()
        if batch["round"] != round_index:
            raise RuntimeError(f"expected the batch of round {round_index}, got {batch['round']}")

        # 2. SYNC: nothing to request yet: the next round waits for this round's updates (step 7)

        # 3. ALGO: score this rank's completions; each prompt's best and worst form its DPO pair
        train_start = time.time()
        prompts = [train_prompts[i] for i in prompt_rounds[round_index][my_prompts]]
        pairs = make_pairs(batch, prompts, my_prompts, reward_models["proxy"], args, run)

        # 4. ALGO: the frozen reference's log-probs of every completion, once per round: the pairs'
        # for the loss, all K for the sampled KL(pi || ref) of the weights that generated them
        K, sampled = args.num_samples, pairs.pop("sampled")
        ref_logps = logprobs_in_chunks(ref_policy, [p for p in pairs["prompts"] for _ in range(K)],
                                       sampled["responses"], args.temperature,
                                       K * args.per_device_train_batch_size, run).sum(1)
        pairs["ref_chosen_logps"] = ref_logps[sampled["chosen"]]
        pairs["ref_rejected_logps"] = ref_logps[sampled["rejected"]]
        pairs["kl"] = (sampled["generator_logps"] - ref_logps).view(-1, K).mean(1)  # per prompt

        # 5. ALGO: N mini-batches x T epochs of DPO steps; mini-batch n is the n-th slice of every
        # rank's pairs (all ranks' n-th slices: the step's batch_size prompts)
        size = args.local_batch_size  # this rank's pairs in a mini-batch
        for epoch in range(args.num_epochs):
            for n in range(args.num_mini_batches):
                mini_batch = {key: value[n * size: (n + 1) * size] for key, value in pairs.items()}
                staleness = version - batch["generation_version"]  # steps since it was sampled
                before = core.parameters_copy(policy) if version % args.lag_every == 0 else None
                stats = dpo_update(learner, optimizer, scheduler, mini_batch, args, run)
                if before is not None:  # the lag: how far the step moved the policy
                    stats["lag/update"] = core.relative_update(policy, before, args.world_size)
                version += 1

                # 6. Log the step (and the round's timings with its last step)
                record = dict(step=version, episode=metrics.episodes_at(version, args),
                              round=round_index, generation_version=batch["generation_version"],
                              staleness=staleness, lr=scheduler.get_last_lr()[0], **stats)
                if epoch == args.num_epochs - 1 and n == args.num_mini_batches - 1:
                    record.update(metrics.round_times(
                        training_start, round_start, eval_seconds, learner_wait=(wait_start, wait_end),
                        weight_load=(batch["weight_load_start"], batch["generation_start"]),
                        generation=(batch["generation_start"], batch["generation_end"]),
                        weight_sync=(sync_start, sync_end), training=(train_start, time.time())))
                record["time/elapsed"] = time.time() - training_start
                metrics.log(record, metrics_file, args.track)
                progress.update(1)
                progress.set_postfix(reward=f"{stats['reward/mean']:.3f}",
                                     loss=f"{stats['loss/' + args.loss]:.3f}", staleness=staleness)

        # 7. SYNC: publish the newest weights and request the next round, which the learner awaits
        sync_start = time.time()
        if version != buffer_version:
            write_weight_snapshot(policy, weight_buffer, weight_layout)
            buffer_version = version
        if round_index + 1 < args.num_rounds:
            next_prompts = [train_prompts[i] for i in prompt_rounds[round_index + 1]]
            submit(generator, train_request(round_index + 1, version, next_prompts, args))
            if args.eval_every and version // args.eval_every > last_eval // args.eval_every:
                last_eval = version  # queued behind the training batch: never generated after it
                submit(generator, eval_request(version, eval_prompts, args))
                pending_evals.append(version)
        sync_end = time.time()

        # 8. Checkpoint (--save_every, or SIGTERM) at the round's end
        if round_index + 1 < args.num_rounds and checkpoint.due(
                args, version, steps=args.num_mini_batches * args.num_epochs):
            loop = (round_index + 1, version, buffer_version, last_eval, pending_evals)
            pending_evals = checkpoint.save(args, loop, lambda: run_evaluation(
                collect(generator, args), training_start=training_start), **saved)

    # Final evaluation (the whole validation split by default) with the last weights. One requested
    # in the last round may still be loading its weights: score it before the buffer is rewritten.
    for _ in pending_evals:
        run_evaluation(collect(generator, args), training_start=training_start)
    write_weight_snapshot(policy, weight_buffer, weight_layout)
    submit(generator, eval_request(version, eval_set["prompts"], args, final=True))
    run_evaluation(collect(generator, args), training_start=training_start)
    progress.close()
    metrics.print_regime(metrics_file)  # which side waited, and the paper's knob for it
    if args.save_model:  # (LoRA: the adapter, in PEFT's format; --save_merged: merged too)
        core.save_policy(policy, tokenizer, args)


# --- Tokens and log-probs -------------------------------------------------------------------------
def truncate_at_eos(responses: list[list[int]], length: int, eos_id: int) -> tuple[list, list]:
    """Cut each completion after its first EOS (and at `length`); say which ones emitted EOS."""
    cut, has_eos = [], []
    for tokens in responses:
        tokens = list(tokens[:length])
        has_eos.append(eos_id in tokens)
        cut.append(tokens[: tokens.index(eos_id) + 1] if has_eos[-1] else tokens)
    return cut, has_eos


def collate(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device) -> tuple:
    """Left-pad the prompts and right-pad the responses, each to this micro-batch's own longest, so
    that every response starts at the same column. Position ids skip the left padding, so they match
    unpadded sequences. Returns the model inputs and the mask of the response tokens."""
    prompt_width, response_width = max(map(len, prompts)), max(map(len, responses))
    ids = [[pad_id] * (prompt_width - len(p)) + p + r + [pad_id] * (response_width - len(r))
           for p, r in zip(prompts, responses)]
    mask = [[0] * (prompt_width - len(p)) + [1] * (len(p) + len(r)) + [0] * (response_width - len(r))
            for p, r in zip(prompts, responses)]
    input_ids, attention_mask = torch.tensor(ids, device=device), torch.tensor(mask, device=device)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask,
                  position_ids=(attention_mask.cumsum(1) - 1).clamp(min=0), use_cache=False)
    return inputs, attention_mask[:, prompt_width:]


def response_logits(model, inputs: dict, width: int) -> torch.Tensor:
    # Only the logits that predict the `width` response tokens: no [batch, prompt, vocab] tensor
    return model(**inputs, logits_to_keep=width + 1).logits[:, :-1]


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, response_mask: torch.Tensor,
                   temperature: float) -> torch.Tensor:
    """Per-token log-probs of the responses (0 on padding) at the sampling temperature, as vLLM's."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    tokens = input_ids[:, -response_mask.shape[1]:, None]
    return logprobs.gather(2, tokens).squeeze(-1) * response_mask


@torch.no_grad()
def logprobs_in_chunks(model, prompts: list, responses: list, temperature: float, chunk: int,
                       run: core.Run) -> torch.Tensor:
    """Per-token log-probs [completions, longest] under a frozen model, in the update's precision"""
    width, logprobs = max(map(len, responses)), []
    for part in core.chunks(len(prompts), chunk, model):  # (FSDP2: as many on every rank)
        inputs, mask = collate(prompts[part], responses[part], run.pad_id, run.device)
        with run.autocast:
            logits = response_logits(model, inputs, mask.shape[1])
        chunk_logprobs = token_logprobs(logits, inputs["input_ids"], mask, temperature)
        logprobs.append(F.pad(chunk_logprobs, (0, width - mask.shape[1])).cpu())
    return torch.cat(logprobs)[: len(prompts)]


# --- The reward: what training maximises (to train on your own, replace `training_reward`) --------
def training_reward(reward_model, prompts: list, responses: list, has_eos: list, args: Args,
                    run: core.Run) -> torch.Tensor:
    """Each completion's training reward: the proxy reward model's score, or --missing_eos_penalty
    for a completion that never ended. The evaluation's judges (the proxy's and the gold model's
    win rates) call score_in_chunks themselves: replacing this function leaves them as they are."""
    chunk = args.per_device_train_batch_size * args.num_samples
    return score_in_chunks(reward_model, prompts, responses, has_eos, args.missing_eos_penalty, chunk, run)


@torch.no_grad()
def score_in_chunks(reward_model, prompts: list, responses: list, has_eos: list,
                    missing_eos_penalty: Optional[float], chunk: int, run: core.Run):
    """Each completion's score: the reward model's at the last token of prompt + completion (if it
    has a tokenizer of its own: of their text, re-tokenised); without EOS, the penalty (or None)."""
    pad_id = run.pad_id
    if reward_model.retokenize is not None:  # (said at start-up: plumbing.reward_models)
        prompts, responses, pad_id = reward_model.retokenize(prompts, responses, has_eos)
    backbone, scores = getattr(reward_model, reward_model.base_model_prefix), []
    for part in core.chunks(len(prompts), chunk, reward_model):  # (FSDP2: as many on every rank)
        inputs, mask = collate(prompts[part], responses[part], pad_id, run.device)
        hidden = backbone(**inputs).last_hidden_state
        last = inputs["input_ids"].shape[1] - mask.shape[1] + mask.sum(1) - 1  # the last real token
        rows = torch.arange(len(hidden), device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):  # the head in float32 (plumbing)
            scores.append(reward_model.score(hidden[rows, last].float()).squeeze(-1).cpu())
    scores = torch.cat(scores)[: len(prompts)]
    if missing_eos_penalty is None:
        return scores
    return torch.where(torch.tensor(has_eos), scores, missing_eos_penalty)


# --- Online DPO: pairs from the reward model, the loss and the update -----------------------------
def select_pairs(scores: torch.Tensor):
    """scores [prompts, K] -> (chosen, rejected, valid): the best and the worst completion; a prompt
    whose K completions all score the same carries no preference (valid=False)."""
    return scores.argmax(1), scores.argmin(1), scores.max(1).values > scores.min(1).values


def make_pairs(batch: dict, prompts: list, my_prompts, reward_model, args: Args,
               run: core.Run) -> dict:
    """This rank's DPO pairs, one row per prompt: its chosen and rejected completion, the scores of
    its K completions, whether it has a preference, its EOS count, the generator's log-probs; and
    `sampled`, all K completions (a row each) with their log-probs and the pairs' rows among them."""
    K = args.num_samples
    completions = [i * K + k for i in my_prompts for k in range(K)]  # in the generator's output
    responses, has_eos = truncate_at_eos([batch["responses"][i] for i in completions],
                                         args.response_length, run.eos_id)
    scores = training_reward(reward_model, [p for p in prompts for _ in range(K)], responses, has_eos,
                             args, run).view(-1, K)
    chosen, rejected, valid = select_pairs(scores)
    first = torch.arange(len(prompts)) * K  # each prompt's first completion
    chosen, rejected = first + chosen, first + rejected
    # vLLM's log-prob of each token, cut as the response is; their sum, each completion's log mu(y)
    width = max(map(len, responses))
    generator_logprobs = torch.tensor([batch["logprobs"][i][: len(r)] + [0.0] * (width - len(r))
                                       for i, r in zip(completions, responses)])
    generator_logps = generator_logprobs.sum(1)
    return dict(prompts=prompts, chosen=[responses[i] for i in chosen],
                rejected=[responses[i] for i in rejected], valid=valid.float(), scores=scores,
                eos=torch.tensor(has_eos, dtype=torch.float).view(-1, K),  # [prompt, k]
                lengths=torch.tensor([len(r) for r in responses]).view(-1, K),
                generator_chosen_logps=generator_logps[chosen],
                generator_rejected_logps=generator_logps[rejected],
                generator_chosen_logprobs=generator_logprobs[chosen],  # [prompt, longest of the round]
                generator_rejected_logprobs=generator_logprobs[rejected],
                sampled=dict(responses=responses, chosen=chosen, rejected=rejected,
                             generator_logps=generator_logps))


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float):
    """Per-pair DPO loss:
    -log sigmoid(beta * ((log pi(y+) - log ref(y+)) - (log pi(y-) - log ref(y-))))."""
    chosen_margin = chosen_logps - ref_chosen_logps
    rejected_margin = rejected_logps - ref_rejected_logps
    return -F.logsigmoid(beta * (chosen_margin - rejected_margin))


def dpo_update(learner, optimizer, scheduler, mini_batch: dict, args: Args, run: core.Run) -> dict:
    """One optimizer step on a mini-batch (gradients accumulated over its micro-batches): the mean
    loss over all ranks' valid pairs (DDP/FSDP average over ranks: the world_size factor)."""
    # ALGO: a prompt whose K completions tie has no pair (DPO) and no best completion (Best-of-K SFT)
    valid = mini_batch["valid"]
    num_valid = max(core.reduce_sums({"n": valid.sum().item()}, args.world_size)["n"], 1.0)
    steps = args.gradient_accumulation_steps
    size, outputs, token_outputs = args.per_device_train_batch_size, [], []
    for i in range(steps):
        micro = {key: value[i * size: (i + 1) * size] for key, value in mini_batch.items()}
        # FSDP2 reduce-scatters every micro-batch (skipping it would hold full, unsharded float32
        # gradients); DDP all-reduces on the last one only
        skip_sync = args.world_size > 1 and not args.fsdp and i < steps - 1
        # ALGO: DPO reads each pair's chosen and rejected completions in one pass; SFT the chosen alone
        responses = micro["chosen"] + micro["rejected"] if args.loss == "dpo" else micro["chosen"]
        inputs, response_mask = collate(micro["prompts"] * (len(responses) // len(micro["chosen"])),
                                        responses, run.pad_id, run.device)
        with learner.no_sync() if skip_sync else contextlib.nullcontext(), run.autocast:
            logits = response_logits(learner, inputs, response_mask.shape[1])
            token_logps = token_logprobs(logits, inputs["input_ids"], response_mask, args.temperature)
            logps = token_logps.sum(1)
            ref_chosen, ref_rejected, micro_valid = (micro[key].to(run.device) for key in (
                "ref_chosen_logps", "ref_rejected_logps", "valid"))
            if args.loss == "dpo":
                chosen_logps, rejected_logps = logps.chunk(2)
                losses = dpo_loss(chosen_logps, rejected_logps, ref_chosen, ref_rejected, args.beta)
            elif args.loss == "best_of_k_sft":  # the best completion's summed negative log-likelihood
                chosen_logps, rejected_logps = logps, torch.full_like(logps, torch.nan)
                losses = -chosen_logps
            else:
                raise ValueError(f"unknown --loss {args.loss}")
            (losses * micro_valid).sum().mul(args.world_size / num_valid).backward()
        outputs.append(torch.stack([losses, chosen_logps, rejected_logps]).detach().cpu())
        # The lag per token: learner minus generator log-prob of each token read, rows as `responses`
        # (chosen, then rejected; SFT: the chosen alone), each weighted by its pair's validity
        token_mask, rows = response_mask.float().cpu(), len(responses)
        generator = torch.cat([micro["generator_chosen_logprobs"], micro["generator_rejected_logprobs"]])
        width = generator.shape[1]  # (the round's longest completion: every micro-batch padded to it)
        token_gap = (token_logps.detach().cpu() - generator[:rows, : token_mask.shape[1]]) * token_mask
        token_weights = token_mask * micro["valid"].repeat(2)[:rows, None]
        token_outputs.append(F.pad(torch.stack([token_gap, token_weights]), (0, width - token_mask.shape[1])))
    grad_norm = core.clip_grad_norm(learner.parameters(), args.max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)

    # What the step logs: means over all ranks' valid pairs, prompts and completions. The lag: how
    # far the policy is from the weights that sampled the batch (KL(mu || pi), k3 of the sequence
    # log-ratio, over the completions the step read, and per token, k3 of each token's log-ratio,
    # whose floor does not grow with the length; main() adds how far the step moved it)
    losses, chosen_logps, rejected_logps = torch.cat(outputs, dim=1)  # (rejected: NaN for SFT)
    token_gap, token_weights = torch.cat(token_outputs, dim=1).double()
    scores, read = mini_batch["scores"], [(chosen_logps, mini_batch["generator_chosen_logps"])]
    if args.loss == "dpo":
        read.append((rejected_logps, mini_batch["generator_rejected_logps"]))
    generator_gap, read_valid = torch.cat([a - b for a, b in read]).double(), valid.repeat(len(read))
    margins = torch.where(valid > 0, scores.max(1).values - scores.min(1).values, torch.nan)  # (K=4: ~2x)
    return {"grad/norm": grad_norm, "reward/margin_median": core.reduce_median(
        margins, args.world_size), **core.step_stats(args.world_size, {
        f"loss/{args.loss}": (losses, valid), "logps/chosen": (chosen_logps, valid),
        **({"logps/rejected": (rejected_logps, valid)} if args.loss == "dpo" else {}),
        "logps/generator_gap": (generator_gap, read_valid), "reward/mean": scores.mean(1),
        "lag/kl": (torch.expm1(generator_gap) - generator_gap, read_valid), "objective/kl": mini_batch["kl"],
        "lag/kl_token": (torch.expm1(token_gap) - token_gap, token_weights),
        "reward/chosen": scores.max(1).values, "reward/rejected": scores.min(1).values,
        "pairs/tie_fraction": 1 - valid, "eos/fraction": mini_batch["eos"].mean(1)},
        spread=("logps/generator_gap",), lengths=mini_batch["lengths"], cut=1 - mini_batch["eos"])}


# --- Weight hand-off: a shared buffer, written by the learner, read by the generator --------------
def weight_table(model: torch.nn.Module) -> list:
    """(name, offset, shape) of every parameter that trains (LoRA: the adapter's) in one flat buffer, in
    model.parameters() order: the generator has the rest (the frozen base) already."""
    table, offset = [], 0
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        table.append((name, offset, tuple(param.shape)))
        offset += param.numel()
    return table


def make_weight_buffer(table: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One flat buffer, allocated once: shared memory on CPU, shared by CUDA IPC on GPU."""
    _, offset, shape = table[-1]
    buffer = torch.empty(offset + math.prod(shape), dtype=dtype, device=device)
    return buffer.share_memory_() if device.type == "cpu" else buffer


@torch.no_grad()
def write_weight_snapshot(model, buffer: Optional[torch.Tensor], table: list) -> None:
    """Copy the parameters into the buffer (a snapshot), only while the generator is not reading.
    Every rank calls it (gathering an FSDP2 shard is a collective); only rank 0 has a buffer."""
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())  # (by name: core.check_hand_off matched the table at start)
    for name, offset, shape in table:
        full = params[name].full_tensor() if isinstance(params[name], DTensor) else params[name]
        if buffer is not None:
            buffer[offset: offset + full.numel()].copy_(full.detach().reshape(-1))
    if buffer is not None and buffer.is_cuda:
        # copy_ only queues kernels: finish them before a request makes another process read them
        torch.cuda.current_stream(buffer.device).synchronize()


def weights_from_buffer(buffer: torch.Tensor, table: list) -> list:
    return [(name, buffer[offset: offset + math.prod(shape)].view(shape))
            for name, offset, shape in table]


# --- Generator process: owns the vLLM engine ------------------------------------------------------
# A spawned process, not a thread (the paper's lost ~15-20% of each step to the GIL); it also keeps
# vLLM's side effects (patched GPTNeoX classes, torch.distributed) out of the learner.
def generator_main(engine_kwargs: dict, weight_layout: list, stop_id: int, requests, results,
                   cores: Optional[list], run_tmp_dir: str, log_path: Optional[str]) -> None:
    try:
        generator_io.become_generator(cores, run_tmp_dir, log_path)  # own cores, log file, no Ctrl-C
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # build the engine inside this process
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        vllm_imported = generator_io.imports_done()  # (left out of the GC's scans: vLLM's build runs several)
        llm = LLM(**engine_kwargs)
        results.put(dict(kind="ready", startup=generator_io.startup_seconds(vllm_imported)))
        # The hand-off's buffer comes first (shared memory, or CUDA IPC on GPU): the learner allocates
        # it once its models are in place, so that at 8B it does not add to the learner's load peak
        start = requests.get()
        weight_buffer, adapter_config = start["weight_buffer"], start["adapter_config"]  # (LoRA's, or None)
        loaded_version = 0  # the engine starts from the SFT checkpoint: the learner's version 0
        adapter = None  # LoRA: the loaded version's adapter (None: the base, version 0's exactly)
        while (request := requests.get()) is not None:
            load_start = time.time()
            if request["weights_version"] != loaded_version:
                # In place (vllm/model_executor/model_loader/reload/): captured CUDA graphs stay valid
                weights = weights_from_buffer(weight_buffer, weight_layout)
                if adapter_config is None:
                    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
                else:  # LoRA: the base stays; the new version's adapter samples every request from now on
                    adapter = lora.load_adapter(llm, weights, request["weights_version"], adapter_config)
                if torch.cuda.is_available():  # done reading before the learner may rewrite it
                    torch.cuda.synchronize()
                loaded_version = request["weights_version"]
            # An empty prefix cache and a seed per prompt: a request depends on its seed and weights
            generator_io.reset_prefix_cache(llm.llm_engine)  # (checked: vLLM may refuse)
            sampling = [SamplingParams(n=request["n"], temperature=request["temperature"],
                                       max_tokens=request["max_tokens"], logprobs=0, detokenize=False,
                                       stop_token_ids=[stop_id], seed=request["seed"] + i * request["n"])
                        for i in range(len(request["prompts"]))]
            generator_io.check_untruncated(sampling)  # (a truncated mu would compare other supports)
            generation_start = time.time()
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in request["prompts"]],
                                   sampling, lora_request=adapter, use_tqdm=False)
            completions = [c for out in outputs for c in out.outputs]
            results.put(dict({k: v for k, v in request.items() if k != "prompts"},
                             generation_version=loaded_version,
                             responses=[list(c.token_ids) for c in completions],
                             logprobs=[[p[t].logprob for t, p in zip(c.token_ids, c.logprobs)]
                                       for c in completions],
                             weight_load_start=load_start, generation_start=generation_start,
                             generation_end=time.time()))  # one clock for both processes
    except BaseException:
        results.put(dict(kind="error", traceback=traceback.format_exc()))
        raise SystemExit(1)


def engine_kwargs(args: Args, config, use_cuda: bool) -> dict:
    """vLLM's engine. processed_logprobs: log-probs of what is sampled, log_softmax(logits / T);
    enforce_eager on CPU only (on GPU, CUDA graphs make generation several times faster)."""
    max_model_len = args.max_prompt_length + max(args.response_length, args.eval_response_length)
    kwargs = dict(model=args.sft_model_path, dtype=args.dtype, seed=args.seed,
                  enforce_eager=not use_cuda, max_model_len=max_model_len,
                  gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                  logprobs_mode="processed_logprobs")
    if not use_cuda:  # size the CPU KV cache for one round of sequences (vLLM's default: 18 GiB)
        token_bytes = 2 * config.num_hidden_layers * config.hidden_size * getattr(torch, args.dtype).itemsize
        sequences = min(args.batch_size * args.num_mini_batches * args.num_samples, 256)
        kwargs["kv_cache_memory_bytes"] = min(max(token_bytes * max_model_len * sequences, 2**25), 2**33)
        # no chunked prefill: it moves a seeded request's generator back, which a CPU one cannot do
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 4096))
    kwargs.update(lora.engine_kwargs(args, max_loras=1))  # LoRA: one version at a time, loaded between rounds
    return kwargs


def start_generator(engine_kwargs: dict, weight_layout: list, stop_id: int, cores: Optional[list],
                    args: Args) -> generator_io.Generator:
    """Spawn the generator with a one-slot queue each way (the weight buffer follows, by the queue)."""
    run_tmp_dir = tempfile.mkdtemp(prefix="async-rlhf-")
    log_path = None if args.verbose else os.path.join(args.output_dir, "generator.log")
    generator_io.quiet_resource_tracker(log_path)
    ctx = mp.get_context("spawn")
    requests, results = ctx.Queue(maxsize=1), ctx.Queue(maxsize=1)
    process = ctx.Process(target=generator_main, args=(
        engine_kwargs, weight_layout, stop_id, requests, results, cores, run_tmp_dir, log_path))
    process.start()
    return generator_io.Generator(process, requests, results, run_tmp_dir, log_path)


def submit(generator: generator_io.Generator, request: dict) -> None:
    """ASYNC: put a request in the generator's one-slot queue. Rank 0 alone holds the generator (the
    others have nothing to send); a dead generator found here is told at the next collect."""
    if generator.process is not None:
        generator_io.send(generator, request)


def collect(generator: generator_io.Generator, args: Args) -> dict:
    """ASYNC: the generator's next message from its one-slot queue: rank 0 takes it and broadcasts
    it, so that every rank takes the same batch (or the generator's error) at the same point."""
    message = generator_io.receive(generator) if args.rank == 0 else None
    if args.world_size > 1:
        box = [message]
        torch.distributed.broadcast_object_list(box, src=0)
        message = box[0]
    return generator_io.raise_error(message, args.rank)


def train_request(round_index: int, version: int, prompts: list, args: Args) -> dict:
    return dict(kind="train", round=round_index, weights_version=version, prompts=prompts,
                n=args.num_samples, temperature=args.temperature, max_tokens=args.response_length,
                seed=core.sampling_seed(args.seed, "train", round_index))


def eval_request(version: int, prompts: list, args: Args, final: bool = False) -> dict:
    return dict(kind="eval", final=final, weights_version=version, prompts=prompts, n=1,
                temperature=args.eval_temperature, max_tokens=args.eval_response_length,
                seed=core.sampling_seed(args.seed, "eval", version), requested=time.time())


# --- Evaluation: win rates against the reference summaries under the proxy and gold rewards -------
def evaluation_set(eval_data, tokenizer, reward_models: dict, args: Args, run: core.Run) -> dict:
    """The validation prompts (the first num_eval_prompts during training), this rank's share, and
    its reference summaries with their scores, which never change (gold's: no missing-EOS penalty)."""
    eval_data = eval_data.select(range(min(args.num_final_eval_prompts or 10**9, len(eval_data))))
    prompts = core.tokenize_prompts(tokenizer, eval_data["query"], args.max_prompt_length)
    my_prompts = prompts[args.rank:: args.world_size]
    references = eval_data["reference_response"][args.rank:: args.world_size]
    references = tokenizer(list(references), add_special_tokens=False)["input_ids"]
    references, references_eos = truncate_at_eos(references, args.eval_response_length, run.eos_id)
    reference_scores = {
        name: score_in_chunks(model, my_prompts, references, references_eos,
                              args.missing_eos_penalty if name == "proxy" else None,
                              args.per_device_train_batch_size * args.num_samples, run)
        for name, model in reward_models.items()}
    return dict(prompts=prompts, num_prompts=min(args.num_eval_prompts, len(prompts)), data=eval_data,
                my_prompts=my_prompts, references=dict(reference_scores, tokens=references))


def evaluate(responses: list, prompts: list, references: dict, reward_models: dict, ref_policy,
             args: Args, run: core.Run) -> dict:
    """This rank's sums: wins against the references (a tie counts half), scores, the SFT model's
    log-probs of them."""
    responses, has_eos = truncate_at_eos(responses, args.eval_response_length, run.eos_id)
    chunk = args.per_device_train_batch_size * args.num_samples
    sums = {"count": len(responses), "eos": sum(has_eos)}
    # A completion that is its reference ties with it (half a win), whatever float noise says
    ties = torch.tensor([r == t for r, t in zip(responses, references["tokens"])])
    for name, model in reward_models.items():
        penalty = args.missing_eos_penalty if name == "proxy" else None  # gold: the summary as is
        scores = score_in_chunks(model, prompts, responses, has_eos, penalty, chunk, run)
        wins = (scores > references[name][: len(scores)]).float()
        sums[f"{name}_wins"] = torch.where(ties, 0.5, wins).sum().item()
        sums[f"{name}_reward"] = scores.sum().item()
    logps = logprobs_in_chunks(ref_policy, prompts, responses, 1.0, chunk, run).sum(1)
    counts = torch.tensor([len(r) for r in responses])
    # The paper's "KL" axis: per sample, exp(response NLL / (prompt + response tokens)), then mean
    lengths = torch.tensor([len(p) for p in prompts]) + counts
    sums.update(logp=logps.sum().item(), tokens=counts.sum().item(),
                paper_perplexity=torch.exp(-logps / lengths).sum().item())
    return sums


def eval_record(sums: dict, step: int, args: Args) -> dict:
    n = int(sums["count"])
    record = {"step": step, "episode": metrics.episodes_at(step, args), "eval/num_prompts": n,
              "eval/perplexity": math.exp(-sums["logp"] / max(sums["tokens"], 1)),
              "eval/perplexity_paper": sums["paper_perplexity"] / n,
              "eval/eos_fraction": sums["eos"] / n}
    for name in ("proxy", "gold"):
        if f"{name}_wins" in sums:
            win_rate = sums[f"{name}_wins"] / n
            record.update({f"eval/{name}_win_rate": win_rate,
                           f"eval/{name}_reward": sums[f"{name}_reward"] / n,
                           f"eval/{name}_win_rate_stderr": math.sqrt(win_rate * (1 - win_rate) / n)})
    return record


def score_evaluation(message: dict, training_start: Optional[float], eval_set: dict,
                     reward_models: dict, ref_policy, tokenizer, args: Args, run: core.Run,
                     metrics_file) -> float:
    """Score an evaluation's completions on every rank, then print and log it. Returns seconds."""
    start = time.time()
    responses = message["responses"][args.rank:: args.world_size]
    prompts = eval_set["my_prompts"][: len(responses)]
    sums = core.reduce_sums(evaluate(responses, prompts, eval_set["references"], reward_models,
                                     ref_policy, args, run), args.world_size)
    record = eval_record(sums, message["generation_version"], args)
    record.update(metrics.eval_times(message, start, training_start))
    if args.rank == 0 and message["final"]:  # whole, with the references (benchmarks/judge.py)
        whole = truncate_at_eos(message["responses"], args.eval_response_length, run.eos_id)[0]
        metrics.save_completions(args.output_dir, eval_set["data"], whole, tokenizer)
    if args.rank == 0:
        responses = truncate_at_eos(responses[:3], args.eval_response_length, run.eos_id)[0]
        record["eval/samples"] = [dict(prompt=tokenizer.decode(p)[-200:], response=tokenizer.decode(r))
                                  for p, r in zip(prompts, responses)]
        metrics.print_evaluation(record, reward_models)
    metrics.log(record, metrics_file, args.track)
    return time.time() - start


if __name__ == "__main__":
    launch.run(main, resolve_args(launch.parse_args(Args, TINY_DEFAULTS, PRESET_DEFAULTS)))
