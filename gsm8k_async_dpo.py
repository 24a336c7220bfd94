"""Asynchronous Online DPO (Noukhovitch et al. 2024, "Asynchronous RLHF", arXiv 2410.18252) on
GSM8k: async_dpo.py with a verifiable reward, 1 if the final answer is right, else 0.
Round r of the loop in `main()` (right below Args):
  1. receive round r's completions, generated with the weights of the previous round;
  2. ASYNC: publish the newest weights and request round r+1, which vLLM generates while we train;
  3. grade the completions: a right and a wrong one form each problem's DPO pair;
  4. the frozen reference's log-probs of the pairs;
  5. N mini-batches x T epochs of DPO steps;  6. log;  7. checkpoint (--save_every).
Every step thus trains on completions of weights one step old (staleness 1, with N = T = 1).
`--sync` (sync_baseline.py's schedule): step 1 requests round r with the newest weights, then waits.
Greedy pass@1 on the test split. CPU demo: `python gsm8k_async_dpo.py --model tiny`; docs/gsm8k.md.
"""
import contextlib
import functools
import math
import os
import random
import re
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

PRESETS = {"rho-1b": ("realtreetune/rho-1b-sft-GSM8K", "openai/gsm8k")}  # --model: (SFT, dataset)
PROMPT = "[MATH_TASK] Problem:\n{question}\n\nSolution:"  # the format the SFT policy was trained on
# `--model tiny` swaps in defaults that train a locally built toy model on 2 CPU cores in minutes.
TINY_DEFAULTS = dict(
    lag_every=1, learning_rate=1e-4, temperature=1.0, response_length=32, max_prompt_length=128, total_episodes=3200,
    batch_size=32, per_device_train_batch_size=16, eval_every=25, num_eval_prompts=400,
    eval_response_length=32, eval_splits=("test", "test_unseen_facts"),
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
    model: Literal["tiny", "rho-1b"] = "rho-1b"
    """preset naming the SFT policy and dataset; `tiny`: a GSM8k miniature built on CPU"""
    sft_model_path: Optional[str] = None
    """SFT policy (hub name or local folder), also the frozen reference (default: the preset's)"""
    dataset: Optional[str] = None
    """problems with `question`, `answer` columns, `train`, `test` splits (hub or folder; default: the
    preset's)"""
    dataset_config: Optional[str] = None
    """the dataset's configuration on the hub (`main` for openai/gsm8k)"""
    tiny_dir: str = tiny_world.SHIPPED["gsm8k"]
    """the GSM8k miniature `--model tiny` runs on: the one in worlds/ (tiny_world.py builds others)"""
    sync: bool = False
    """sync_baseline.py's schedule: generate with the newest weights, then train on that batch"""

    # Algorithm specific arguments (paper defaults for GSM8k)
    learning_rate: float = 3e-6
    """learning rate of AdamW, decayed linearly to 0"""
    beta: float = 0.1
    """DPO beta: strength of the implicit KL penalty towards the SFT reference"""
    temperature: float = 0.7
    """sampling temperature; the learner divides its logits by it too, so its log-probs match"""
    num_samples: int = 4
    """K completions per prompt; a correct and an incorrect one form the DPO pair"""
    response_length: int = 512
    """maximum new tokens per completion"""
    max_prompt_length: int = 512
    """prompts longer than this keep their last tokens (where 'Solution:' sits)"""
    total_episodes: int = 129024
    """number of training prompts to consume (episodes)"""
    batch_size: int = 256
    """prompts per optimizer step, summed over all learner processes"""
    per_device_train_batch_size: int = 8
    """prompts per forward pass on one learner device; gradient accumulation makes up the rest"""
    num_mini_batches: int = 1
    """N: generate N mini-batches with one set of weights, then take N steps (off-policyness)"""
    num_epochs: int = 1
    """T: passes over each generated batch"""
    max_grad_norm: Optional[float] = 1.0
    """clip gradients to this norm (None: no clipping)"""
    lag_every: int = 10
    """log `lag/update`, the step's relative size, every this many steps (it copies the parameters to
    host memory and back: at 2.8B, 11 GB each way per rank)"""

    # Evaluation
    eval_every: int = 32
    """evaluate every this many optimizer steps (0: only before and after training)"""
    eval_splits: tuple[str, ...] = ("test",)
    """evaluation splits: the first logs `eval/pass_at_1`, another `eval/{split}/pass_at_1`"""
    num_eval_prompts: int = 1319
    """problems of each evaluation split per evaluation during training"""
    num_final_eval_prompts: Optional[int] = None
    """problems of each split in the final evaluation and the SFT policy's at step 0, every gain's
    baseline (default: all; GSM8k's test: 1,319)"""
    eval_temperature: float = 0.0
    """sampling temperature for evaluation (0: greedy, the paper's pass@1)"""
    eval_response_length: int = 512
    """maximum new tokens per evaluation completion"""

    # Systems
    dtype: Optional[Literal["bfloat16", "float16", "float32"]] = None
    """vLLM's dtype and the learner's autocast (default, filled in by resolve_args: bfloat16 on GPU,
    float32 on CPU)"""
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
    if args.eval_temperature < 0:
        core.fail(f"--eval_temperature must not be negative, got {args.eval_temperature}")
    if not args.eval_splits:
        core.fail("--eval_splits: name at least one split")
    core.check_flags(args, positive=("temperature", "num_mini_batches", "num_epochs"),
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
        sft, data, args.world_hash = tiny_world.math_world(args.tiny_dir, "gsm8k")
    else:
        sft, data = PRESETS[args.model]
    args.sft_model_path, args.dataset = args.sft_model_path or sft, args.dataset or data
    args.dataset_config = args.dataset_config or {"openai/gsm8k": "main"}.get(args.dataset)
    return args


def main(args: Args, cleanup: contextlib.ExitStack) -> None:
    core.check_model_paths(args, "sft_model_path")
    train_data, *eval_splits = core.load_prompt_splits(args.dataset, args.seed, ("question", "answer"),
                                                       ("train", *args.eval_splits), args.dataset_config)
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

    # The generator (rank 0) starts first: sharing GPU 0, vLLM must measure the free memory first
    config = AutoConfig.from_pretrained(args.sft_model_path)
    with torch.device("meta"):  # the buffer's layout needs the config only, no weights
        weight_layout = weight_table(lora.add_adapter(AutoModelForCausalLM.from_config(config), args))
    generator = generator_io.Generator()  # (the other ranks get its messages from rank 0)
    if args.rank == 0:
        generator = start_generator(engine_kwargs(args, config, use_cuda),
                                    weight_layout, None if use_cuda else generator_cores, args)
        cleanup.callback(generator.stop)
    if shares_gpu0:
        collect(generator, args)  # "ready": vLLM has taken its share of GPU 0

    # The policy trains in float32 (under autocast on GPU); the reference runs exactly as it does,
    # so that log pi - log pi_ref is 0 at step 0 on GPU as on CPU. Each goes to the learner's device as
    # it loads (--fsdp: sharded there block by block): the host never holds both (at 1B, 4 GiB each)
    tokenizer = core.load_tokenizer(args.sft_model_path)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=use_cuda and dtype != torch.float32)
    run = core.Run(device, autocast, *core.special_ids(tokenizer))  # the facts every step uses
    policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=torch.float32)
    policy = lora.add_adapter(core.train_without_dropout(policy, args.gradient_checkpointing), args)
    policy = core.on_learner(policy, args, device)  # (LoRA: the base frozen, the adapter trains)
    if args.lora_rank:  # the reference is the SFT policy: with LoRA, the policy with its adapter off
        ref_policy = lora.AdapterOff(policy)  # (no second copy of the weights)
    else:
        ref_policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=torch.float32)
        ref_policy = core.on_learner(ref_policy.eval().requires_grad_(False), args, device)
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
    train_prompts = tokenize_prompts(tokenizer, train_data["question"], args.max_prompt_length)
    train_answers = train_data["answer"]  # the reference solutions, ending in "#### <answer>"
    per_round = args.batch_size * args.num_mini_batches
    passes = -(-args.num_rounds * per_round // len(train_prompts))
    order = np.concatenate([np.random.permutation(len(train_prompts)) for _ in range(passes)])
    prompt_rounds = order[: args.num_rounds * per_round].reshape(args.num_rounds, per_round)
    # A round is N mini-batches of batch_size prompts, each split over the ranks: [N, ranks, local]
    my_prompts = np.arange(per_round).reshape(
        args.num_mini_batches, args.world_size, -1)[:, args.rank].ravel()  # this rank's positions
    eval_set = evaluation_set(eval_splits, tokenizer, args)
    eval_prompts = eval_set["prompts"][: eval_set["num_prompts"]]  # during training
    run_evaluation = functools.partial(
        score_evaluation, eval_set=eval_set, ref_policy=ref_policy, tokenizer=tokenizer, args=args,
        run=run, metrics_file=metrics_file)
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
    if not args.sync or first_round == 0:  # (--sync requests later rounds in step 1)
        submit(generator, train_request(first_round, buffer_version, first_prompts, args))
    for eval_version in pending_evals:  # (resumed: evaluations that were queued behind it)
        submit(generator, eval_request(eval_version, eval_prompts, args))
    for round_index in range(first_round, args.num_rounds):
        # 1. Receive this round's batch, sampled with the previous weights (evaluations first)
        round_start = wait_start = time.time()
        eval_seconds = 0.0
        if args.sync and round_index > 0:  # SYNC (--sync): publish the newest weights and request
            if version != buffer_version:  # this very round first (step 2's work): nothing overlaps
                write_weight_snapshot(policy, weight_buffer, weight_layout)
                buffer_version = version
            round_prompts = [train_prompts[i] for i in prompt_rounds[round_index]]
            submit(generator, train_request(round_index, version, round_prompts, args))
        while (batch := collect(generator, args))["kind"] == "eval":
            eval_seconds += run_evaluation(batch, training_start=training_start)
            pending_evals.pop(0)
        wait_end = time.time()
        if batch["round"] != round_index:
            raise RuntimeError(f"expected the batch of round {round_index}, got {batch['round']}")

        # 2. ASYNC: publish the newest weights and request the next round, which vLLM generates
        # while we train on this one (the buffer is free: vLLM loaded the last weights before it)
        sync_start = time.time()
        if version != buffer_version:
            write_weight_snapshot(policy, weight_buffer, weight_layout)
            buffer_version = version
        if not args.sync and round_index + 1 < args.num_rounds:
            next_prompts = [train_prompts[i] for i in prompt_rounds[round_index + 1]]
            submit(generator, train_request(round_index + 1, version, next_prompts, args))
        if args.eval_every and version // args.eval_every > last_eval // args.eval_every:
            last_eval = version  # queued behind the training batch: never generated after it
            submit(generator, eval_request(version, eval_prompts, args))
            pending_evals.append(version)
        sync_end = time.time()

        # 3. ALGO: grade this rank's completions; a right and a wrong one form each DPO pair
        train_start = time.time()
        prompts = [train_prompts[i] for i in prompt_rounds[round_index][my_prompts]]
        answers = [train_answers[i] for i in prompt_rounds[round_index][my_prompts]]
        pairs = make_pairs(batch, prompts, answers, my_prompts, tokenizer, args, run)

        # 4. ALGO: the frozen reference's log-probs of every pair, once per round
        ref_logps = logprobs_in_chunks(ref_policy, pairs["prompts"] * 2, pairs["chosen"]
                                       + pairs["rejected"], args.temperature,
                                       2 * args.per_device_train_batch_size, run).sum(1)
        pairs["ref_chosen_logps"], pairs["ref_rejected_logps"] = ref_logps.chunk(2)

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
                progress.set_postfix(accuracy=f"{stats['reward/accuracy']:.3f}",
                                     loss=f"{stats['loss/dpo']:.3f}", staleness=staleness)

        # 7. Checkpoint (--save_every, or SIGTERM) at the round's end
        if round_index + 1 < args.num_rounds and checkpoint.due(
                args, version, steps=args.num_mini_batches * args.num_epochs):
            loop = (round_index + 1, version, buffer_version, last_eval, pending_evals)
            pending_evals = checkpoint.save(args, loop, lambda: run_evaluation(
                collect(generator, args), training_start=training_start), **saved, batch_in_flight=not args.sync)

    # Final evaluation (the whole test split by default) with the last weights. One requested in
    # the last round may still be loading its weights: score it before the buffer is rewritten.
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
def tokenize_prompts(tokenizer, questions: list[str], max_length: int) -> list[list[int]]:
    """Token ids per problem in the paper's format (core.tokenize_prompts: after BOS where the
    tokenizer adds one, as rho-1b's SFT saw; long prompts keep their end, where 'Solution:' sits)."""
    return core.tokenize_prompts(tokenizer, [PROMPT.format(question=q) for q in questions], max_length)


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
def training_reward(tokenizer, responses: list[list[int]], answers: list[str]) -> torch.Tensor:
    """Each completion's training reward: the verifier's grade. The evaluation's pass@1 calls
    `correctness` itself: replacing this function leaves it as it is."""
    return correctness(tokenizer, responses, answers)


def extract_answer(text: str) -> Optional[float]:
    """The number after the first "####" (GSM8k's answer format), as a number: `$1,000`, `1000` and
    `1000.00` are the same answer. None when there is none."""
    match = re.search(r"####\s*\$?\s*(-?[\d,]*\.?\d+)", text)
    return float(match.group(1).replace(",", "")) if match else None


def correctness(tokenizer, responses: list[list[int]], answers: list[str]) -> torch.Tensor:
    """The verifiable reward: 1 where the final answer equals the reference's (as numbers), else 0."""
    predicted = [extract_answer(text) for text in tokenizer.batch_decode(responses, skip_special_tokens=True)]
    return torch.tensor([float(p is not None and p == extract_answer(a)) for p, a in zip(predicted, answers)])


# --- Online DPO: pairs from the graded answers, the loss and the update ---------------------------
def select_pairs(scores: torch.Tensor):
    """scores [prompts, K] -> (chosen index, rejected index, valid): a correct and an incorrect
    completion; a prompt whose K are all right or all wrong has no preference (valid=False)."""
    return scores.argmax(1), scores.argmin(1), scores.max(1).values > scores.min(1).values


def make_pairs(batch: dict, prompts: list, answers: list, my_prompts, tokenizer, args: Args,
               run: core.Run) -> dict:
    """This rank's DPO pairs, one row per prompt: its chosen and rejected completion, the grades of
    its K completions, whether it has a preference, its EOS count, the generator's log-probs."""
    K = args.num_samples
    completions = [i * K + k for i in my_prompts for k in range(K)]  # in the generator's output
    responses, has_eos = truncate_at_eos([batch["responses"][i] for i in completions],
                                         args.response_length, run.eos_id)
    scores = training_reward(tokenizer, responses, [a for a in answers for _ in range(K)]).view(-1, K)
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
                generator_rejected_logprobs=generator_logprobs[rejected])


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float):
    """Per-pair DPO loss:
    -log sigmoid(beta * ((log pi(y+) - log ref(y+)) - (log pi(y-) - log ref(y-))))."""
    chosen_margin = chosen_logps - ref_chosen_logps
    rejected_margin = rejected_logps - ref_rejected_logps
    return -F.logsigmoid(beta * (chosen_margin - rejected_margin))


def dpo_update(learner, optimizer, scheduler, mini_batch: dict, args: Args, run: core.Run) -> dict:
    """One optimizer step on a mini-batch (gradients accumulated over its micro-batches): the mean
    loss over all ranks' valid pairs (DDP/FSDP average over ranks: the world_size factor)."""
    valid_pairs = core.reduce_sums({"v": mini_batch["valid"].sum().item()}, args.world_size)["v"]
    num_valid, steps = max(valid_pairs, 1.0), args.gradient_accumulation_steps
    size, outputs, token_outputs = args.per_device_train_batch_size, [], []
    for i in range(steps):
        micro = {key: value[i * size: (i + 1) * size] for key, value in mini_batch.items()}
        # FSDP2 reduce-scatters every micro-batch (skipping it would hold full, unsharded float32
        # gradients); DDP all-reduces on the last one only
        skip_sync = args.world_size > 1 and not args.fsdp and i < steps - 1
        inputs, response_mask = collate(micro["prompts"] * 2, micro["chosen"] + micro["rejected"],
                                        run.pad_id, run.device)
        with learner.no_sync() if skip_sync else contextlib.nullcontext(), run.autocast:
            logits = response_logits(learner, inputs, response_mask.shape[1])
            token_logps = token_logprobs(logits, inputs["input_ids"], response_mask, args.temperature)
            chosen_logps, rejected_logps = token_logps.sum(1).chunk(2)
            ref_chosen, ref_rejected, valid = (micro[key].to(run.device) for key in (
                "ref_chosen_logps", "ref_rejected_logps", "valid"))
            losses = dpo_loss(chosen_logps, rejected_logps, ref_chosen, ref_rejected, args.beta)
            ((losses * valid).sum() * args.world_size / num_valid).backward()
        outputs.append(torch.stack([losses, chosen_logps, rejected_logps]).detach().cpu())
        # The lag per token: learner minus generator log-prob of each token read, rows as the
        # forward's (chosen, then rejected), each weighted by its pair's validity
        token_mask = response_mask.float().cpu()
        generator = torch.cat([micro["generator_chosen_logprobs"], micro["generator_rejected_logprobs"]])
        width = generator.shape[1]  # (the round's longest completion: every micro-batch padded to it)
        token_gap = (token_logps.detach().cpu() - generator[:, : token_mask.shape[1]]) * token_mask
        token_weights = token_mask * micro["valid"].repeat(2)[:, None]
        token_outputs.append(F.pad(torch.stack([token_gap, token_weights]), (0, width - token_mask.shape[1])))
    grad_norm = core.clip_grad_norm(learner.parameters(), args.max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)

    # What the step logs: means over all ranks' valid pairs, prompts and completions. The lag: how
    # far the policy is from the weights that sampled the batch (KL(mu || pi), k3 of the sequence
    # log-ratio, and per token, k3 of each token's log-ratio, whose floor does not grow with the
    # length; main() adds how far the step moved it, ||delta theta|| / ||theta||)
    losses, chosen_logps, rejected_logps = torch.cat(outputs, dim=1)
    token_gap, token_weights = torch.cat(token_outputs, dim=1).double()
    valid, scores = mini_batch["valid"], mini_batch["scores"]
    generator_gap = torch.cat([chosen_logps - mini_batch["generator_chosen_logps"],
                               rejected_logps - mini_batch["generator_rejected_logps"]]).double()
    return {"grad/norm": grad_norm, **core.step_stats(args.world_size, {
        "loss/dpo": (losses, valid), "logps/chosen": (chosen_logps, valid),
        "logps/rejected": (rejected_logps, valid), "logps/generator_gap": (generator_gap, valid.repeat(2)),
        "lag/kl": (torch.expm1(generator_gap) - generator_gap, valid.repeat(2)),
        "lag/kl_token": (torch.expm1(token_gap) - token_gap, token_weights),
        "reward/accuracy": scores.mean(1), "pairs/fraction": valid, "eos/fraction": mini_batch["eos"].mean(1)},
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
def generator_main(engine_kwargs: dict, weight_layout: list, requests, results, cores: Optional[list],
                   run_tmp_dir: str, log_path: Optional[str]) -> None:
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
                                       seed=request["seed"] + i * request["n"])
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


def start_generator(engine_kwargs: dict, weight_layout: list, cores: Optional[list],
                    args: Args) -> generator_io.Generator:
    """Spawn the generator with a one-slot queue each way (the weight buffer follows, by the queue)."""
    run_tmp_dir = tempfile.mkdtemp(prefix="async-rlhf-")
    log_path = None if args.verbose else os.path.join(args.output_dir, "generator.log")
    generator_io.quiet_resource_tracker(log_path)
    ctx = mp.get_context("spawn")
    requests, results = ctx.Queue(maxsize=1), ctx.Queue(maxsize=1)
    process = ctx.Process(target=generator_main, args=(
        engine_kwargs, weight_layout, requests, results, cores, run_tmp_dir, log_path))
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


# --- Evaluation: greedy pass@1 on the test split(s) -----------------------------------------------
def evaluation_set(eval_splits: list, tokenizer, args: Args) -> dict:
    """The splits' problems (num_eval_prompts of each during training, all at the end: those first),
    this rank's share (a prefix of its final share), its answers and the index of their split."""
    final = [d.take(min(args.num_final_eval_prompts or len(d), len(d))) for d in eval_splits]
    during = [min(args.num_eval_prompts, len(d)) for d in final]
    order = sorted((i >= during[s], s, i) for s, d in enumerate(final) for i in range(len(d)))
    prompts = [tokenize_prompts(tokenizer, d["question"], args.max_prompt_length) for d in final]
    answers, mine = [d["answer"] for d in final], order[args.rank:: args.world_size]
    return dict(prompts=[prompts[s][i] for _, s, i in order], num_prompts=sum(during),
                my_prompts=[prompts[s][i] for _, s, i in mine],
                my_answers=[answers[s][i] for _, s, i in mine], my_splits=[s for _, s, _ in mine])


def evaluate(responses: list, prompts: list, answers: list, splits: list, ref_policy, tokenizer,
             args: Args, run: core.Run) -> dict:
    """Sums over this rank's evaluation problems: correct answers and problems per split (pass@1 of
    the greedy answers), and the SFT model's log-probs of the answers (their perplexity)."""
    responses, has_eos = truncate_at_eos(responses, args.eval_response_length, run.eos_id)
    logps = logprobs_in_chunks(ref_policy, prompts, responses, 1.0, args.per_device_train_batch_size * 2,
                               run).sum(1)
    correct, splits = correctness(tokenizer, responses, answers), torch.tensor(splits)
    sums = {"eos": sum(has_eos), "logp": logps.sum().item(), "tokens": sum(map(len, responses))}
    for s in range(len(args.eval_splits)):  # per split: its correct answers and its problems
        in_split = splits == s
        sums[f"correct{s}"], sums[f"count{s}"] = correct[in_split].sum().item(), in_split.sum().item()
    return sums


def eval_record(sums: dict, step: int, args: Args) -> dict:
    n = [sums[f"count{s}"] for s in range(len(args.eval_splits))]
    record = {"step": step, "episode": metrics.episodes_at(step, args),
              "eval/num_prompts": int(n[0]), "eval/eos_fraction": sums["eos"] / sum(n),
              "eval/perplexity": math.exp(-sums["logp"] / max(sums["tokens"], 1))}
    for s, split in enumerate(args.eval_splits):  # the first split's keys carry no split name
        prefix, pass_at_1 = "eval/" if s == 0 else f"eval/{split}/", sums[f"correct{s}"] / n[s]
        record[prefix + "pass_at_1"] = pass_at_1
        record[prefix + "pass_at_1_stderr"] = math.sqrt(pass_at_1 * (1 - pass_at_1) / n[s])
    return record


def score_evaluation(message: dict, training_start: Optional[float], eval_set: dict, ref_policy,
                     tokenizer, args: Args, run: core.Run, metrics_file) -> float:
    """Grade an evaluation's answers on every rank, then print and log it. Returns seconds."""
    start = time.time()
    responses = message["responses"][args.rank:: args.world_size]
    mine = slice(0, len(responses))  # this rank's share of the problems evaluated
    prompts = eval_set["my_prompts"][mine]
    sums = evaluate(responses, prompts, eval_set["my_answers"][mine], eval_set["my_splits"][mine],
                    ref_policy, tokenizer, args, run)
    sums = core.reduce_sums(sums, args.world_size)
    record = eval_record(sums, message["generation_version"], args)
    record.update(metrics.eval_times(message, start, training_start))
    if args.rank == 0:
        responses = truncate_at_eos(responses[:3], args.eval_response_length, run.eos_id)[0]
        record["eval/samples"] = [dict(prompt=tokenizer.decode(p)[-200:], response=tokenizer.decode(r))
                                  for p, r in zip(prompts, responses)]
        others = "".join(f"; {s} {record[f'eval/{s}/pass_at_1']:.3f}" for s in args.eval_splits[1:])
        tqdm.write(f"eval @ step {record['step']} ({record['eval/num_prompts']} problems): pass@1 "
                   f"{record['eval/pass_at_1']:.3f} ± {record['eval/pass_at_1_stderr']:.3f}, "
                   f"perplexity {record['eval/perplexity']:.3f}{others}")
        for sample in record["eval/samples"]:
            tqdm.write(f"  ...{sample['prompt'][-60:]!r} -> {sample['response']!r}")
    metrics.log(record, metrics_file, args.track)
    return time.time() - start


if __name__ == "__main__":
    launch.run(main, resolve_args(launch.parse_args(Args, TINY_DEFAULTS)))
