"""What a fork changes first, and what must not break silently when it does: the training reward (not the
evaluation's judges), a new value of a flag (an error, not another branch), a new flag (the script's own checks and
resume rules, no edit of the plumbing all the scripts share)."""
import importlib
import math
import os
import re
from dataclasses import fields

import pytest
import torch
from conftest import REPO
from transformers import AutoModelForCausalLM, AutoTokenizer

from plumbing import core, lora
from plumbing.reward_models import load_reward_model

CPU = torch.device("cpu")
SCRIPTS = ["async_dpo", "sync_baseline", "async_ppo", "async_rloo", "gsm8k_async_dpo", "fully_async_grpo"]


def readme_reward_function() -> str:
    """The name of the function the README's "Your own reward" paragraph tells a reader to replace."""
    readme = open(os.path.join(REPO, "README.md")).read()
    paragraph = readme[readme.index("**Your own reward.**"):]
    return re.search(r"```python\ndef (\w+)\(", paragraph).group(1)


@pytest.mark.parametrize("script", ["async_dpo", "sync_baseline", "async_ppo", "async_rloo"])
def test_replacing_the_training_reward_leaves_the_evaluation_judges_alone(script, tiny_dir, monkeypatch):
    """The README says which function to replace to train on your own reward. Replaced, the training scores are the
    new rule's, while the evaluation's proxy and gold win rates are what they were (one function used to score
    training and both judges, so the gold win rate silently measured the new rule)."""
    module = importlib.import_module(script)
    sft = os.path.join(tiny_dir, "sft")
    tokenizer = AutoTokenizer.from_pretrained(sft)
    _, eval_data = core.load_prompt_splits(os.path.join(tiny_dir, "data"), seed=1)
    args = module.Args(model="tiny", num_final_eval_prompts=16, num_eval_prompts=16, num_samples=2,
                       per_device_train_batch_size=8, response_length=16, eval_response_length=16)
    run = core.Run(CPU, torch.autocast("cpu", enabled=False), tokenizer.eos_token_id, tokenizer.eos_token_id)
    reward_models = {name: load_reward_model("reward_model_path", os.path.join(tiny_dir, name), torch.float32, CPU)
                     for name in ("proxy", "gold")}
    ref_policy = AutoModelForCausalLM.from_pretrained(sft).eval()
    eval_set = module.evaluation_set(eval_data, tokenizer, reward_models, args, run)
    prompts, references = eval_set["my_prompts"], eval_set["references"]
    responses = references["tokens"][1:] + references["tokens"][:1]  # another prompt's reference as the answer

    def train_scores() -> torch.Tensor:  # the scores a training round gives these completions, K = 2 a prompt
        batch = dict(responses=[r for r in responses for _ in range(2)],
                     logprobs=[[0.0] * len(r) for r in responses for _ in range(2)])  # (per token, every script)
        make = module.make_episodes if script in ("async_ppo", "async_rloo") else module.make_pairs
        return make(batch, prompts, list(range(len(prompts))), reward_models["proxy"], args, run)["scores"]

    before = module.evaluate(responses, prompts, references, reward_models, ref_policy, args, run)
    assert not torch.all(train_scores() == 7.0)
    name = readme_reward_function()
    monkeypatch.setattr(module, name, lambda model, prompts, responses, *rest: torch.full((len(responses),), 7.0))
    assert torch.all(train_scores() == 7.0)  # training follows the new rule
    assert module.evaluate(responses, prompts, references, reward_models, ref_policy, args, run) == before


def one_step(script: str, **flags) -> tuple:
    """A script's update function, Args for one step on two prompts (one process, one micro-batch), and a
    mini-batch of two prompts' completions (RLOO's advantages and weights computed from them, by its flags)."""
    module = importlib.import_module(script)
    args = module.Args(**flags)
    args.world_size, args.batch_size, args.local_batch_size = 1, 2, 2
    args.per_device_train_batch_size, args.gradient_accumulation_steps, args.num_samples = 2, 1, 2
    prompts, responses = [[5, 6, 7], [8, 9]], [[10, 11, 0], [12], [13, 14], [12, 15]]
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    if script == "async_rloo":
        episodes = dict(prompts=[p for p in prompts for _ in range(2)], responses=responses,
                        scores=torch.tensor([1.0, 0.0, 0.5, 0.2]), eos=torch.ones(4), response_mask=mask,
                        generator_logprobs=-mask, generator_logps=-mask.sum(1))
        module.add_advantages(episodes, torch.zeros(4), -mask, args)
        return module.rloo_update, args, episodes
    pairs = dict(prompts=prompts, chosen=responses[:2], rejected=responses[2:], valid=torch.ones(2),
                 scores=torch.tensor([[1.0, 0.0], [0.5, 0.2]]), eos=torch.ones(2, 2), lengths=torch.ones(2, 2),
                 generator_chosen_logps=torch.zeros(2), generator_rejected_logps=torch.zeros(2), kl=torch.zeros(2),
                 ref_chosen_logps=torch.zeros(2), ref_rejected_logps=torch.zeros(2))
    return module.dpo_update, args, pairs


@pytest.mark.parametrize("script, flag", [("async_dpo", "loss"), ("sync_baseline", "loss"), ("async_rloo", "loss"),
                                          ("async_rloo", "is_correction"), ("async_rloo", "is_level")])
def test_a_flag_value_without_its_branch_is_an_error_naming_it(script, flag, tiny_dir):
    """A fork adds a value to a flag's Literal and forgets its branch: the update stops with an error naming the
    value, instead of silently training by another rule (an unknown --loss used to train Best-of-K SFT; RLOO's
    unknown --loss, --is_correction and --is_level fell through to proximal RLOO, no correction, token level)."""
    flags = dict(recompute_old_logprobs=True, is_correction="truncate") if script == "async_rloo" else {}
    flags[flag] = "unheard_of"
    with pytest.raises(ValueError, match=f"unknown --{flag} unheard_of"):
        update, args, mini_batch = one_step(script, **flags)  # (RLOO's weights: computed here)
        policy = AutoModelForCausalLM.from_pretrained(os.path.join(tiny_dir, "sft"))
        optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        run = core.Run(CPU, torch.autocast("cpu", enabled=False), 0, 0)
        update(policy, optimizer, scheduler, mini_batch, args, run)


def test_ppo_importance_dispatches_name_an_unknown_value():
    """PPO's --is_correction and --is_level, as RLOO's: an unknown value is an error naming it."""
    import async_ppo

    mask = torch.ones(1, 2)
    episodes = dict(scores=torch.zeros(1), generator_logprobs=-mask, response_mask=mask)
    for flag in ("is_correction", "is_level"):
        args = async_ppo.Args(recompute_old_logprobs=True, **{flag: "unheard_of"})
        with pytest.raises(ValueError, match=f"unknown --{flag} unheard_of"):
            async_ppo.add_advantages(dict(episodes), torch.zeros(1, 2), -mask, torch.zeros(1, 2), args)


def test_plumbing_reads_no_flag_of_one_script():
    """A flag that is not every script's (PPO's clip ranges, RLOO's correction, GSM8k's splits) or that is DPO's
    own learning rule (--beta, --loss) is checked and used by its script alone: a plumbing module reads only flags
    every script that imports it has (transport: the streaming twins' engines and nodes), and none of those
    (core.check_flags used to read PPO's, RLOO's and sync's flags, so a fork's new flag meant editing shared
    code)."""
    scripts = SCRIPTS + ["agentic_grpo"]
    flags = {script: {f.name for f in fields(importlib.import_module(script).Args)} for script in scripts}
    folder = os.path.join(REPO, "plumbing")
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py") and name != "__init__.py":
            users = [script for script in scripts if re.search(  # (the scripts that name it: transport, the twins)
                rf"from plumbing import [^\n]*\b{name[:-3]}\b", open(os.path.join(REPO, script + ".py")).read())]
            users = users or scripts  # (one the scripts reach through another: every script's)
            own = {"beta", "loss"} | (set.union(*flags.values()) - flags["async_dpo"]
                                      - set.intersection(*(flags[u] for u in users)))
            source = open(os.path.join(folder, name)).read()
            read = set(re.findall(r"args\.(\w+)", source)) | set(re.findall(r"getattr\(args, \"(\w+)\"", source))
            assert not read & own, f"plumbing/{name} reads {sorted(read & own)}"


def test_a_forks_new_flag_may_differ_on_resume_by_its_scripts_own_rule(tmp_path, capsys):
    """Which flags a resumed run may change is each script's own set (MAY_DIFFER_ON_RESUME), passed to the
    checkpoint code: a fork that adds a logging flag to it resumes with that flag changed; any other flag that
    differs is refused, naming it."""
    import async_dpo
    from plumbing import checkpoint

    saved = async_dpo.Args(model="pythia-410m", output_dir=str(tmp_path))
    os.makedirs(tmp_path / "checkpoint")
    torch.save(dict(args=dict(vars(saved), my_new_flag=1), wandb_id=None), tmp_path / "checkpoint" / "state.pt")
    args = async_dpo.Args(model="pythia-410m", resume_from=str(tmp_path))
    args.my_new_flag = 2
    assert checkpoint.check_same_run(args, async_dpo.MAY_DIFFER_ON_RESUME | {"my_new_flag"}) is None
    with pytest.raises(SystemExit):
        checkpoint.check_same_run(args, async_dpo.MAY_DIFFER_ON_RESUME)
    assert "its run had --my_new_flag 1, this one has 2" in capsys.readouterr().err


@pytest.mark.parametrize("script", SCRIPTS + ["agentic_grpo"])
def test_the_hand_off_copies_by_name_when_a_fork_freezes_a_parameter(script, tiny_dir):
    """A fork freezes the policy's embedding: the hand-off's table, built from a fresh model, still lists it, and
    the snapshot gives every name its own parameter's values (it paired the table with the trained parameters by
    position: every tensor after the embedding shifted, and vLLM loaded wrong values under right names). A fork
    that trains what the table lacks (LoRA, and the embedding unfrozen) is refused at start, naming it."""
    module = importlib.import_module(script)
    sft = os.path.join(tiny_dir, "sft")
    table = module.weight_table(AutoModelForCausalLM.from_pretrained(sft))
    policy = AutoModelForCausalLM.from_pretrained(sft)
    policy.get_input_embeddings().weight.requires_grad_(False)
    core.check_hand_off(policy, table)  # (frozen, listed: its SFT values go to the generator, as they are)
    _, offset, shape = table[-1]
    buffer = torch.full((offset + math.prod(shape),), float("nan"))
    module.write_weight_snapshot(policy, buffer, table)
    params = dict(policy.named_parameters())
    for name, tensor in module.weights_from_buffer(buffer, table):
        assert torch.equal(tensor, params[name].detach()), name
    args = module.Args(lora_rank=4)
    adapted = lora.add_adapter(AutoModelForCausalLM.from_pretrained(sft), args)
    adapter_table = module.weight_table(lora.add_adapter(AutoModelForCausalLM.from_pretrained(sft), args))
    adapted.get_input_embeddings().weight.requires_grad_(True)
    with pytest.raises(SystemExit):
        core.check_hand_off(adapted, adapter_table)
