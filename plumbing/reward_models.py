"""Reward models: loading one with checks (a trained score head, in float32), and scoring the
policy's completions with a reward model whose tokenizer is not the policy's (their text,
re-tokenised its own way)."""
import functools
import json
import os
from typing import Callable, Optional

import torch
from safetensors import safe_open
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from plumbing.core import bos_prefix, fail, tokenize_prompts


def load_reward_models(args, tokenizer, splits: tuple, dtype: torch.dtype) -> dict:
    """The proxy (and gold) reward models, on the CPU (core.on_learner puts them on the learner's device,
    or shards them there), each with `retokenize`: None when it reads the policy's
    token ids as they are, else the function that turns them into its own (reward_tokenizer, which
    tries the first training prompts). With --reward_chat_template and a chat dataset, the turns of
    each prompt (of every split: its ids as the scripts tokenise them) for the reward model's own
    template."""
    models, probe_texts, chats = {}, splits[0]["query"][:16], None
    if args.reward_chat_template and "messages" in splits[0].column_names:
        chats = {tuple(ids): row[:-1] for split in splits for ids, row in zip(
            tokenize_prompts(tokenizer, split["query"], args.max_prompt_length), split["messages"])}
    for name, flag in (("proxy", "reward_model_path"), ("gold", "gold_reward_model_path")):
        if getattr(args, flag):
            path = getattr(args, flag)
            models[name] = model = load_reward_model(flag, path, dtype, torch.device("cpu"))
            model.retokenize = reward_tokenizer(flag, path, model, tokenizer, probe_texts,
                                                args.reward_chat_template, args.rank, chats)
    return models


def check_score_heads(args, *flags: str) -> None:
    """Each reward model named by `flags` has a trained `score` head, read from its checkpoint's
    weight names before anything starts: a causal LM passed as one fails in seconds, not once vLLM
    is up. A checkpoint whose names cannot be read so (a .bin file) is checked as it loads."""
    for flag in flags:
        path = getattr(args, flag)
        names = weight_names(path) if path else None
        if names is not None and not any(name.split(".")[-2:] == ["score", "weight"] for name in names):
            tops = ", ".join(f"{top}.*" for top in sorted({name.split(".")[0] for name in names})[:4])
            fail(f"--{flag} {path}: {NOT_A_REWARD_MODEL} (its weights: {tops}); {SAVE_AS_CLASSIFIER}")


NOT_A_REWARD_MODEL = "not a reward model: the checkpoint has no trained `score` head"
SAVE_AS_CLASSIFIER = "pass a model saved as a sequence classifier"


def weight_names(path: str) -> Optional[list[str]]:
    """The weight names of a checkpoint in safetensors (a local folder, or a hub model's file
    headers), without loading a weight; None where they cannot be read so."""
    folder = os.path.expanduser(path)
    if not os.path.isdir(folder):
        try:
            from huggingface_hub import get_safetensors_metadata

            return list(get_safetensors_metadata(path).weight_map)
        except Exception:  # offline, .bin weights: checked as it loads
            return None
    index, single = (os.path.join(folder, name) for name in ("model.safetensors.index.json", "model.safetensors"))
    if os.path.exists(index):
        with open(index) as f:
            return list(json.load(f)["weight_map"])
    if os.path.exists(single):
        with safe_open(single, "pt") as f:
            return list(f.keys())
    return None


def load_reward_model(flag: str, path: str, dtype: torch.dtype, device: torch.device):
    """A frozen 1-label classifier with a trained head (transformers would give an SFT checkpoint a
    random one), the head in float32 (in bfloat16, close scores tie)."""
    model, info = AutoModelForSequenceClassification.from_pretrained(
        path, dtype=dtype, num_labels=1, output_loading_info=True)
    if info["missing_keys"] or not hasattr(model, "score"):
        fail(f"--{flag} {path}: {NOT_A_REWARD_MODEL} (missing {sorted(info['missing_keys'])[:4]}); "
             f"{SAVE_AS_CLASSIFIER}")
    model.score.float()
    model.retokenize = None  # reads the policy's token ids (load_reward_models may say otherwise)
    return model.to(device).eval().requires_grad_(False)


def reward_tokenizer(flag: str, path: str, model, tokenizer, probe_texts: list[str],
                     chat_template: bool, rank: int, chats: Optional[dict] = None) -> Optional[Callable]:
    """None if the reward model's tokenizer is the policy's (same vocabulary, same ids for the probe
    texts) and no chat template is asked for; else `retokenize` bound to its tokenizer, tried on the
    probe texts first so that a tokenizer that cannot encode them fails here, not mid-run."""
    try:
        own = AutoTokenizer.from_pretrained(path)
    except Exception:  # saved without its tokenizer: the policy's is the only guess
        own = tokenizer
    same = own.get_vocab() == tokenizer.get_vocab()
    same = same and own(probe_texts)["input_ids"] == tokenizer(probe_texts)["input_ids"]
    if chat_template and own.chat_template is None:
        fail(f"--reward_chat_template: the tokenizer of --{flag} {path} has no chat template")
    if same and not chat_template:
        if rank == 0:
            print(f"--{flag}: the policy's tokenizer: scores the policy's token ids as they are")
        return None
    max_length = min(getattr(model.config, "max_position_embeddings", 2**20), own.model_max_length)
    bound = functools.partial(retokenize, tokenizer, own, chat_template, max_length, chats or {})
    probe = tokenizer(probe_texts, add_special_tokens=False)["input_ids"]
    try:
        ids = bound(probe, [[] for _ in probe], [False] * len(probe))[0]
    except Exception as e:
        fail(f"--{flag} {path}: its tokenizer cannot encode the policy's text "
             f"({type(e).__name__}: {e})")
    if own.unk_token_id is not None and any(own.unk_token_id in sequence for sequence in ids):
        fail(f"--{flag} {path}: its tokenizer turns the policy's text into unknown tokens "
             f"({own.unk_token})")
    if rank == 0:
        print(f"--{flag}: its own tokenizer ({type(own).__name__}, {len(own)} tokens"
              f"{', chat template' if chat_template else ''}): scores the completions' text, "
              f"re-tokenised")
    return bound


def retokenize(tokenizer, own, chat_template: bool, max_length: int, chats: dict, prompts: list,
               responses: list, has_eos: list) -> tuple[list, list, int]:
    """The reward model's own ids for each prompt + completion, from the text the policy's ids
    decode to: its BOS if it adds one, the text, and its EOS where the policy's completion ended
    with EOS (or, in its chat template, the prompt as a user turn, a chat dataset's prompt as its
    own turns (`chats`), then the completion as an assistant turn); cut from the left to its
    maximum length, as prompts are. Returns them as prompts, empty responses, and its pad id."""
    bos, eos, ids = bos_prefix(own), [own.eos_token_id] if own.eos_token_id is not None else [], []
    pad_id = next((i for i in (own.pad_token_id, own.eos_token_id) if i is not None), 0)
    plain = dict(skip_special_tokens=True, clean_up_tokenization_spaces=False)  # the text, as it is
    for prompt, response, ended in zip(prompts, responses, has_eos):
        text = tokenizer.decode(prompt + response, **plain)
        if chat_template:  # the template writes its own special tokens
            question = tokenizer.decode(prompt, **plain)
            turns = [*chats.get(tuple(prompt), [dict(role="user", content=question)]),
                     dict(role="assistant", content=text.removeprefix(question))]
            text, head, tail = own.apply_chat_template(turns, tokenize=False), [], []
        else:
            head, tail = bos, eos * ended
        body = own(text, add_special_tokens=False)["input_ids"]
        ids.append(head + body[max(len(head) + len(body) + len(tail) - max_length, 0):] + tail)
    return ids, [[] for _ in ids], pad_id
