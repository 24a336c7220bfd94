"""The toy worlds that `--model tiny` runs on: built locally, once, on a CPU in a few minutes, so that the tests and
the demo take the same code path as a real run on the Hugging Face hub's models and data.

Building toy data is not part of any algorithm, so every script imports it from here.
"""
import contextlib
import json
import os
import random
import shutil
import tempfile

import torch


@contextlib.contextmanager
def deterministic_build(seed: int):
    """One thread, deterministic kernels, fixed seeds: the same world on every run of one machine (floating point
    still differs between CPU models, so the build is also checked against targets rather than trusted blindly)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    try:
        yield random.Random(seed)
    finally:
        torch.use_deterministic_algorithms(False)
        torch.set_num_threads(threads)


def build_tldr(tiny_dir: str, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 4,
               sft_steps: int = 150) -> tuple[str, str, str]:
    """Build (once) a byte-level BPE tokenizer, a TL;DR-shaped dataset, a briefly SFT-trained Pythia-architecture
    policy and a reward model (the SFT backbone with a random, fixed score head). Returns the SFT policy's, the
    reward model's and the dataset's folders."""
    tiny_dir = os.path.expanduser(tiny_dir)
    paths = tuple(os.path.join(tiny_dir, name) for name in ("sft", "reward", "data"))
    if os.path.exists(os.path.join(tiny_dir, "READY")):
        return paths
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        GPTNeoXConfig,
        GPTNeoXForCausalLM,
        GPTNeoXForSequenceClassification,
        PreTrainedTokenizerFast,
    )

    transformers.utils.logging.disable_progress_bar()
    with deterministic_build(0) as rng:
        words = ("cat dog house car work boss friend money rent roommate game phone girlfriend boyfriend school "
                 "class exam teacher party food pizza coffee dinner weekend trip city job interview sister brother "
                 "mom dad wedding apartment landlord neighbor bike gym advice help problem question fight love break "
                 "late early happy sad angry tired week month year time night morning day plan idea moved quit "
                 "asked told said wanted needed found lost bought sold paid called").split()
        subreddits = ["relationships", "AskReddit", "personalfinance", "tifu", "jobs", "dogs", "cats", "college"]

        def example() -> dict:
            title = " ".join(rng.choices(words, k=rng.randint(3, 7)))
            post = " ".join(rng.choices(words, k=rng.randint(15, 45))) + "."
            summary = " ".join(rng.sample(post[:-1].split(), k=rng.randint(3, 8)))
            subreddit = rng.choice(subreddits)
            query = f"SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"
            return dict(query=query, reference_response=f" {summary}<|endoftext|>", subreddit=subreddit,
                        title=title, post=post, summary=summary)

        parent = os.path.dirname(os.path.abspath(tiny_dir))
        os.makedirs(parent, exist_ok=True)
        build_dir = tempfile.mkdtemp(prefix=".building-", dir=parent)
        splits = {"train": [example() for _ in range(4000)], "validation": [example() for _ in range(256)]}
        os.makedirs(os.path.join(build_dir, "data"))
        for split, rows in splits.items():
            with open(os.path.join(build_dir, "data", f"{split}.jsonl"), "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)

        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        texts = [row["query"] + row["reference_response"] for row in splits["train"]]
        bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                           show_progress=False))
        # Like Pythia's: EOS doubles as BOS, and there is no pad token (the scripts must cope without one).
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>",
                                            bos_token="<|endoftext|>")
        config = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
                               num_attention_heads=num_heads, intermediate_size=4 * hidden_size,
                               max_position_embeddings=512, bos_token_id=tokenizer.eos_token_id,
                               eos_token_id=tokenizer.eos_token_id)
        policy = GPTNeoXForCausalLM(config)
        # A short SFT on the reference summaries, so the policy writes summary-like text that ends with EOS.
        optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
        for step in range(sft_steps):
            rows = rng.sample(splits["train"], 32)
            encoded = [tokenizer(r["query"] + r["reference_response"])["input_ids"] for r in rows]
            width = max(len(e) for e in encoded)
            input_ids = torch.tensor([e + [tokenizer.eos_token_id] * (width - len(e)) for e in encoded])
            labels = torch.tensor([e + [-100] * (width - len(e)) for e in encoded])
            loss = policy(input_ids=input_ids, labels=labels).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        reward_config = GPTNeoXConfig.from_dict(config.to_dict())
        reward_config.num_labels = 1
        reward_model = GPTNeoXForSequenceClassification(reward_config)
        reward_model.gpt_neox.load_state_dict(policy.gpt_neox.state_dict())
        torch.nn.init.normal_(reward_model.score.weight, std=1.0 / hidden_size**0.5)
    for name, model in (("sft", policy), ("reward", reward_model)):
        model.save_pretrained(os.path.join(build_dir, name))
        tokenizer.save_pretrained(os.path.join(build_dir, name))
    open(os.path.join(build_dir, "READY"), "w").close()
    try:
        os.rename(build_dir, tiny_dir)
    except OSError:  # another process finished the same (deterministic) build first
        shutil.rmtree(build_dir, ignore_errors=True)
    return paths
