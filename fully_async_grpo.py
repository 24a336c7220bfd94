"""Fully asynchronous GRPO: the asynchronous pipeline as current RL systems run it, on a verifiable task.

Where async_dpo.py keeps one batch in flight (every step exactly one version stale), here the generator streams:
it keeps many prompts' groups (a prompt's K samples) in its engine at once, stepping it by hand, and sends each group
to the learner the moment its last completion ends, every token tagged with the weight version that sampled it. A
bound keeps the data fresh enough: no group trains a learner more than --max_staleness k versions ahead of its
sampler (its oldest token's).
  Generator (`generator_main`): admit a group while the bound allows (`pace`: only a group that will not arrive too
    stale; `drop`: as many as the stream holds; `head`: while at most k versions ahead), step the engine, send each
    finished group; load the newest version the learner published (its slot among k + 1) with nothing
    mid-generation, or (--inflight_updates) between two engine steps, the running completions going on under it.
  Learner, step v of the loop in `main()`:
    1. take B groups from the stream, each as it arrives (`drop`: discard those more than k versions old);
    2. grade the completions (the verifier) and compute the group-relative advantages;
    3. the proximal policy's log-probs: recomputed at the batch's start, or the sampler's own;
    4. --num_mini_batches m clipped steps, each token weighted by the sampler's corrected importance weight (with
       m = 1 under `recompute` the ratio to the proximal policy is 1 and only the weight acts; the clip from the
       second mini-batch on);  5. ASYNC: publish version v + 1 in its slot;
    6. log (the staleness, the stream and the lengths);  7. evaluate;  8. checkpoint.
k = 0 is synchronous and on-policy. CPU demo: `python fully_async_grpo.py --model tiny`; docs/fully_async.md. The
stream's words (version, published, loaded, slot, room, place, taken, adoption) mean what docs/glossary.md says.
"""
import contextlib
import json
import math
import os
import queue
import random
import re
import time
import traceback
from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM

import tiny_world
from plumbing import audit, checkpoint, core, generator_io, launch, lora, metrics, transport
from plumbing import chat as plumbing_chat

# --model: (SFT policy, dataset, the prompt format the policy was trained on ({question}: the problem; chat: in its
# chat template), where its answer is)
PRESETS = {"rho-1b": ("realtreetune/rho-1b-sft-GSM8K", "openai/gsm8k", "[MATH_TASK] Problem:\n{question}\n\nSolution:",
                      "####"),
           "qwen2.5-1.5b-instruct": ("Qwen/Qwen2.5-1.5B-Instruct", "openai/gsm8k", "chat:{question}\nPlease reason "
                                     "step by step, and put your final answer within \\boxed{}.", "boxed")}
# `--model tiny` swaps in defaults that train the shipped chains world's policy on 2 CPU cores in minutes.
TINY_DEFAULTS = dict(
    lag_every=1, learning_rate=1e-4, temperature=1.0, response_length=128, max_prompt_length=192,
    total_episodes=6144, batch_size=64, per_device_train_batch_size=64, num_samples=4, eval_every=24,
    num_eval_prompts=400, eval_response_length=128,
)

# Flags a resumed run may change: where and how it logs, and its evaluations (they draw no training
# sample). Any other difference from the checkpoint's run is refused, naming the flag.
MAY_DIFFER_ON_RESUME = {
    "exp_name", "track", "wandb_project", "wandb_entity", "output_dir", "save_model", "save_merged", "verbose",
    "tiny_dir", "vllm_gpu_memory_utilization", "generator_cores", "num_generators", "generator_nodes",
    "record_rollouts", "record_every",
    "gradient_checkpointing", "save_every", "resume_from", "run_name", "rank", "lag_every", "eval_every",
    "num_eval_prompts", "num_final_eval_prompts", "eval_temperature", "eval_response_length"}


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
    """checkpoint every this many optimizer steps (0: never; then SIGTERM too)"""
    resume_from: Optional[str] = None
    """continue the run in this folder (or its checkpoint folder) where its checkpoint left it"""
    verbose: bool = False
    """show vLLM's own log on the console (by default it goes to {output_dir}/generator.log)"""
    record_rollouts: bool = False
    """write every group the learner takes (prompt, tokens, the sampler's log-probs, each token's version) to
    {output_dir}/rollouts.jsonl and every version's weights to {output_dir}/versions/, to audit a run
    (benchmarks/token_versions.py checks each token's log-prob against its own version's)"""
    record_every: int = 1
    """with --record_rollouts, keep the weights of every this many versions only (each is the policy's size: a
    rho-1b run's every version is ~550 GB; the tokens of a version not kept are not audited)"""

    # Models and data
    model: Literal["tiny", "rho-1b", "qwen2.5-1.5b-instruct"] = "rho-1b"
    """preset naming the policy, dataset, prompt format and answer format; `tiny`: the long-tailed chains world
    shipped in worlds/"""
    sft_model_path: Optional[str] = None
    """SFT policy (hub name or local folder) to train (default: the preset's)"""
    dataset: Optional[str] = None
    """problems with a question (or `messages`) and an answer column, `train` and `test` splits (hub or folder;
    default: the preset's)"""
    dataset_config: Optional[str] = None
    """the dataset's configuration on the hub (`main` for openai/gsm8k)"""
    question_column: str = "question"
    """the dataset's column with the problem (a `messages` column, a chat, takes its place when there is one)"""
    answer_column: str = "answer"
    """the dataset's column with the reference answer (its number after "####" if it has one, else its last)"""
    answer_format: Optional[Literal["####", "boxed", "last_number"]] = None
    """where the policy's final answer is: after "####" (GSM8k's), in the last \\boxed{}, or its last number
    (default: the preset's, or the tiny world's ####)"""
    prompt_format: Optional[str] = None
    """the prompt around each problem, `{question}` where it goes; `chat:` first, the user's turn in the policy's
    chat template, the generation prompt added (`chat` alone: `chat:{question}`; a `messages` dataset: its turns;
    default: the preset's, or the tiny world's)"""
    tiny_dir: str = tiny_world.SHIPPED["chains"]
    """the chains world `--model tiny` runs on: the one in worlds/ (tiny_world.py builds others)"""

    # The stream: how stale a group may be, and what happens to one that would be staler
    max_staleness: int = 2
    """k: a group trains the learner at most k versions after the version that sampled it (0: synchronous)"""
    stale_policy: Literal["pace", "drop", "head"] = "pace"
    """`pace`: admit a group only if it cannot arrive staler than k; `drop`: admit while the stream has room, and
    discard (and count) what arrives staler; `head`: admit while the sampler is at most k versions ahead of the
    learner (AReaL's max_head_offpolicyness): with --inflight_updates a long completion's first tokens may then
    arrive staler than k, its later ones fresher (draining, `head` is `pace`)"""
    max_in_flight: Optional[int] = None
    """the stream's room: groups admitted and not yet taken by the learner, sampling or waiting (default, filled in
    by resolve_args: (k + 1) B, the bound's own room: then `drop` never has to discard; more lets it run ahead)"""
    inflight_updates: bool = False
    """load each new version between two engine steps, with completions mid-generation (AReaL, PipelineRL): one
    completion may then be sampled by several versions, each token's version and log-prob kept, and the staleness
    counts from its oldest token (default: no group admitted once a version is published; drain, then reload)"""
    kv_on_update: Literal["recompute", "keep"] = "recompute"
    """with --inflight_updates: `recompute`: the running sequences are preempted and re-read their prefixes under
    the new weights (each token's log-prob is exactly its version's); `keep`: they keep the KV cache older weights
    built (no recomputation; a token's log-prob then mixes versions, and prefix caching is off)"""

    # Algorithm specific arguments
    learning_rate: float = 1e-6
    """learning rate of AdamW, constant"""
    num_samples: int = 8
    """K: completions per prompt, a group; each one's advantage is relative to its group's"""
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    """`grpo`: (reward - group mean) / group std, each completion's tokens averaged; `dr_grpo`: reward - group mean,
    every token summed over a constant (Dr. GRPO: no length or difficulty bias); `rloo`: reward - mean of the others"""
    proximal: Literal["recompute", "behaviour"] = "recompute"
    """the policy the ratio is clipped against: the learner's own at the batch's start (`recompute`, decoupled PPO:
    one more forward pass, and the sampler corrected by w = pi_prox / mu), or the sampler's (`behaviour`: bypass)"""
    num_mini_batches: int = 1
    """m: optimizer steps per batch of B groups, each on the next 1/m of it. pi_prox is taken once, at the batch's
    start: with m = 1 and `recompute`, pi / pi_prox is 1 when the loss is taken and the clip never acts"""
    cliprange: float = 0.2
    """clip range of the per-token ratio pi / pi_prox (under `recompute` it acts from the second mini-batch on)"""
    is_correction: Optional[Literal["tis", "mis", "icepop", "none"]] = None
    """the sampler's correction, per token, by w = pi_prox / mu: `tis` truncates w at --is_cap C, `mis` masks the
    tokens whose w exceeds C, `icepop` those whose w leaves [1/C, C], `none` leaves w out (default, filled in by
    resolve_args: `tis` under `recompute`; under `behaviour` w is 1 and the only choice is `none`)"""
    is_cap: float = 2.0
    """C, the bound of --is_correction"""
    temperature: float = 0.7
    """sampling temperature; the learner divides its logits by it too, so its log-probs match the sampler's"""
    response_length: int = 512
    """maximum new tokens per completion"""
    max_prompt_length: int = 512
    """prompts longer than this keep their last tokens (where 'Solution:' sits)"""
    total_episodes: int = 128_000
    """completions to train on (K per prompt); discarded ones do not count"""
    batch_size: int = 512
    """completions per optimizer step (B groups of K), summed over all learner processes"""
    per_device_train_batch_size: int = 16
    """completions per forward pass on one learner device; gradient accumulation makes up the rest"""
    max_grad_norm: Optional[float] = 1.0
    """clip gradients to this norm (None: no clipping)"""
    lag_every: int = 10
    """log `lag/update`, the step's relative size, every this many steps (it copies the parameters to
    host memory and back)"""

    # Evaluation
    eval_every: int = 16
    """evaluate every this many optimizer steps (0: only before and after training)"""
    num_eval_prompts: int = 1319
    """test problems per evaluation during training"""
    num_final_eval_prompts: Optional[int] = None
    """test problems in the final evaluation and the SFT policy's at step 0, every gain's baseline
    (default: all)"""
    eval_temperature: float = 0.0
    """sampling temperature for evaluation (0: greedy, pass@1)"""
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
    """CPU runs only: cores reserved for each engine; the learner gets the rest"""
    num_generators: int = 1
    """G: vLLM engines on each generator node, a process each (GPU: the node's first G GPUs, its learners on the
    rest; CPU: --generator_cores cores each), one stream under one admission bound (docs/fully_async.md)"""
    generator_nodes: int = 1
    """the first this many nodes of the torchrun job host G engines each (node 0 always); the others only learn"""
    fsdp: bool = False
    """under torchrun, shard the policy over the learners with FSDP2 (default: DDP)"""

    # LoRA (plumbing/lora.py)
    lora_rank: int = 0
    """train a rank-r LoRA adapter on the frozen SFT weights instead of every weight (0: full fine-tuning); the
    hand-off then carries the adapter only. --learning_rate is not changed for you: an adapter usually wants ~10x
    full fine-tuning's (docs/lora.md: 1e-3 against the demo's 1e-4), as the -lora presets set it"""
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
    groups_per_step: int = 0
    """B: prompts (groups of K) per optimizer step"""
    local_batch_size: int = 0
    """completions per optimizer step on one learner process"""
    gradient_accumulation_steps: int = 0
    """forward passes per optimizer step (a mini-batch) on one learner process"""
    num_steps: int = 0
    """optimizer steps in total"""
    num_engines: int = 0
    """vLLM engines in all: G x --generator_nodes (engine e runs on node e // G)"""
    world_hash: str = ""
    """the tiny world's hash (SHA-256 of its SHA256SUMS), printed at the start and logged; empty for hub models"""


def resolve_args(args: Args) -> Args:
    """Args' runtime fields, right after parsing: the learner ranks, the schedule's sizes, the
    precision, where the run logs, and the preset's models and data. It checks this script's own
    flags (core.check_flags those every script has)."""
    args.rank, args.world_size = int(os.getenv("RANK", "0")), int(os.getenv("WORLD_SIZE", "1"))
    transport.check_stream_flags(args)
    core.check_flags(args, positive=("temperature", "num_samples"), unit="completions")
    args.groups_per_step = args.batch_size // args.num_samples
    args.max_in_flight = args.max_in_flight or (args.max_staleness + 1) * args.groups_per_step
    if args.max_in_flight < args.groups_per_step:
        core.fail(f"--max_in_flight {args.max_in_flight} is less than a step's {args.groups_per_step} groups: the "
                  "learner would wait for ever")
    if args.groups_per_step % args.world_size:
        core.fail(f"--batch_size {args.batch_size}: its {args.groups_per_step} groups must divide over "
                  f"{args.world_size} learner processes")
    args.local_batch_size = args.batch_size // args.world_size
    if args.local_batch_size % (args.num_mini_batches * args.per_device_train_batch_size):
        core.fail(f"--num_mini_batches {args.num_mini_batches} x --per_device_train_batch_size "
                  f"{args.per_device_train_batch_size} must divide the {args.local_batch_size} completions a learner "
                  f"process takes a step")
    mini_batch = args.local_batch_size // args.num_mini_batches  # (completions a learner process takes a step)
    args.gradient_accumulation_steps = mini_batch // args.per_device_train_batch_size
    args.is_correction = args.is_correction or ("tis" if args.proximal == "recompute" else "none")
    args.num_steps = args.total_episodes // args.batch_size
    transport.check_engines_fit(args)
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
        sft, data, args.world_hash = tiny_world.math_world(args.tiny_dir, "chains")
        preset = (sft, data, tiny_world.MATH_PROMPT, "####")  # (what the world's policy was trained on)
    else:
        preset = PRESETS[args.model]
    args.sft_model_path, args.dataset = args.sft_model_path or preset[0], args.dataset or preset[1]
    args.prompt_format, args.answer_format = args.prompt_format or preset[2], args.answer_format or preset[3]
    if args.prompt_format == "chat":
        args.prompt_format = "chat:{question}"
    if "{question}" not in args.prompt_format:
        core.fail(f"--prompt_format {args.prompt_format!r} has no {{question}} for the problem")
    args.dataset_config = args.dataset_config or {"openai/gsm8k": "main"}.get(args.dataset)
    return args


def main(args: Args, cleanup: contextlib.ExitStack) -> None:
    core.check_model_paths(args, "sft_model_path")
    train_data, test_data = core.load_prompt_splits(args.dataset, args.seed, (args.answer_column,),
                                                    ("train", "test"), args.dataset_config)
    # Placement: on each of the first --generator_nodes nodes, G vLLM engines own GPUs 0 .. G - 1 and the node's
    # learner i takes GPU G + i (GPU i on the other nodes), or, one engine on one node with no GPU spare per
    # learner, GPU i: rank 0 then sits beside vLLM. On a CPU the engines get the last G x --generator_cores cores
    # and the learner the others. A node's learner 0 (its leader) starts and talks to the node's engines
    shares_gpu0 = core.shares_gpu0() and args.num_generators == 1  # (every rank answers the same)
    local_rank, node = int(os.getenv("LOCAL_RANK", "0")), int(os.getenv("GROUP_RANK", "0"))
    hosts_engines = local_rank == 0 and node < args.generator_nodes
    gpu = local_rank if shares_gpu0 or node >= args.generator_nodes else local_rank + args.num_generators
    device, generator_cores = core.learner_device(args.world_size, gpu, args.num_generators * args.generator_cores)
    if device.type == "cpu" and generator_cores is None and args.num_generators > 1:  # too few cores to split: an
        generator_cores = sorted(os.sched_getaffinity(0))  # engine on each in turn, and every process one thread (a
        torch.set_num_threads(1)  # thread pool spinning on a shared core slowed a 2-core run 4x)
    random.seed(args.seed), np.random.seed(args.seed), torch.manual_seed(args.seed)
    metrics_file = launch.start_run(args, cleanup, MAY_DIFFER_ON_RESUME)
    use_cuda, dtype = device.type == "cuda", getattr(torch, args.dtype)
    tokenizer = core.load_tokenizer(args.sft_model_path)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=use_cuda and dtype != torch.float32)
    chat = args.prompt_format.startswith("chat:")  # (a completion then ends at the template's end of turn)
    run = core.Run(device, autocast, *core.special_ids(tokenizer, chat))  # the facts every step uses

    # The generator (rank 0) starts first: sharing GPU 0, vLLM must measure the free memory first
    config = AutoConfig.from_pretrained(args.sft_model_path)
    with torch.device("meta"):  # the buffer's layout needs the config only, no weights
        weight_layout = weight_table(lora.add_adapter(AutoModelForCausalLM.from_config(config), args))
    # ASYNC: the admission record, one for all engines (compare-and-set on torchrun's store, or one rank 0 hosts):
    # the next group's index, the versions the running groups were admitted under, the finishing order, each
    # engine's loaded version
    admission_record, record_address = transport.open_record(args)
    cleanup.callback(lambda held: None, admission_record)  # (rank 0's may host the store: kept until engines stop)
    engines = []  # this node's engines, held by its leader (the other ranks get their messages from it)
    if hosts_engines:
        engines = transport.start_engines(generator_main, engine_kwargs(args, config, use_cuda), weight_layout,
                                          run.eos_id, None if use_cuda else generator_cores, node, args)
        cleanup.callback(transport.stop_engines, engines, transport.watch_engines(engines, record_address))
    if shares_gpu0:
        transport.collect(engines, args)  # "ready": vLLM has taken its share of GPU 0 (one engine)

    # The policy trains in float32 (under autocast on GPU), loaded on the CPU and moved to the learner
    # (--fsdp: sharded there block by block). No reference model: no KL penalty, as in DAPO and Dr. GRPO
    policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=torch.float32)
    policy = lora.add_adapter(core.train_without_dropout(policy, args.gradient_checkpointing), args)
    policy = core.on_learner(policy, args, device)  # (LoRA: the base frozen, the adapter trains)
    learner = core.shard_or_replicate(policy, args, device)  # (DDP or FSDP2: what the optimizer trains)
    trained = [p for p in learner.parameters() if p.requires_grad]  # (LoRA: the adapter's)
    core.check_hand_off(policy, weight_layout)  # (what trains is what the generator receives, by name)
    optimizer = torch.optim.AdamW(trained, lr=args.learning_rate, fused=use_cuda)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)  # (constant, as GRPO runs go)

    # The prompt order: a fresh shuffle of the training prompts for each pass over them, for as many groups as
    # the run can admit (discarded groups use prompts up too)
    train_prompts = tokenize_prompts(tokenizer, train_data, args)
    train_answers = train_data[args.answer_column]  # the reference solutions (GSM8k's end in "#### <answer>")
    most_groups = (args.num_steps + args.max_staleness + 2) * args.groups_per_step * 4
    passes = -(-most_groups // len(train_prompts))
    prompt_order = np.concatenate([np.random.permutation(len(train_prompts)) for _ in range(passes)])[:most_groups]
    eval_set = evaluation_set(test_data, tokenizer, args)
    # ASYNC: k + 1 weight slots on each generator node (rank 0's, copied to the others' over torch.distributed):
    # the learner never overwrites a version an engine may still be loading
    leaders = transport.leaders_group(hosts_engines, args)  # (None: one generator node)
    weight_slots = make_weight_slots(weight_layout, len_slots(args), dtype, device) if hosts_engines else None
    for engine in engines:
        transport.submit([engine], dict(kind="start", weight_slots=weight_slots,
                                        adapter_config=lora.adapter_config(policy),  # (LoRA: its settings)
                                        prompts=[train_prompts[i] for i in prompt_order],
                                        engine=engine.engine, record=record_address))
    for _ in range(0 if shares_gpu0 else args.num_engines):
        transport.collect(engines, args)  # "ready": the engines were built while we loaded our model

    # The loop's state, fresh or (--resume_from) where a checkpoint left it: the groups the learner has taken (their
    # count, and which: every index below `below`, and those in `beyond`; a resumed generator admits the others), the
    # policy's version (optimizer steps taken; 0: the SFT weights,
    # vLLM's start), the newest version published, the last evaluation (none is pending: each is awaited)
    saved = dict(learner=learner, optimizer=optimizer, scheduler=scheduler, weight_buffer=weight_slots,
                 metrics_file=metrics_file)  # what a checkpoint holds
    loop = ((0, 0, []), 0, 0, 0, [])
    if args.resume_from:
        loop = checkpoint.resume(args, **saved)
    (next_group, below, beyond), version, published, last_eval, _ = loop
    if args.record_rollouts and not args.resume_from:  # (version 0: the SFT weights, in slot 0 like any other)
        write_weight_snapshot(policy, None if weight_slots is None else weight_slots[0], weight_layout)
        audit.record_first_version(weight_slots, weight_layout, dtype, lora.adapter_config(policy), args)
    transport.share_slots(weight_slots, leaders)  # (the other generator nodes': resumed, or version 0, as rank 0's)
    ledger = dict(arrived={}, next_place=0, taken=next_group, below=below, beyond=set(beyond), accepted=0,
                  discarded=0, learner_idle=0.0, engines={}, reports={})  # (taken: how many; below, beyond: which)
    progress = cleanup.enter_context(tqdm(total=args.num_steps, initial=version, desc=args.exp_name,
                                          disable=args.rank != 0, dynamic_ncols=True))

    def prompts_of(groups: list) -> list:  # (each group's prompt, by its index: --record_rollouts)
        return [train_prompts[prompt_order[g["index"] % len(prompt_order)]] for g in groups]

    def evaluate_now(final: bool = False, whole: bool = False) -> None:  # ASYNC: awaited, groups arriving
        # meanwhile kept for the step; whole: every test prompt, as the final evaluation's (final: and saved)
        transport.submit(engines[:1] if args.rank == 0 else [], dict(  # (engine 0 evaluates, the others stream)
            kind="eval", final=final, prompts=eval_set["prompts"] if final or whole else
            eval_set["prompts"][: eval_set["num_prompts"]], max_tokens=args.eval_response_length,
            temperature=args.eval_temperature, seed=core.sampling_seed(args.seed, "eval", version)))
        while (message := transport.collect(engines, args))["kind"] != "eval":
            arrive(message, ledger)
        score_evaluation(message, training_start, eval_set, tokenizer, args, run, metrics_file)

    training_start = None
    if not args.resume_from:  # evaluate the SFT policy, then start the clock; on the final evaluation's
        evaluate_now(whole=True)  # prompts: the gains' baseline
    if args.rank == 0:
        tqdm.write(f"the stream: {args.groups_per_step} groups of {args.num_samples} completions a step from "
                   f"{args.num_engines} engine{'s' if args.num_engines > 1 else ''}, at most "
                   f"{args.max_staleness} versions stale ({args.stale_policy}), {args.proximal} proximal policy, "
                   f"{args.advantage} advantages")
    training_start = ledger["start"] = time.time()
    open_admission(admission_record, next_group, args)
    go = dict(kind="go", first_group=next_group, **transport.still_to_admit(ledger), version=published,
              slot=published % len_slots(args),
              seed=args.seed, n=args.num_samples, temperature=args.temperature,
              max_tokens=args.response_length, max_staleness=args.max_staleness,
              groups_per_step=args.groups_per_step,
              stale_policy=args.stale_policy, max_in_flight=args.max_in_flight,
              inflight_updates=args.inflight_updates, kv_on_update=args.kv_on_update,
              engine_room=-(-args.max_in_flight // args.num_engines))  # (each engine's share of the room)
    transport.submit(engines, go)
    while version < args.num_steps:
        # 1. ASYNC: take B groups from the stream, each as it finished: (drop) a group more than k versions older
        # than the learner is discarded; (pace) none can be; (head) it is kept
        step_start = time.time()
        batch, discarded = take_groups(engines, ledger, version, args)
        took = time.time() - step_start
        if args.record_rollouts:  # (and the discarded groups, marked: every group taken is accounted for)
            for groups, fate in ((batch, "trained"), (discarded, "discarded")):
                audit.record_groups(groups, prompts_of(groups), fate, AUDITED, args)

        # 2. ALGO: grade this rank's completions; each one's advantage is relative to its group's
        train_start = time.time()
        rollout = make_rollout(batch, prompt_order, train_prompts, train_answers, tokenizer, args, run)
        rollout["advantages"] = group_advantages(rollout["rewards"].view(-1, args.num_samples), args).view(-1)

        # 3. ALGO: the proximal policy's per-token log-probs: the learner's at the batch's start, or the sampler's
        proximal_start, width = time.time(), rollout["response_mask"].shape[1]
        rollout["proximal_logprobs"] = (
            logprobs_in_chunks(policy, rollout["prompts"], rollout["responses"], args.temperature,
                               args.per_device_train_batch_size, run)[:, :width]
            if args.proximal == "recompute" else rollout["behaviour_logprobs"])
        proximal_seconds = time.time() - proximal_start

        # 4. ALGO: m clipped, importance-weighted steps, each on 1/m of the batch (one version: the last step's)
        before = core.parameters_copy(policy) if version % args.lag_every == 0 else None
        stats = grpo_update(learner, optimizer, scheduler, rollout, args, run)
        if before is not None:  # the lag: how far the batch's steps moved the policy
            stats["lag/update"] = core.relative_update(policy, before, args.world_size)
        version += 1

        # 5. ASYNC: publish the new version in slot version mod (k + 1), and how many groups were taken (the
        # stream's room, in the record). The slot held version - k - 1: first wait until every engine has loaded
        # that version or a newer one (they load the newest and never back; publish is not adopt, and an engine
        # still draining a long group may lag; under `pace` the bound already holds the learner back). The other
        # generator nodes get the slot over torch.distributed. Each engine loads the new version once nothing is
        # mid-generation in it (in flight: at its next engine step)
        sync_start, slot = time.time(), version % len_slots(args)
        adoption_wait = transport.wait_for_adoption(admission_record, engines, version - len_slots(args), args)
        write_weight_snapshot(policy, weight_slots[slot] if args.rank == 0 else None, weight_layout)
        transport.share_slots(weight_slots, leaders, slot)  # (landed before any engine is told to load it)
        transport.submit(engines, dict(kind="weights", version=version, slot=slot, taken=ledger["taken"],
                                       taken_from={e: engine["groups"] for e, engine in ledger["engines"].items()}))
        if args.record_rollouts:
            audit.record_version(weight_slots, slot, weight_layout, version, args)

        # 6. Log the step: the learning rule's statistics, the staleness, the stream, the lengths, the times
        ledger["reports"] = transport.engine_reports(admission_record, args)  # (each engine's version, idle time)
        record = dict(step=version, episode=version * args.batch_size, lr=args.learning_rate, **stats,
                      **metrics.stream_stats(batch, len(discarded), ledger, engines, args.num_engines),
                      **metrics.inflight_stats(batch))
        record.update({"time/training": sync_start - train_start, "time/proximal": proximal_seconds,
                       "time/weight_sync": time.time() - sync_start, "time/adoption_wait": adoption_wait,
                       "time/learner_wait": took, "time/elapsed": time.time() - training_start})
        metrics.log(record, metrics_file, args.track)
        progress.update(1)
        progress.set_postfix(accuracy=f"{stats['reward/accuracy']:.3f}", staleness=f"{record['staleness/mean']:.1f}")

        # 7. Evaluate (awaited: the generator drains, loads the newest version, then samples the test problems)
        if args.eval_every and version // args.eval_every > last_eval // args.eval_every and version < args.num_steps:
            last_eval = version
            evaluate_now()

        # 8. Checkpoint (--save_every, or SIGTERM) at the step's end. The groups in flight are not saved: a
        # resumed run admits every index not taken yet again (a long group still sampling, then those after the
        # last taken), sampled by the checkpoint's weights: each index is trained once
        if version < args.num_steps and checkpoint.due(args, version, steps=1):
            loop = ((ledger["taken"], ledger["below"], sorted(ledger["beyond"])), version, version, last_eval, [])
            checkpoint.save(args, loop, None, **saved, batch_in_flight=False)

    if args.record_rollouts:  # (the audit accounts for every group admitted: those still in flight too)
        leftovers = take_leftovers(admission_record, engines, ledger, args)
        audit.record_groups(leftovers, prompts_of(leftovers), "in flight at the end", AUDITED, args)
    evaluate_now(final=True)  # the whole test split, with the last weights
    progress.close()
    if args.rank == 0:
        reports = transport.engine_reports(admission_record, args).values()  # (every engine's, from the record)
        generator_idle = sum(idle for _, idle in reports) / args.num_engines  # (each's share, mean)
        tqdm.write(metrics.idle_regime(ledger["learner_idle"], generator_idle, time.time() - training_start))
    if args.save_model:  # (LoRA: the adapter, in PEFT's format; --save_merged: merged too)
        core.save_policy(policy, tokenizer, args)


# --- The stream: taking groups, publishing versions ---------------------------------------------------------------
def take_groups(engines: list, ledger: dict, version: int, args: Args) -> tuple[list, list]:
    """B groups for the step at `version`, in the order they finished (the record's order: a group from another
    engine or node may arrive before one that finished earlier, and waits for it). Under `drop` a group whose
    sampler is more than k versions behind is discarded (and returned, to be counted); under `pace` no engine
    samples one (a violation is an error: the bound is the invariant); `head` bounds admission only, and keeps
    every group. Also counts the learner's wait, each engine's groups and how long after its publication each
    version reached the engine (measured on the engine's node)."""
    batch, discarded, wait_start = [], [], time.time()
    while len(batch) < args.groups_per_step:
        group = next_finished(engines, ledger, args)
        ledger["taken"] += 1
        ledger["beyond"].add(group["index"])  # (which: every index below `below`, and those in `beyond`)
        while ledger["below"] in ledger["beyond"]:
            ledger["beyond"].remove(ledger["below"])
            ledger["below"] += 1
        engine = ledger["engines"].setdefault(group["engine"], dict(groups=0, lags=[]))
        engine["groups"] += 1
        engine["lags"] += [since_published for _, _, since_published in group["loads"]]
        staleness = version - group["version"]
        if staleness > args.max_staleness and args.stale_policy != "head":
            if args.stale_policy == "pace":
                raise RuntimeError(f"a group {staleness} versions stale under --stale_policy pace (k = "
                                   f"{args.max_staleness}): the admission bound failed")
            discarded.append(group)
            continue
        group["staleness"], group["taken_at"] = staleness, time.time()
        group["token_staleness"] = [version - v for spans in group["spans"] for v, start, end in spans
                                    for _ in range(end - start)]  # (each token's, by the version that sampled it)
        batch.append(group)
    ledger["learner_idle"] += time.time() - wait_start
    ledger["accepted"] += len(batch)
    ledger["discarded"] += len(discarded)
    return batch, discarded


def next_finished(engines: list, ledger: dict, args: Args) -> dict:
    """The next group in the record's finishing order (one from another engine or node may arrive first: kept)."""
    while ledger["next_place"] not in ledger["arrived"]:
        arrive(transport.collect(engines, args), ledger)
    ledger["next_place"] += 1
    return ledger["arrived"].pop(ledger["next_place"] - 1)


def arrive(message: dict, ledger: dict) -> None:
    """A group from the stream, kept by its place in the finishing order (the record's: the order the bound counts)."""
    if message["kind"] != "group":
        raise RuntimeError(f"expected a group from the generator, got {message['kind']}")
    message["arrived_at"] = time.time()  # (its wait here, on this rank's clock; `queued`: on its node's)
    ledger["arrived"][message["place"]] = message


def len_slots(args: Args) -> int:
    """The weight slots: k + 1 (the learner never overwrites a version the generator may still be loading)."""
    return args.max_staleness + 1


# --- The end of the stream, and --record_rollouts' audit of every group admitted ----------------------------
# What rollouts.jsonl keeps of a group
AUDITED = ("responses", "logprobs", "spans", "engine")


def take_leftovers(admission_record, engines: list, ledger: dict, args: Args) -> list:
    """After the last step: close admission (the record's room, none), wait until no group runs, and take every
    group still in the stream, in finishing order (their number rank 0 reads from the record)."""
    count = [0]
    if args.rank == 0:
        count = [transport.close_admission(admission_record, engines)["finished"] - ledger["next_place"]]
    if args.world_size > 1:
        torch.distributed.broadcast_object_list(count, src=0)
    return [next_finished(engines, ledger, args) for _ in range(count[0])]


# --- The reward, a verifier (to train on your own, replace `training_reward`) ------------------------------------
def extract_answer(text: str, answer_format: str) -> Optional[float]:
    """The final answer as a number: after the first "####" (GSM8k's format), in the last \\boxed{}, or the last
    number in the text. None when there is none."""
    number = r"(-?[\d,]*\.?\d+)"
    if answer_format == "####":
        found = re.findall(r"####\s*\$?\s*" + number, text)[:1]
    elif answer_format == "boxed":
        found = re.findall(r"\\boxed\{\s*\$?\s*" + number, text)[-1:]
    elif answer_format == "last_number":
        found = re.findall(number, text)[-1:]
    else:
        raise ValueError(f"unknown --answer_format {answer_format}")
    return float(found[0].replace(",", "")) if found else None


def correctness(tokenizer, responses: list[list[int]], answers: list[str], args: Args) -> torch.Tensor:
    """The verifiable reward: 1 where the final answer (--answer_format) equals the reference's (its number after
    "####" if it has one, else its last), as numbers, else 0."""
    predicted = [extract_answer(text, args.answer_format)
                 for text in tokenizer.batch_decode(responses, skip_special_tokens=True)]
    references = [extract_answer(a, "####" if "####" in a else "last_number") for a in map(str, answers)]
    return torch.tensor([float(p is not None and p == r) for p, r in zip(predicted, references)])


def training_reward(tokenizer, responses: list[list[int]], answers: list[str], args: Args) -> torch.Tensor:
    """Each completion's training reward: the verifier's grade. The evaluation's pass@1 calls `correctness`
    itself: replacing this function leaves it as it is."""
    return correctness(tokenizer, responses, answers, args)


# --- GRPO: the rollout, the group-relative advantages, the loss and the update -------------------------------------
def make_rollout(batch: list, prompt_order, train_prompts: list, train_answers: list, tokenizer, args: Args,
                 run: core.Run) -> dict:
    """This rank's share of the batch's groups, a row per completion: prompt, response (cut after EOS), reward,
    whether it ended, the sampler's per-token log-probs (its behaviour policy mu), the mask of its tokens and the
    version that sampled it."""
    mine = batch[args.rank:: args.world_size]
    prompts, responses, logprobs, answers, versions = [], [], [], [], []
    for group in mine:
        index = prompt_order[group["index"] % len(prompt_order)]
        for response, logprob in zip(group["responses"], group["logprobs"]):
            prompts.append(train_prompts[index])
            answers.append(train_answers[index])
            responses.append(response)
            logprobs.append(logprob)
            versions.append(group["version"])
    responses, has_eos = truncate_at_eos(responses, args.response_length, run.eos_id)
    width = max(map(len, responses))
    mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in responses])
    behaviour = torch.tensor([lp[: len(r)] + [0.0] * (width - len(r)) for lp, r in zip(logprobs, responses)])
    return dict(prompts=prompts, responses=responses, rewards=training_reward(tokenizer, responses, answers, args),
                ended=torch.tensor(has_eos, dtype=torch.float), behaviour_logprobs=behaviour, response_mask=mask,
                versions=torch.tensor(versions, dtype=torch.float))


def group_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """rewards [groups, K] -> each completion's advantage against its group: GRPO's (r - mean) / (std + 1e-6),
    Dr. GRPO's r - mean (no division by the std, which favours the easiest and hardest problems), or RLOO's
    leave-one-out r - mean of the other K - 1. A group whose K rewards tie has no signal: its advantages are set to
    exactly 0 (with real-valued rewards the float32 mean is an ulp off, and GRPO's std of an ulp would turn that
    into an advantage of up to +-0.5 for every completion of the group)."""
    tied = (rewards == rewards[:, :1]).all(1, keepdim=True)
    mean = rewards.mean(1, keepdim=True)
    if args.advantage == "grpo":
        advantages = (rewards - mean) / (rewards.std(1, keepdim=True) + 1e-6)
    elif args.advantage == "dr_grpo":
        advantages = rewards - mean
    elif args.advantage == "rloo":
        advantages = rewards - (rewards.sum(1, keepdim=True) - rewards) / (rewards.shape[1] - 1)
    else:
        raise ValueError(f"unknown --advantage {args.advantage}")
    return advantages.masked_fill(tied, 0.0)


def importance_weight(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, args: Args) -> tuple:
    """The sampler's correction per token, from w = pi_prox / mu (1 under `behaviour`, where pi_prox is mu): TIS
    truncates it at C (min(w, C)), MIS masks the tokens whose w exceeds C (0), IcePop masks those whose w leaves
    [1/C, C], `none` leaves it out (1). Returns the corrected weight, a constant, and where it differs from w."""
    weight, cap = torch.exp(proximal_logprobs - behaviour_logprobs).detach(), args.is_cap
    if args.is_correction == "tis":
        corrected = weight.clamp(max=cap)
    elif args.is_correction == "mis":
        corrected = weight.masked_fill(weight > cap, 0.0)
    elif args.is_correction == "icepop":
        corrected = weight.masked_fill((weight > cap) | (weight < 1 / cap), 0.0)
    elif args.is_correction == "none":
        corrected = torch.ones_like(weight)
    else:
        raise ValueError(f"unknown --is_correction {args.is_correction}")
    return corrected, corrected != weight


def grpo_loss(logprobs, proximal_logprobs, behaviour_logprobs, advantages, mask, args: Args) -> tuple:
    """Per-token terms of the clipped objective against the proximal policy, each weighted by the sampler's
    corrected importance weight w (importance_weight; 0 where `mask` leaves a token out of the loss):
    -w min(r A, clip(r, 1 - eps, 1 + eps) A), r = pi / pi_prox. Returns them, r, w, where the clip acted and where
    the correction changed w."""
    ratio = torch.exp(logprobs - proximal_logprobs)
    weight, corrected = importance_weight(proximal_logprobs, behaviour_logprobs, args)
    weight = weight * mask
    unclipped, clipped = -advantages[:, None] * ratio, -advantages[:, None] * ratio.clamp(1 - args.cliprange,
                                                                                          1 + args.cliprange)
    return weight * torch.max(unclipped, clipped), ratio, weight, (clipped > unclipped) & (mask > 0), corrected


def aggregate(token_losses: torch.Tensor, mask: torch.Tensor, num_completions: float, args: Args) -> torch.Tensor:
    """A micro-batch's share of its optimizer step's loss: GRPO (and RLOO) average each completion's tokens, then
    the completions (1 / |o|: a long wrong answer is pushed down less per token); Dr. GRPO sums every token over one
    constant, the step's completions times --response_length."""
    if args.advantage == "dr_grpo":
        return token_losses.sum() / (num_completions * args.response_length)
    if args.advantage in ("grpo", "rloo"):
        return (token_losses.sum(1) / mask.sum(1).clamp(min=1)).sum() / num_completions
    raise ValueError(f"unknown --advantage {args.advantage}")


def grpo_update(learner, optimizer, scheduler, rollout: dict, args: Args, run: core.Run) -> dict:
    """--num_mini_batches optimizer steps on the batch, each on its next 1/m, gradients accumulated over the
    mini-batch's micro-batches (DDP/FSDP average over ranks: the world_size factor). The loss reads the tokens
    rollout["response_mask"] marks, and no others (a fork masking tokens there, a tool's output, trains on none)."""
    steps, size, outputs, grad_norms = args.gradient_accumulation_steps, args.per_device_train_batch_size, [], []
    for i in range(args.num_mini_batches * steps):
        micro = {key: value[i * size: (i + 1) * size] for key, value in rollout.items()}
        last = (i + 1) % steps == 0  # the mini-batch's last micro-batch: then its optimizer step
        skip_sync = args.world_size > 1 and not args.fsdp and not last
        inputs, attended = collate(micro["prompts"], micro["responses"], run.pad_id, run.device)
        width = attended.shape[1]
        old = {k: micro[k][:, :width].to(run.device) for k in ("proximal_logprobs", "behaviour_logprobs")}
        mask = micro["response_mask"][:, :width].to(run.device)  # the loss's tokens: the rollout's own mask
        with learner.no_sync() if skip_sync else contextlib.nullcontext(), run.autocast:
            logits = response_logits(learner, inputs, width)
            logprobs = token_logprobs(logits, inputs["input_ids"], attended, args.temperature)
            losses, ratio, weight, clipped, corrected = grpo_loss(
                logprobs, old["proximal_logprobs"], old["behaviour_logprobs"], micro["advantages"].to(run.device),
                mask, args)
            # (this rank's mini-batch's mean; DDP and FSDP average the ranks' gradients: the mini-batch's mean)
            aggregate(losses, mask, args.local_batch_size / args.num_mini_batches, args).backward()
        entropy = token_entropy(logits, mask, args.temperature)
        per_token = torch.stack([ratio * mask, weight, clipped.float(), entropy, corrected.float() * mask,
                                 (logprobs - old["behaviour_logprobs"]) * mask]).detach().float().cpu()
        outputs.append(F.pad(per_token, (0, rollout["response_mask"].shape[1] - width)))
        if last:  # ALGO: the mini-batch's step
            grad_norms.append(core.clip_grad_norm(learner.parameters(), args.max_grad_norm))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

    # What the batch's steps log, over all ranks: the ratio and the importance weight over the tokens (1 and 1 at the
    # first step: the sampler had the learner's weights), the clip fraction (0 at m = 1 under `recompute`), the
    # share of tokens the correction changed, the entropy, the reward, the lag (KL(mu || pi): k3 of the sequence
    # log-ratio, and per token, k3 of each token's log-ratio, whose floor does not grow with the length)
    ratio, weight, clipped, entropy, corrected, gap = torch.cat(outputs, dim=1)
    mask, rewards = rollout["response_mask"], rollout["rewards"]
    sequence_gap = gap.sum(1).double()  # log pi(y) - log mu(y) with the weights at its mini-batch's start
    token_gap = gap.double()  # log pi(y_t | ...) - log mu(y_t | ...), 0 off the mask
    return {"grad/norm": sum(grad_norms) / len(grad_norms), **core.step_stats(args.world_size, {
        "policy/ratio_mean": (ratio, mask), "is/weight_mean": (weight, mask), "policy/clipfrac": (clipped, mask),
        "is/changed_fraction": (corrected, mask), "objective/entropy": (entropy, mask), "reward/accuracy": rewards,
        "eos/fraction": rollout["ended"], "lag/kl": torch.expm1(sequence_gap) - sequence_gap,
        "lag/kl_token": (torch.expm1(token_gap) - token_gap, mask),
        "advantage/zero_fraction": (rollout["advantages"] == 0).float()},
        maxima={"policy/ratio_max": ratio.max().item(), "is/weight_max": weight.max().item()})}


# --- Tokens and log-probs ------------------------------------------------------------------------------------------
def tokenize_prompts(tokenizer, problems, args: Args) -> list[list[int]]:
    """Token ids per problem: its question in --prompt_format, or (chat:) as the user's turn in the policy's chat
    template, the generation prompt added (a `messages` column: its turns). After BOS where the tokenizer adds
    one; long prompts keep their end, where the cue or the assistant header sits."""
    chat = args.prompt_format.startswith("chat:")
    if "messages" in problems.column_names:
        if not chat:
            core.fail(f"--dataset {args.dataset} is a chat (a `messages` column): pass --prompt_format chat")
        texts = plumbing_chat.chat_prompts(tokenizer, problems["messages"], args.sft_model_path)
    elif args.question_column not in problems.column_names:
        core.fail(f"--dataset {args.dataset}: no --question_column {args.question_column!r} (nor `messages`); "
                  f"found {problems.column_names}")
    else:
        texts = [args.prompt_format.removeprefix("chat:").format(question=q) for q in problems[args.question_column]]
        if chat:
            texts = plumbing_chat.chat_prompts(tokenizer, [[dict(role="user", content=t)] for t in texts],
                                               args.sft_model_path)
    return core.tokenize_prompts(tokenizer, texts, args.max_prompt_length)


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
def token_entropy(logits: torch.Tensor, response_mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """The entropy of each response token's distribution (0 on padding), for the logs."""
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -logprobs.exp().mul_(logprobs).sum(-1) * response_mask


@torch.no_grad()
def logprobs_in_chunks(model, prompts: list, responses: list, temperature: float, chunk: int,
                       run: core.Run) -> torch.Tensor:
    """Per-token log-probs [completions, longest] under the model as it is, in the update's precision"""
    width, logprobs = max(map(len, responses)), []
    for part in core.chunks(len(prompts), chunk, model):  # (FSDP2: as many on every rank)
        inputs, mask = collate(prompts[part], responses[part], run.pad_id, run.device)
        with run.autocast:
            logits = response_logits(model, inputs, mask.shape[1])
        chunk_logprobs = token_logprobs(logits, inputs["input_ids"], mask, temperature)
        logprobs.append(F.pad(chunk_logprobs, (0, width - mask.shape[1])).cpu())
    return torch.cat(logprobs)[: len(prompts)]


# --- Weight hand-off: k + 1 slots, written by the learner, read by the generator ------------------------------------
def weight_table(model: torch.nn.Module) -> list:
    """(name, offset, shape) of every parameter that trains (LoRA: the adapter's) in one flat slot, in
    model.parameters() order: the generator has the rest (the frozen base) already."""
    table, offset = [], 0
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        table.append((name, offset, tuple(param.shape)))
        offset += param.numel()
    return table


def make_weight_slots(table: list, slots: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[slots, parameters], allocated once: shared memory on CPU, shared by CUDA IPC on GPU (k + 1 copies of the
    policy: on a GPU, 2 bytes a parameter each in bfloat16)."""
    _, offset, shape = table[-1]
    buffer = torch.empty(slots, offset + math.prod(shape), dtype=dtype, device=device)
    return buffer.share_memory_() if device.type == "cpu" else buffer


@torch.no_grad()
def write_weight_snapshot(model, buffer: Optional[torch.Tensor], table: list) -> None:
    """Copy the parameters into a slot (a snapshot). Every rank calls it (gathering an FSDP2 shard is a
    collective); only rank 0 has the slots."""
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())  # (by name: core.check_hand_off matched the table at start)
    for name, offset, shape in table:
        full = params[name].full_tensor() if isinstance(params[name], DTensor) else params[name]
        if buffer is not None:
            buffer[offset: offset + full.numel()].copy_(full.detach().reshape(-1))
    if buffer is not None and buffer.is_cuda:
        # copy_ only queues kernels: finish them before a message makes another process read them
        torch.cuda.current_stream(buffer.device).synchronize()


def weights_from_buffer(buffer: torch.Tensor, table: list) -> list:
    return [(name, buffer[offset: offset + math.prod(shape)].view(shape)) for name, offset, shape in table]


# --- Generator process: owns the vLLM engine, stepped by hand --------------------------------------------------------
@dataclass
class Stream:
    """What the generator holds between two engine steps."""
    slots: torch.Tensor  # the k + 1 weight slots the learner writes
    prompts: list  # every group's prompt, in the order groups take them
    adapter_config: Optional[dict]  # LoRA's settings (None: full fine-tuning)
    engine: int  # this engine's number, e (its groups and its loaded version carry it)
    record: object  # the admission record every engine shares (a torch.distributed store)
    adapter: object = None  # LoRA: the loaded version's adapter, a LoRARequest (None: the base, version 0's exactly)
    go: Optional[dict] = None  # the learner's "go": the stream's settings (None: before training)
    loaded: int = 0  # the version in the engine (0: the SFT weights)
    newest: Optional[tuple] = None  # (version, slot, when it was published) of the newest version published
    taken: int = 0  # groups the learner has taken (it says so with each version)
    claimed: int = 0  # groups this engine has admitted
    taken_from_me: int = 0  # of them, the learner has taken (it says so with each version)
    running: dict = field(default_factory=dict)  # request id -> (group, version admitted under, admitted at)
    eval_request: Optional[dict] = None  # an evaluation waiting for the engine to drain
    loads: list = field(default_factory=list)  # (version, load seconds, since published) since the last group
    reprefills: list = field(default_factory=list)  # seconds of the engine step after each load that preempted
    reprefill_due: bool = False  # the next engine step re-reads preempted sequences
    idle: float = 0.0  # seconds with training under way and nothing to sample
    idle_since: Optional[float] = None
    reported: float = 0.0  # when the idle seconds were last written in the record (report_idle)


def generator_main(engine_kwargs: dict, weight_layout: list, stop_id: int, requests, results,
                   cores: Optional[list], run_tmp_dir: str, log_path: Optional[str]) -> None:
    """The streaming loop of one engine, between two engine steps: take the learner's messages (a version, an
    evaluation, stop); load the newest version (drained, or --inflight_updates: at once); evaluate once drained;
    admit groups while the bound, shared by all engines, allows; one engine step, sending each group the moment its
    K completions have all ended, every token labelled with the version that sampled it."""
    stream = None
    try:
        generator_io.become_generator(cores, run_tmp_dir, log_path)  # own cores, log file, no Ctrl-C
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, stepped by hand
        from vllm import LLM

        vllm_imported = generator_io.imports_done()  # (left out of the GC's scans: vLLM's build runs several)
        llm = LLM(**engine_kwargs)
        results.put(dict(kind="ready", startup=generator_io.startup_seconds(vllm_imported),
                         gpu=torch.cuda.current_device() if torch.cuda.is_available() else None))  # (its device)
        start = requests.get()  # the weight slots, the prompts in the order groups take them, the record
        stream = Stream(start["weight_slots"], start["prompts"], start["adapter_config"], start["engine"],
                        transport.connect_record(*start["record"]))
        stream.record.multi_set([f"loaded/{stream.engine}", f"idle/{stream.engine}"], ["0", "0"])  # (SFT weights)
        llm.llm_engine.set_weight_version("0")  # vLLM labels each token with the version set when it was sampled
        while take_messages(requests, stream):  # (False: the learner said stop)
            transport.report_idle(stream)
            load_newest(llm, stream, weight_layout)
            if stream.eval_request is not None and not stream.running:
                results.put(evaluate_drained(llm, stream, stop_id))
                continue
            admit_groups(llm.llm_engine, stream, stop_id)
            if stream.running:
                step_and_send(llm.llm_engine, stream, results)
    except BaseException:
        results.put(dict(kind="error", traceback=traceback.format_exc()))
        if stream is not None:  # (the learners on other nodes see it there, at once)
            with contextlib.suppress(Exception):
                stream.record.set("error", f"engine {stream.engine} failed: {traceback.format_exc()[-2000:]}")
        raise SystemExit(1)


def take_messages(requests, stream: Stream) -> bool:
    """The learner's messages since the last step ("go", a new version and how many groups it has taken, an
    evaluation); waits for one only when there is nothing else to do. False: stop."""
    block = not (stream.running or load_due(stream) or stream.eval_request is not None or admissible(stream))
    if block:
        transport.mark_idle(stream, True)
    while True:
        try:
            message = requests.get(timeout=0.01) if block else requests.get_nowait()
        except queue.Empty:
            if block and not admissible(stream):  # (another engine's group ending may free the bound: polled)
                transport.report_idle(stream)
                continue
            return True
        block = False
        if message is None:
            return False
        if message["kind"] == "go":  # training begins (the generator's idle clock too)
            stream.go, stream.taken = message, message["first_group"]
            transport.mark_idle(stream, True)
            if message["version"] > stream.loaded:  # (resumed: the checkpoint's weights, in their slot)
                stream.newest = (message["version"], message["slot"], message["sent"])
        elif message["kind"] == "weights":  # (sent: when this node's leader passed it on, this node's clock)
            stream.newest, stream.taken = (message["version"], message["slot"], message["sent"]), message["taken"]
            stream.taken_from_me = message["taken_from"].get(stream.engine, 0)
        elif message["kind"] == "eval":
            stream.eval_request = message
        else:
            raise ValueError(f"unknown message kind {message['kind']}")


def load_due(stream: Stream) -> bool:
    return stream.newest is not None and stream.newest[0] > stream.loaded


def load_newest(llm, stream: Stream, weight_layout: list) -> None:
    """ASYNC: load the newest complete version from its slot: with nothing mid-generation (drain, then reload), or,
    with --inflight_updates, between two engine steps with sequences mid-generation."""
    if not load_due(stream) or (stream.running and not stream.go["inflight_updates"]):
        return
    start, (version, slot, published) = time.time(), stream.newest
    weights = weights_from_buffer(stream.slots[slot], weight_layout)
    if stream.adapter_config is None:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    else:  # LoRA (drained: refused in flight): the new version's adapter samples every group admitted from now on
        stream.adapter = lora.load_adapter(llm, weights, version, stream.adapter_config)
    if torch.cuda.is_available():  # done reading before the learner may rewrite the slot
        torch.cuda.synchronize()
    stream.loaded = version
    stream.record.set(f"loaded/{stream.engine}", str(version))  # (the learner rewrites no slot an engine may read)
    llm.llm_engine.set_weight_version(str(version))  # (the tokens of the next steps are the new version's)
    # The cached prefixes hold the old weights' KV: emptied. `recompute`: the running sequences are preempted too,
    # and re-read prompt and tokens so far under the new weights at the next step (timed: the load's hidden cost).
    # `keep`: they go on with their old KV, and no prefix is cached (engine_kwargs)
    if stream.go["kv_on_update"] == "recompute":
        generator_io.reset_prefix_cache(llm.llm_engine, preempt_running=bool(stream.running))
        stream.reprefill_due = bool(stream.running)
    stream.loads.append((version, time.time() - start, time.time() - published))  # (seconds: no node's clock)


def evaluate_drained(llm, stream: Stream, stop_id: int) -> dict:
    """An evaluation, with nothing mid-generation and the newest version loaded (its time is not idle time)."""
    transport.mark_idle(stream, False)
    message = evaluation(llm, stream.eval_request, stream.loaded, stream.adapter, stop_id)
    stream.eval_request = None
    transport.mark_idle(stream, True)
    return message


def admissible(stream: Stream) -> bool:
    """Whether the bound admits the next group now, as the shared record stands."""
    return stream.go is not None and bound_allows(stream, transport.read_record(stream.record)[1])


def bound_allows(stream: Stream, state: dict) -> bool:
    """can_admit, for this engine, with the next group's index and the oldest version any engine's running group
    was admitted under (this engine's loaded one if older), from the record, and the groups in the stream by the
    learner's count with the newest version this engine knows of (as with one engine: the room frees with the
    version, which it loads before it admits more, draining); and this engine's share of the stream's room, the
    groups it admitted that the learner has not taken (backpressure per engine: an engine whose groups the learner
    takes gets room back; the first to look cannot take it all). Nothing once admission is closed."""
    oldest = min([stream.loaded, *map(int, state["running"])])
    mine = stream.claimed - stream.taken_from_me  # (this engine's groups in the stream)
    return not state["closed"] and mine < stream.go["engine_room"] and can_admit(
        stream.go, state["next"], state["next"] - stream.taken, stream.loaded, oldest, load_due(stream))


def claim_group(stream: Stream) -> Optional[int]:
    """ASYNC: the global admission. If the bound allows, take the next group's index and count it running under
    this engine's version, in one compare-and-set of the record (a race with another engine: read it again and
    retry); None if the bound does not allow. The check, the index and the running count are one atomic step, so
    no engine admits against a record another has changed (docs/fully_async.md: why this keeps `pace`'s bound)."""
    while True:
        raw, state = transport.read_record(stream.record)
        if not bound_allows(stream, state):
            return None
        group, version = state["next"], str(stream.loaded)
        state.update(next=group + 1, by=f"{stream.engine}+{group}")  # (by: each write's content is unique)
        state["running"][version] = state["running"].get(version, 0) + 1
        if transport.write_record(stream.record, raw, state):
            stream.claimed += 1
            return transport.group_index(stream.go, group)


def release_group(stream: Stream, group: int, version: int) -> int:
    """ASYNC: a finished group leaves the record's running count and gets its place in the finishing order (the
    same compare-and-set), which the learner takes groups in, whichever engine or node they come from."""
    while True:
        raw, state = transport.read_record(stream.record)
        state["running"][str(version)] -= 1
        if not state["running"][str(version)]:
            del state["running"][str(version)]
        place = state["finished"]
        state.update(finished=place + 1, by=f"{stream.engine}-{group}")
        if transport.write_record(stream.record, raw, state):
            return place


def admit_groups(engine, stream: Stream, stop_id: int) -> None:
    """ASYNC: admission control: a group enters the engine only while the bound allows (none while an evaluation
    waits for the engine to drain)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    go = stream.go
    while stream.eval_request is None and (group := claim_group(stream)) is not None:
        sampling = SamplingParams(n=go["n"], temperature=go["temperature"], max_tokens=go["max_tokens"], logprobs=0,
                                  detokenize=False, stop_token_ids=[stop_id], output_kind=RequestOutputKind.FINAL_ONLY,
                                  seed=core.sampling_seed(go["seed"], "train", group))
        generator_io.check_untruncated(sampling)  # (a truncated mu would compare other supports)
        engine.add_request(str(group), TokensPrompt(prompt_token_ids=stream.prompts[group % len(stream.prompts)]),
                           sampling, lora_request=stream.adapter)
        stream.running[str(group)] = (group, stream.loaded, time.time())
    transport.mark_idle(stream, not stream.running)


def step_and_send(engine, stream: Stream, results) -> None:
    """ASYNC: one engine step (every running sequence advances a token); a group whose K completions have all ended
    leaves at once, each completion with its (version, first token, end) spans (one span unless loaded mid-way)
    and its per-token log-probs."""
    transport.mark_idle(stream, False)
    step_start = time.time()
    outputs = engine.step()
    if stream.reprefill_due:  # the step that re-read the preempted sequences' prefixes under the new weights
        stream.reprefills.append(time.time() - step_start)
        stream.reprefill_due = False
    for output in outputs:
        if not output.finished:
            continue
        group, version, admitted = stream.running.pop(output.request_id)
        place = release_group(stream, group, version)
        completions = output.outputs
        spans = [[(int(s.version), s.start, s.end) for s in c.weight_versions] for c in completions]
        results.put(dict(
            kind="group", index=group, engine=stream.engine, place=place, admitted=admitted, finished=time.time(),
            version=min(span[0][0] for span in spans if span), spans=spans,
            responses=[list(c.token_ids) for c in completions],
            logprobs=[[p[t].logprob for t, p in zip(c.token_ids, c.logprobs)] for c in completions],
            ended=[c.finish_reason == "stop" for c in completions], loaded=stream.loaded, loads=stream.loads,
            reprefills=stream.reprefills))
        stream.loads, stream.reprefills = [], []


def can_admit(go: dict, next_group: int, in_stream: int, loaded: int, oldest: int, load_due: bool) -> bool:
    """ASYNC: the admission bound. A newer version published and no --inflight_updates: admit nothing, so that the
    engine drains and loads it. The stream holds at most --max_in_flight groups admitted and not yet taken by the
    learner (sampling, or finished and waiting). `pace`: admit group g only while g < (k + w + 1) B, w the oldest
    version a running group was admitted under (`oldest`; the loaded one when none runs; draining, they are all the
    loaded one): the learner keeps every group and takes them in the order they finish; every group that finishes
    before g was admitted before g finished, while w was at most g's own version a (g runs), so it is one of the
    (k + a + 1) B groups 0, 1, ...; at most k + a batches were taken before g's, and g arrives at most k versions
    stale, counted from its oldest token. In flight, a slow group thus holds admission back until it ends. `head`:
    w the loaded version (AReaL's rule): the sampler runs at most k versions ahead, and a slow group's first tokens
    may arrive staler. `drop`: admit while the stream has room; the learner discards what arrives staler than k.
    (Draining, the default room (k + 1) B is the bound: the learner had taken w B groups when version w was
    published, so g < (k + w + 1) B.)"""
    if load_due and not go["inflight_updates"]:
        return False
    if in_stream >= go["max_in_flight"]:
        return False
    if go["stale_policy"] in ("pace", "head"):
        version = oldest if go["stale_policy"] == "pace" else loaded
        return next_group < (go["max_staleness"] + version + 1) * go["groups_per_step"]
    if go["stale_policy"] == "drop":
        return True
    raise ValueError(f"unknown --stale_policy {go['stale_policy']}")


def evaluation(llm, request: dict, version: int, adapter, stop_id: int) -> dict:
    """The test problems sampled near-greedily with the loaded version, one seed for all."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = SamplingParams(n=1, temperature=request["temperature"], max_tokens=request["max_tokens"],
                              logprobs=0, detokenize=False, stop_token_ids=[stop_id], seed=request["seed"])
    generator_io.check_untruncated(sampling)
    start = time.time()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in request["prompts"]], sampling,
                           lora_request=adapter, use_tqdm=False)
    return dict(kind="eval", final=request["final"], generation_version=version, requested=start,
                weight_load_start=start, generation_start=start, generation_end=time.time(),
                responses=[list(out.outputs[0].token_ids) for out in outputs])


def engine_kwargs(args: Args, config, use_cuda: bool) -> dict:
    """vLLM's engine. processed_logprobs: log-probs of what is sampled, log_softmax(logits / T);
    enforce_eager on CPU only (on GPU, CUDA graphs make generation several times faster). Keeping the KV cache over
    in-flight loads, no prefix caching: a new request must not reuse a prompt's KV that older weights computed.
    The synchronous scheduler, on GPU too (vLLM's GPU default is the asynchronous one, its CPU backend's the
    synchronous): asynchronously, engine.step() launches step n + 1 before step n's tokens are back (the core's
    batch queue) and labels tokens with the version set when they come back, not when they were launched, so a
    token sampled by the old weights just before a load would carry the new version (vLLM's engine core: "weight
    versions change only while generation is paused"). Exact labels need one step in flight at a time."""
    max_model_len = args.max_prompt_length + max(args.response_length, args.eval_response_length)
    kwargs = dict(model=args.sft_model_path, dtype=args.dtype, seed=args.seed,
                  enforce_eager=not use_cuda, max_model_len=max_model_len,
                  gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                  logprobs_mode="processed_logprobs", async_scheduling=False)
    if args.inflight_updates and args.kv_on_update == "keep":  # (a cached prompt's KV could be older weights')
        kwargs["enable_prefix_caching"] = False
    if not use_cuda:  # size the CPU KV cache for the stream's room: --max_in_flight groups of K
        token_bytes = 2 * config.num_hidden_layers * config.hidden_size * getattr(torch, args.dtype).itemsize
        sequences = min(args.max_in_flight * args.num_samples, 1024)
        kwargs["kv_cache_memory_bytes"] = min(max(token_bytes * max_model_len * sequences, 2**25), 2**33)
        # no chunked prefill: it moves a seeded request's generator back, which a CPU one cannot do
        kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 4096))
    kwargs.update(lora.engine_kwargs(args, max_loras=1))  # LoRA: drained before each load, one version at a time
    return kwargs


def open_admission(record, first_group: int, args: Args) -> None:
    """Rank 0 sets the record before "go": no group running, the next one `first_group` (resumed: the groups
    taken), none finished, admission open (an engine reading it first waits for it: the store's reads wait for a
    key). take_leftovers closes it after the last step, in the record: a claim that read it open then fails its
    compare-and-set."""
    if args.rank == 0:
        record.set("admission", json.dumps(dict(next=first_group, running={}, finished=0, closed=False, by="")))


# --- Evaluation: greedy pass@1 on the test problems ----------------------------------------------------------------
def evaluation_set(test_data, tokenizer, args: Args) -> dict:
    """The test problems (the first num_eval_prompts during training), this rank's share and its answers."""
    test_data = test_data.select(range(min(args.num_final_eval_prompts or len(test_data), len(test_data))))
    prompts = tokenize_prompts(tokenizer, test_data, args)
    return dict(prompts=prompts, num_prompts=min(args.num_eval_prompts, len(prompts)),
                my_answers=test_data[args.answer_column][args.rank:: args.world_size])


def score_evaluation(message: dict, training_start: Optional[float], eval_set: dict, tokenizer, args: Args,
                     run: core.Run, metrics_file) -> None:
    """Grade an evaluation's answers on every rank (each its share), then print and log it."""
    start, responses = time.time(), message["responses"][args.rank:: args.world_size]
    responses, has_eos = truncate_at_eos(responses, args.eval_response_length, run.eos_id)
    correct = correctness(tokenizer, responses, eval_set["my_answers"][: len(responses)], args)
    lengths = sorted(map(len, responses))
    sums = core.reduce_sums({"correct": correct.sum().item(), "count": len(responses), "eos": sum(has_eos),
                             "tokens": sum(lengths)}, args.world_size)
    n, pass_at_1 = sums["count"], sums["correct"] / sums["count"]
    record = {"step": message["generation_version"], "eval/num_prompts": int(n), "eval/pass_at_1": pass_at_1,
              "eval/pass_at_1_stderr": math.sqrt(pass_at_1 * (1 - pass_at_1) / n),
              "eval/eos_fraction": sums["eos"] / n, "eval/length_mean": sums["tokens"] / n,
              **metrics.eval_times(message, start, training_start)}
    if args.rank == 0:
        tqdm.write(f"eval @ step {record['step']} ({int(n)} problems): pass@1 {pass_at_1:.3f} ± "
                   f"{record['eval/pass_at_1_stderr']:.3f}, mean length {record['eval/length_mean']:.1f} tokens")
    metrics.log(record, metrics_file, args.track)


if __name__ == "__main__":
    launch.run(main, resolve_args(launch.parse_args(Args, TINY_DEFAULTS)))
