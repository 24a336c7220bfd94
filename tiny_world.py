"""The toy world that `--model tiny` runs on: the paper's TL;DR protocol in miniature, built locally, once, on a CPU
in a few minutes, so that the tests and the demo take the same code path as a real run with the hub's models.

The paper: a 6.9B gold reward model trained on human preferences relabels the preference data, smaller proxy reward
models are trained on those labels, RL optimises the proxy, and the gold model's win rate against the human
reference summaries judges the result. Here, the same steps at toy scale:

1. A gold judge written in code (`judge`), the ground truth of this world: a summary scores +1 for each topic word
   of its post's subreddit, -0.5 for any other word, -1 more for each word past the fourth, and -3 if it never ends.
2. Data in the hub's TL;DR format: posts of 2-4 topic words of their subreddit (each twice) among other subreddits'
   words and fillers; reference summaries that are decent but beatable (`K K the`, `K the K K`, `K K K the`).
3. An SFT policy (Pythia architecture, 0.5M parameters) trained on the reference summaries, picked among a few
   seeds so that its near-greedy summaries lose to the references most of the time.
4. A gold reward model, the SFT backbone with a score head, trained with Bradley-Terry on candidates labelled by
   the judge: it plays the paper's 6.9B gold model (`--gold_reward_model_path`).
5. A proxy reward model trained with Bradley-Terry on fewer pairs labelled by the gold model: decent but imperfect,
   which is what makes reward over-optimisation possible. It is the `--reward_model_path` of `--model tiny`.

A second world, the GSM8k miniature of `gsm8k_async_dpo.py --model tiny` (`build_gsm8k`), holds one-step arithmetic
word problems in GSM8k's format and an SFT policy that solves some of them; its reward is verifiable.

Both worlds ship with the code, in worlds/ (`SHIPPED`): `--model tiny` reads them and builds nothing (a build is not
bitwise the same on another machine, so every figure in the docs names the world it came from, by its hash). This
file builds them from nothing, into a folder of the same layout: Hugging Face `save_pretrained` folders (`sft`,
`proxy`, `gold`), a dataset folder with its card (`data`), `world.json` (what the build measured) and `SHA256SUMS`
(every file's hash; the world's hash is that file's):

    python tiny_world.py tldr ~/worlds/my-tldr            # minutes on 2 cores
    python tiny_world.py gsm8k ~/worlds/my-gsm8k
    python tiny_world.py tldr /tmp/quick-tldr --quick     # a quick build of the same layout (the tests')

Building toy worlds is not part of any algorithm, so every script imports it from here.
"""
import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from typing import Optional

import torch
import torch.nn.functional as F

TOPICS = {  # subreddit: its 8 topic words
    "relationships": "girlfriend boyfriend date love wedding breakup trust partner",
    "personalfinance": "money rent budget loan debt savings bank credit",
    "tifu": "accident mistake oops broke spilled forgot embarrassing fail",
    "jobs": "boss interview salary manager promotion coworker resume office",
    "dogs": "puppy leash bark walk vet fetch treat collar",
    "cats": "kitten litter meow purr scratch claws catnip whiskers",
    "college": "exam class professor dorm grades major lecture campus",
    "AskReddit": "question advice opinion story weird reddit thoughts curious",
}
TOPICS = {subreddit: words.split() for subreddit, words in TOPICS.items()}
FILLERS = "the and a so then just really very about with my it was is that this".split()
EOS = "<|endoftext|>"
REFERENCE_PATTERNS = ["K K the", "K the K K", "K K K the"]  # judge scores 1.5, 2.5, 2.5 of a possible 4
# The SFT policy is chosen so that its gold win rate lands here: inside the target (0.15-0.45), with room for the
# tests' recomputation of it (within 0.02 of the build's figure)
SFT_WIN_RATE_RANGE = (0.17, 0.43)
SFT_STEPS, SFT_SEEDS, SFT_SNAPSHOTS = 90, 8, (85, 80, 75, 70)  # see build_tldr, step 3
PROXY_AGREEMENT = 0.8  # the proxy trains until it orders this share of held-out pairs as the gold model does
WORLDS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worlds")
SHIPPED = {"tldr": os.path.join(WORLDS, "tldr-v3"), "gsm8k": os.path.join(WORLDS, "gsm8k-v2"),  # --tiny_dir's default
           "chains": os.path.join(WORLDS, "chains-v1"), "tools": os.path.join(WORLDS, "tools-v1"),
           "chat-tools": os.path.join(WORLDS, "chat-tools-v1"), "calls": os.path.join(WORLDS, "calls-v1")}
CHECKSUMS = "SHA256SUMS"  # `sha256sum -c SHA256SUMS` checks a world by hand
NEEDED = {  # what a script reads of each kind of world (SHA256SUMS lists every file)
    "tldr": ("world.json", "data/train.jsonl", "data/validation.jsonl", "sft/model.safetensors",
             "proxy/model.safetensors", "gold/model.safetensors"),
    "gsm8k": ("world.json", "data/train.jsonl", "data/test.jsonl", "data/test_unseen_facts.jsonl",
              "sft/model.safetensors"),
    "chains": ("world.json", "data/train.jsonl", "data/test.jsonl", "sft/model.safetensors"),
    "tools": ("world.json", "data/train.jsonl", "data/test.jsonl", "sft/model.safetensors"),
    "calls": ("world.json", "data/train.jsonl", "data/test.jsonl", "sft/model.safetensors"),
    "chat-tools": ("world.json", "data/train.jsonl", "data/test.jsonl", "sft/model.safetensors"),
}


def judge(query: str, summary: str, has_eos: bool) -> float:
    """The gold truth of this world: +1 for each topic word of the post's subreddit (repeats count), -0.5 for any
    other word, -1 more for each word past the fourth, and -3 for a summary without EOS."""
    topics = TOPICS[query.split("\n")[0].removeprefix("SUBREDDIT: r/")]
    words = summary.replace(EOS, " ").split()
    return sum(1.0 if w in topics else -0.5 for w in words) - max(len(words) - 4, 0) - (0.0 if has_eos else 3.0)


def make_example(rng: random.Random) -> dict:
    """One TL;DR-shaped row: `query` and `reference_response` (leading space, EOS text appended) as on the hub."""
    subreddit = rng.choice(list(TOPICS))
    own = rng.sample(TOPICS[subreddit], rng.randint(2, 4))
    others = [rng.choice(TOPICS[s]) for s in rng.sample([s for s in TOPICS if s != subreddit], rng.randint(3, 5))]
    words = own * 2 + others + rng.choices(FILLERS, k=rng.randint(4, 8))
    rng.shuffle(words)
    title, post = " ".join(rng.sample(words, 3)), " ".join(words) + "."
    summary = " ".join(rng.choice(own) if w == "K" else w for w in rng.choice(REFERENCE_PATTERNS).split())
    query = f"SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"
    return dict(query=query, reference_response=f" {summary}{EOS}", subreddit=subreddit, title=title, post=post,
                summary=summary)


@contextlib.contextmanager
def deterministic(seed: int):
    """Two threads on every machine, deterministic kernels, fixed seeds: the same world on every run of one machine.
    (Floating point differs between CPU models and thread counts, and it changes which SFT seed lands in range,
    which is why the build measures its targets instead of trusting a seed.)"""
    threads, was_deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    try:
        yield random.Random(seed)
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        torch.set_num_threads(threads)


def build_tokenizer(texts: list[str], vocab_size: int = 1024):
    """A byte-level BPE like Pythia's: EOS doubles as BOS, and there is no pad token (the scripts must cope)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS)
    split = [w for w in [*FILLERS, *sum(TOPICS.values(), [])] if len(tokenizer.encode(" " + w)) != 1]
    assert not split, f"the tiny tokenizer splits words the judge and the models rely on: {split}"
    return tokenizer


def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    return tokenizer(list(texts), add_special_tokens=False)["input_ids"]


def right_pad(sequences: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, sequences))
    return (torch.tensor([s + [pad] * (width - len(s)) for s in sequences]),
            torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences]))


@torch.no_grad()
def sample(model, prompts: list[list[int]], eos_id: int, temperature: float, max_tokens: int,
           stops: tuple = ()) -> list[list[int]]:
    """Completions (cut after EOS, or after the first of `stops`) with transformers' generate; temperature 0 is
    greedy."""
    completions = []
    for i in range(0, len(prompts), 128):
        chunk = prompts[i: i + 128]
        width = max(map(len, chunk))
        ids = torch.tensor([[eos_id] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else {}
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                             eos_token_id=[eos_id, *stops], pad_token_id=eos_id, **sampling)
        for row in out[:, width:].tolist():
            ends = [row.index(stop) for stop in (eos_id, *stops) if stop in row]
            completions.append(row[: min(ends) + 1] if ends else row)
    return completions


def judge_tokens(tokenizer, query: str, tokens: list[int]) -> float:
    has_eos = bool(tokens) and tokens[-1] == tokenizer.eos_token_id
    return judge(query, tokenizer.decode(tokens[:-1] if has_eos else tokens), has_eos)


def train_sft(config, tokenizer, rows: list[dict], seed: int, steps: int, lr: float = 3e-3, batch_size: int = 32,
              after_step=None):
    """SFT on the summary tokens only (the prompt is masked): trained on whole sequences, a model this small spends
    itself on modelling random posts and never learns to summarise. `after_step(step, policy)`, if given, is called
    after each optimizer step (1, 2, ...): to keep snapshots, or to report progress."""
    from transformers import GPTNeoXForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    policy = GPTNeoXForCausalLM(config)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 20))
    for step in range(1, steps + 1):
        batch = rng.sample(rows, batch_size)
        queries = encode(tokenizer, [r["query"] for r in batch])
        summaries, trained = zip(*(response_ids(tokenizer, r) for r in batch))
        input_ids, mask = right_pad([q + s for q, s in zip(queries, summaries)], tokenizer.eos_token_id)
        labels = torch.tensor([[-100] * len(q) + [t if keep else -100 for t, keep in zip(s, k)]
                               + [-100] * (input_ids.shape[1] - len(q) - len(s))
                               for q, s, k in zip(queries, summaries, trained)])
        policy(input_ids=input_ids, attention_mask=mask, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        if after_step is not None:
            after_step(step, policy)
    return policy.eval()


def response_ids(tokenizer, row: dict) -> tuple[list[int], list[bool]]:
    """A row's response ids and which of them train: `reference_response` whole, or `pieces`, (text, trained) pairs
    each encoded on its own (the tool world: the policy's calls train, the tool's answers do not), so that the ids
    join as an episode's do, a turn's sampled ids then the tool's, never re-tokenised together."""
    if "pieces" not in row:
        ids = encode(tokenizer, [row["reference_response"]])[0]
        return ids, [True] * len(ids)
    ids, trained = [], []
    for text, keep in row["pieces"]:
        piece = encode(tokenizer, [text])[0]
        ids, trained = ids + piece, trained + [keep] * len(piece)
    return ids, trained


def choose_sft(config, tokenizer, train: list[dict], validation: list[dict], gold, progress,
               quick: bool = False, band: tuple = SFT_WIN_RATE_RANGE) -> tuple:
    """The SFT recipe: the first seed whose greedy summaries end (EOS) and beat the references 17-43% of the time
    under the gold model. At this size the win rate swings between 0.1 and 0.85 with the seed alone, and with the
    step (one seed: 0.79, 0.59, 0.33, 0.55 at steps 80, 85, 90, 95); most runs land above the range, about one seed
    in ten at 90 steps lands in it. So at most SFT_SEEDS seeds train SFT_STEPS steps each (a few seconds a seed); if
    none lands, the snapshots taken on the way (SFT_SNAPSHOTS steps, about one in four lands) are scored in turn, and
    the closest of everything scored is the last resort. No seed is trained twice. `quick`: one seed, 20 steps, no
    snapshots. `band`: the gold win rates that land (build_sized asks a narrower one). Returns the policy and what
    the world's report says of it."""
    from transformers import GPTNeoXForCausalLM

    eos = tokenizer.eos_token_id
    val_prompts = encode(tokenizer, [r["query"] for r in validation])
    val_references = encode(tokenizer, [r["reference_response"] for r in validation])
    with torch.no_grad():
        gold_references = reward_scores(gold, val_prompts, val_references, eos)

    def sft_quality(policy) -> tuple[float, float, float]:
        """Gold and judge win rates of the greedy summaries against the references, and how many end."""
        greedy = sample(policy, val_prompts, eos, 0.0, 16)
        with torch.no_grad():
            gold_scores = reward_scores(gold, val_prompts, greedy, eos)
        judge_wins = [judge_tokens(tokenizer, r["query"], g) > judge(r["query"], r["summary"], True)
                      for r, g in zip(validation, greedy)]
        return ((gold_scores > gold_references).float().mean().item(), sum(judge_wins) / len(judge_wins),
                sum(g[-1:] == [eos] for g in greedy) / len(greedy))

    def good(quality: tuple) -> bool:
        return band[0] <= quality[0] <= band[1] and quality[2] >= 0.98

    def try_sft(seed: int, steps: int, policy) -> bool:
        tried[seed, steps] = sft_quality(policy)
        win_rate, _, ends = tried[seed, steps]
        progress(f"SFT seed {seed} at {steps} steps: gold win rate {win_rate:.2f}, ends {ends:.2f} -> "
                 f"{'kept' if good(tried[seed, steps]) else 'rejected'}")
        return good(tried[seed, steps])

    def keep_snapshots(seed: int):
        def after_step(step: int, policy) -> None:
            if step in SFT_SNAPSHOTS:
                snapshots[seed, step] = {k: v.clone() for k, v in policy.state_dict().items()}
        return after_step

    def from_snapshot(key: tuple):
        policy = GPTNeoXForCausalLM(config)
        policy.load_state_dict(snapshots[key])
        return policy.eval()

    tried, snapshots, last = {}, {}, {}
    seeds, sft_steps = (1, 20) if quick else (SFT_SEEDS, SFT_STEPS)
    for seed in range(seeds):
        policy = train_sft(config, tokenizer, train, seed, steps=sft_steps, after_step=None if quick else
                           keep_snapshots(seed))
        last[seed] = policy
        if try_sft(seed, sft_steps, policy):
            chosen = seed, sft_steps
            break
    else:
        for chosen in sorted(snapshots, key=lambda k: (k[0], SFT_SNAPSHOTS.index(k[1]))):
            policy = from_snapshot(chosen)
            if try_sft(*chosen, policy):
                break
        else:  # nothing landed: the closest of everything scored
            chosen = min(tried, key=lambda k: (tried[k][2] < 0.98, abs(tried[k][0] - sum(band) / 2)))
            policy = last[chosen[0]] if chosen[1] == sft_steps else from_snapshot(chosen)
    snapshots.clear()
    return policy, dict(sft_seed=chosen[0], sft_steps=chosen[1], sft_gold_win_rate=tried[chosen][0],
                        sft_judge_win_rate=tried[chosen][1], sft_eos_fraction=tried[chosen][2],
                        sft_tried={f"seed {seed} at {steps} steps": v for (seed, steps), v in tried.items()})


def candidates(rng: random.Random, tokenizer, row: dict, samples: list[list[int]]) -> list[list[int]]:
    """Summaries of one post to compare: the policy's samples, the reference, synthetic summaries of mixed words
    (some without EOS) and one-word edits (a word replaced, inserted or dropped)."""
    eos, topics = tokenizer.eos_token_id, TOPICS[row["subreddit"]]
    others = [w for s, words in TOPICS.items() if s != row["subreddit"] for w in words]

    def word() -> str:
        return rng.choice(rng.choice([topics, topics, others, FILLERS]))

    def tokens(words: list[str], ends: bool = True) -> list[int]:
        return encode(tokenizer, [" " + " ".join(words)])[0] + [eos] * ends if words else [eos] * ends

    reference = row["summary"].split()
    pool = [*samples, tokens(reference)]
    pool += [tokens([word() for _ in range(rng.randint(1, 6))], rng.random() < 0.85) for _ in range(3)]
    for _ in range(2):
        edited = list(reference)
        position = rng.randrange(len(edited))
        kind = rng.choice(["replace", "insert", "drop"])
        if kind == "replace":
            edited[position] = word()
        elif kind == "insert":
            edited.insert(position, word())
        elif len(edited) > 1:
            del edited[position]
        pool.append(tokens(edited))
    return pool


def candidate_sets(rng: random.Random, policy, tokenizer, rows: list[dict]) -> list:
    """(prompt, candidate summaries) of each post, two samples of `policy` at temperature 1 among them."""
    prompts = encode(tokenizer, [r["query"] for r in rows])
    samples = sample(policy, [p for p in prompts for _ in range(2)], tokenizer.eos_token_id, 1.0, 12)
    return [(prompt, candidates(rng, tokenizer, row, samples[2 * i: 2 * i + 2]))
            for i, (prompt, row) in enumerate(zip(prompts, rows))]


def held_out_sets(policy, tokenizer, rows: list[dict]) -> list:
    """The candidate sets of validation posts on which the build measures agreement, drawn with fixed seeds so
    that a test can draw them again from the saved world."""
    with deterministic(1) as rng:
        return candidate_sets(rng, policy, tokenizer, rows)


def reward_scores(model, prompts: list[list[int]], completions: list[list[int]], eos_id: int,
                  every_position: bool = False) -> torch.Tensor:
    """The reward model's score of completions[i] after prompts[i], read at its last token, in one batched forward
    (prompts left-padded, so each completion starts at the same column). With every_position, the score of every
    prefix (the prompt alone included) as a [completions, 1 + longest] tensor."""
    width, longest = max(map(len, prompts)), max(map(len, completions))
    ids = [[eos_id] * (width - len(p)) + p + c + [eos_id] * (longest - len(c)) for p, c in zip(prompts, completions)]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * (len(p) + len(c)) + [0] * (longest - len(c))
                         for p, c in zip(prompts, completions)])
    hidden = model.gpt_neox(input_ids=torch.tensor(ids), attention_mask=mask,
                            position_ids=(mask.cumsum(1) - 1).clamp(min=0)).last_hidden_state
    scores = model.score(hidden).squeeze(-1)[:, width - 1:]
    return scores if every_position else scores[torch.arange(len(completions)), [len(c) for c in completions]]


@torch.no_grad()
def score_sets(model, sets: list, eos_id: int) -> list[torch.Tensor]:
    """Scores of each (prompt, candidates) set's candidates, one tensor per set."""
    flat = [(prompt, c) for prompt, completions in sets for c in completions]
    scores = torch.cat([reward_scores(model, *zip(*flat[i: i + 512]), eos_id) for i in range(0, len(flat), 512)])
    return list(scores.split([len(completions) for _, completions in sets]))


def pairwise_loss(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Bradley-Terry over every pair whose targets differ: -log sigmoid(s_better - s_worse)."""
    better = targets[:, None] > targets[None, :]
    return F.softplus(scores[None, :] - scores[:, None])[better].mean() if better.any() else scores.sum() * 0


def train_reward_model(config, sft_state: dict, groups: list, steps: int, per_step: int, lr: float, seed: int,
                       dense: bool, good_enough=None):
    """A sequence classifier from the SFT weights, trained with Bradley-Terry within each group. `groups` holds
    (prompt tokens, completions, their target scores); with `dense`, (prompt, [(completion, the target score of each
    of its prefixes)]): every prefix is compared too, which teaches the head the judge's whole shape from few posts.
    `good_enough(model)`, checked every 25 steps, may stop the training early. Returns the model and its steps."""
    from transformers import GPTNeoXForSequenceClassification

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = GPTNeoXForSequenceClassification(config)
    model.gpt_neox.load_state_dict({k.removeprefix("gpt_neox."): v for k, v in sft_state.items()
                                    if k.startswith("gpt_neox.")})
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(steps):
        if good_enough is not None and step % 25 == 0 and step and good_enough(model):
            break
        batch = rng.sample(groups, per_step)
        flat = [(prompt, c[0] if dense else c) for prompt, completions, _ in batch for c in completions]
        scores = reward_scores(model, *zip(*flat), config.eos_token_id, every_position=dense)
        losses, start = [], 0
        for _, completions, targets in batch:
            group = scores[start: start + len(completions)]
            start += len(completions)
            if dense:  # the prefixes of each completion, up to its own length
                keep = torch.tensor([[j <= len(c) for j in range(group.shape[1])] for c, _ in completions])
                group, targets = group[keep], [t for _, prefix_targets in completions for t in prefix_targets]
            losses.append(pairwise_loss(group, torch.tensor(targets)))
        torch.stack(losses).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return model.eval(), step


@torch.no_grad()
def normalise(model, held_out: list, eos_id: int) -> None:
    """Scale and shift the scores to mean 0 and standard deviation 1 on held-out summaries: the scripts' missing-EOS
    penalty (-1) is an absolute score, so the scale matters. The head has no bias, so the shift goes into the final
    layer norm's bias along the head's weight (score = w.h, and w.(h + d) = score - mean for d = -mean w / |w|^2)."""
    scores = torch.cat(score_sets(model, held_out, eos_id))
    weight = model.score.weight[0]
    model.gpt_neox.final_layer_norm.bias -= scores.mean() * weight / weight.dot(weight)
    model.score.weight /= scores.std()


def agreement(first: list[torch.Tensor], second: list[torch.Tensor]) -> float:
    """Fraction of the pairs (within each post) that `second` orders strictly whose order `first` shares."""
    agree = total = 0
    for a, b in zip(first, second):
        decided = (b[:, None] > b[None, :])
        agree += (decided & (a[:, None] > a[None, :])).sum().item()
        total += decided.sum().item()
    return agree / total


class Progress:
    """One line per phase of a build, with the seconds since it started: a build takes minutes and must not look
    like a hang."""

    def __init__(self, what: str, tiny_dir: str):
        self.started = time.time()
        self(f"building {what} once, in {tiny_dir} (minutes; later runs reuse it)", stamp=False)

    def __call__(self, message: str, stamp: bool = True) -> None:
        print(f"tiny world: {message}" + (f" ({self.seconds():.0f} s)" if stamp else ""), file=sys.stderr, flush=True)

    def seconds(self) -> float:
        return time.time() - self.started


def build_math_world(kind: str, tiny_dir: str, quick: bool) -> tuple[str, str]:
    """A math world of `kind` built into `tiny_dir` unless one is there (in its own process: build_in_own_process);
    returns its SFT policy's and its dataset's folders."""
    tiny_dir = os.path.expanduser(tiny_dir)
    if not os.path.exists(os.path.join(tiny_dir, "world.json")):
        build_in_own_process(kind, tiny_dir, str(int(quick)))
    return os.path.join(tiny_dir, "sft"), os.path.join(tiny_dir, "data")


def build_in_own_process(kind: str, tiny_dir: str, *options: str) -> None:
    """Build a world in a child process whose OpenMP threads go to sleep soon when they wait. By default torch's
    threads spin for a while at every barrier, which costs nothing on idle cores; on cores busy with other work a
    spinning thread holds the core its partner needs, and 90 SFT steps that take 4 s alone took 28-66 s beside a
    second such job (measured on 2 cores), 8 s with GOMP_SPINCOUNT=1000 (and 3.7 s alone). The setting takes effect
    only before torch starts, hence the child; the threads split the work as before, so the world is the same."""
    import subprocess

    from filelock import FileLock

    env = dict(os.environ)
    if "GOMP_SPINCOUNT" not in env and "OMP_WAIT_POLICY" not in env:  # (a user's own setting wins)
        env["GOMP_SPINCOUNT"] = "1000"
    os.makedirs(os.path.dirname(os.path.abspath(tiny_dir)), exist_ok=True)
    # Two runs (or two test workers) that need the same world at once: one builds, the other waits and reuses it.
    with FileLock(os.path.abspath(tiny_dir) + ".lock"):
        if os.path.exists(os.path.join(tiny_dir, "world.json")):
            return
        code = subprocess.run([sys.executable, os.path.abspath(__file__), "--build", kind, tiny_dir, *options],
                              env=env).returncode
    if code != 0:
        raise RuntimeError(f"building the {kind} world in {tiny_dir} failed (exit code {code}; its error is above)")


# ---------------------------------------------------------------------------------------------------------------
# Reading a world: what the scripts do with --model tiny (they never build one)
# ---------------------------------------------------------------------------------------------------------------
def tldr_world(tiny_dir: str) -> tuple[str, str, str, str, str]:
    """The TL;DR world in `tiny_dir`, checked (`check_world`): the SFT policy's, the proxy reward model's, the
    dataset's and the gold reward model's folders, and the world's hash."""
    tiny_dir = os.path.expanduser(tiny_dir)
    digest = check_world(tiny_dir, "tldr")
    return (*(os.path.join(tiny_dir, name) for name in ("sft", "proxy", "data", "gold")), digest)


def math_world(tiny_dir: str, kind: str) -> tuple[str, str, str]:
    """A math world in `tiny_dir` (`kind`: the GSM8k miniature `gsm8k`, the long-tailed `chains`, the chains with a
    calculator `tools`), checked: the SFT policy's and the dataset's folders, and the world's hash."""
    tiny_dir = os.path.expanduser(tiny_dir)
    digest = check_world(tiny_dir, kind)
    return os.path.join(tiny_dir, "sft"), os.path.join(tiny_dir, "data"), digest


def check_world(folder: str, kind: str) -> str:
    """A world as the scripts read it: its SHA256SUMS, the files a script needs listed there, and every file it
    lists present with that hash. Else one error naming the file, and how to get the world back (nothing is built
    here, or over it). Returns the world's hash: the SHA-256 of its SHA256SUMS."""
    from plumbing.core import fail

    shipped = os.path.abspath(folder) == os.path.abspath(SHIPPED[kind])
    again = (f"restore it with `git checkout -- {os.path.relpath(folder)}`" if shipped else
             f"rebuild it with `python tiny_world.py {kind} {folder}` into an empty folder") + (
        f", or build another with `python tiny_world.py {kind} NEW_FOLDER` and pass --tiny_dir NEW_FOLDER")
    sums = os.path.join(folder, CHECKSUMS)
    if not os.path.isfile(sums):
        fail(f"--tiny_dir {folder}: no {kind} world there ({CHECKSUMS} is missing); {again}")
    listed = {path: digest for digest, path in (line.split("  ", 1) for line in open(sums).read().splitlines())}
    for path in [*NEEDED[kind], *listed]:
        if path not in listed or not os.path.isfile(os.path.join(folder, path)):
            fail(f"--tiny_dir {folder}: {path} is missing{'' if path in listed else f' from {CHECKSUMS}'}; {again}")
        if file_hash(os.path.join(folder, path)) != listed[path]:
            fail(f"--tiny_dir {folder}: {path} is not the file this world was built with (its SHA-256 is not the "
                 f"one in {CHECKSUMS}); {again}")
    return file_hash(sums)


def file_hash(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def write_checksums(folder: str) -> None:
    """SHA256SUMS: every file of the world but itself, sorted, in `sha256sum`'s format."""
    paths = sorted(os.path.relpath(os.path.join(root, name), folder) for root, _, names in os.walk(folder)
                   for name in names if name != CHECKSUMS)
    with open(os.path.join(folder, CHECKSUMS), "w") as f:
        f.writelines(f"{file_hash(os.path.join(folder, path))}  {path}\n" for path in paths)


# ---------------------------------------------------------------------------------------------------------------
# Building a world (python tiny_world.py KIND FOLDER)
# ---------------------------------------------------------------------------------------------------------------
def build_tldr(tiny_dir: str, quick: bool = False) -> tuple[str, str, str, str]:
    """Build the TL;DR world into `tiny_dir` unless one is there; return the SFT policy's, the proxy reward model's,
    the dataset's and the gold reward model's folders. `quick`: the same recipe and layout on a tenth of the work
    (one SFT seed, a few steps of each model; the tests' check of the builder), not a world to learn in."""
    tiny_dir = os.path.expanduser(tiny_dir)
    paths = tuple(os.path.join(tiny_dir, name) for name in ("sft", "proxy", "data", "gold"))
    if not os.path.exists(os.path.join(tiny_dir, "world.json")):
        build_in_own_process("tldr", tiny_dir, str(int(quick)))
    return paths


def build_tldr_here(tiny_dir: str, quick: str = "0") -> None:
    """The TL;DR world's build itself (build_tldr runs it in a child process)."""
    import transformers
    from transformers import GPTNeoXConfig

    transformers.utils.logging.disable_progress_bar()
    quick = bool(int(quick))
    progress, report = Progress("the tiny TL;DR world" + " (quick)" * quick, tiny_dir), {"quick": quick}
    posts = 500 if quick else 2000  # the gold model's candidates come from as many posts, the proxy's as many more
    with deterministic(0) as rng:
        splits = {split: [make_example(rng) for _ in range(n)]
                  for split, n in (("train", 2 * posts), ("validation", 128 if quick else 512))}
        train, validation = splits["train"], splits["validation"]
        tokenizer = build_tokenizer([r["query"] + r["reference_response"] for r in train])
        eos = tokenizer.eos_token_id
        config = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=512, max_position_embeddings=512, bos_token_id=eos, eos_token_id=eos,
                               num_labels=1)
        val_prompts = encode(tokenizer, [r["query"] for r in validation])
        judged = [judge(r["query"], r["summary"], True) for r in validation]
        report["reference_judge_mean"] = sum(judged) / len(judged)
        progress("data and tokenizer")

        def with_prefix_targets(row: dict, completions: list) -> list:
            return [(c, [judge_tokens(tokenizer, row["query"], c[:j]) for j in range(len(c) + 1)])
                    for c in completions]

        # 4. The gold reward model, first: Bradley-Terry on judge labels, over whole candidates and all their
        # prefixes, from a backbone of its own (an SFT run apart from the policy's, as the paper's gold model is
        # a separate, larger model)
        gold_backbone = train_sft(config, tokenizer, train, seed=100, steps=10 if quick else 100)
        gold_sets = [(prompt, with_prefix_targets(row, completions), None) for (prompt, completions), row
                     in zip(candidate_sets(rng, gold_backbone, tokenizer, train[:posts]), train)]
        gold, _ = train_reward_model(config, gold_backbone.state_dict(), gold_sets, steps=10 if quick else 250,
                                     per_step=16, lr=3e-3, seed=1, dense=True)
        progress("gold reward model")

        # 3. The SFT policy, by the recipe of choose_sft (a seed whose gold win rate lands in range)
        policy, sft_report = choose_sft(config, tokenizer, train, validation, gold, progress, quick)
        report.update(sft_report)

        # 5. The proxy: pairs of candidates from 2,000 other posts, labelled by the gold model (the paper's
        # relabelling), trained from the SFT policy's weights
        half = len(validation) // 2
        held_out = held_out_sets(policy, tokenizer, validation[:half])
        normalise(gold, held_out, eos)
        pairs = [(prompt, rng.sample(completions, 2)) for prompt, completions in
                 candidate_sets(rng, policy, tokenizer, train[posts:]) for _ in range(3)]
        pairs = [(prompt, pair, scores.tolist()) for (prompt, pair), scores in
                 zip(pairs, score_sets(gold, pairs, eos))]
        tuning = held_out_sets(policy, tokenizer, validation[half:])  # not the posts the agreement is reported on
        tuning_gold = score_sets(gold, tuning, eos)
        proxy, report["proxy_steps"] = train_reward_model(
            config, policy.state_dict(), pairs, steps=10 if quick else 600, per_step=64, lr=1e-3, seed=2, dense=False,
            good_enough=lambda model: agreement(score_sets(model, tuning, eos), tuning_gold) >= PROXY_AGREEMENT)
        normalise(proxy, held_out, eos)
        progress(f"proxy reward model ({report['proxy_steps']} steps)")

        # Held-out agreement (pairs of candidates of the same post): gold against the judge, proxy against gold
        with torch.no_grad():
            judged = [torch.tensor([judge_tokens(tokenizer, row["query"], c) for c in completions])
                      for (_, completions), row in zip(held_out, validation)]
            gold_scored, proxy_scored = score_sets(gold, held_out, eos), score_sets(proxy, held_out, eos)
        report.update(gold_judge_agreement=agreement(gold_scored, judged),
                      proxy_gold_agreement=agreement(proxy_scored, gold_scored),
                      proxy_judge_agreement=agreement(proxy_scored, judged),
                      gold_probes=probe_agreement(gold, tokenizer, validation[:half], val_prompts))
    save_world(tiny_dir, splits, {"sft": policy, "gold": gold, "proxy": proxy}, tokenizer, report)
    progress(f"built: gold agrees with the judge {report['gold_judge_agreement']:.2f}, proxy with gold "
             f"{report['proxy_gold_agreement']:.2f}, SFT gold win rate {report['sft_gold_win_rate']:.2f}; "
             f"saved in {tiny_dir}")


# Policies and proxy reward models of several sizes beside the TL;DR world (benchmarks/scaling.py): name ->
# (hidden size, layers, heads: vLLM's CPU attention takes heads of 32 dimensions or more). "base" is the world's
# own policy; the sizes span ~20x in parameters (0.18M, 0.55M, 3.47M with the world's 598 tokens).
SIZES = {"small": (64, 2, 2), "base": (128, 2, 4), "large": (256, 4, 4)}
SIZED_PROXY_STEPS = 200  # every proxy the same steps on the same pairs (no early stop: sizes differ only in size)
SIZED_SFT_BAND = (0.29, 0.37)  # every size's SFT gold win rate: around the world's policy's 0.328, +-2 binomial s.e.
SIZED_RECIPE = 2  # 2: SFT policies in one band, proxies trained on every size's samples (1: the base's only)


def build_sized(sized_dir: str, base_dir: str = SHIPPED["tldr"], quick: bool = False) -> dict:
    """Beside the TL;DR world in `base_dir` (checked, and left as it is), an SFT policy of each of SIZES and a proxy
    reward model of each size, so that sizes differ in size and little else: every SFT policy is chosen by the
    world's recipe (choose_sft) in one narrow band of gold win rate, SIZED_SFT_BAND ("base" is the world's own,
    inside it); every proxy starts from its size's SFT weights and trains on the same gold-labelled pairs, drawn
    from every size's samples in equal shares (so no proxy knows one policy's summaries better than another's). The
    judge, the gold reward model, the data and the tokenizer are the world's. `quick` (for CI): the two smaller
    sizes, the proxies' pairs from 250 posts and 20 steps, 128 posts held out.
    Returns {"policy": {size: folder}, "proxy": {size: folder}, "base": base_dir, "sizes": {size: report}}: each
    model's parameters, each policy's SFT gold win rate and each proxy's agreement with gold on held-out summaries
    of every size's samples, and of each size's own (world.json's)."""
    base_dir, sized_dir = os.path.expanduser(base_dir), os.path.expanduser(sized_dir)
    base_hash = check_world(base_dir, "tldr")
    if not os.path.exists(os.path.join(sized_dir, "world.json")):
        build_in_own_process("sized", sized_dir, base_dir, str(int(quick)))
    report = json.load(open(os.path.join(sized_dir, "world.json")))
    from plumbing.core import fail

    if report.get("base_hash") != base_hash:  # (built beside another world, or before worlds had a hash)
        fail(f"{sized_dir} was built beside another TL;DR world than {base_dir}: delete it to build it again")
    if report.get("recipe") != SIZED_RECIPE:
        fail(f"{sized_dir} was built by an earlier recipe of build_sized: delete it to build it again")
    sizes = report["sizes"]
    return {"policy": {size: os.path.join(sized_dir, f"policy-{size}") for size in sizes},
            "proxy": {size: os.path.join(sized_dir, f"proxy-{size}") for size in sizes}, "base": base_dir,
            "sizes": sizes}


def build_sized_here(sized_dir: str, base_dir: str, quick: str) -> None:
    """build_sized's build (in a child process, as build_tldr's)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GPTNeoXConfig

    transformers.utils.logging.disable_progress_bar()
    quick = bool(int(quick))
    sizes = dict(list(SIZES.items())[:2]) if quick else SIZES
    progress, report = Progress(f"policies and proxies of {len(sizes)} sizes", sized_dir), {"sizes": {}}
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(base_dir, "sft"))
    splits = {split: [json.loads(line) for line in open(os.path.join(base_dir, "data", f"{split}.jsonl"))]
              for split in ("train", "validation")}
    train, validation = splits["train"], splits["validation"]
    gold = AutoModelForSequenceClassification.from_pretrained(os.path.join(base_dir, "gold")).eval()
    world = json.load(open(os.path.join(base_dir, "world.json")))
    eos, configs, policies, models = tokenizer.eos_token_id, {}, {}, {}
    for size, (hidden, layers, heads) in sizes.items():  # 1. the SFT policies, in one band of gold win rate
        configs[size] = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                                      num_attention_heads=heads, intermediate_size=4 * hidden,
                                      max_position_embeddings=512, bos_token_id=eos, eos_token_id=eos, num_labels=1)
        if size == "base":  # the world's own policy (its recipe's outcome at this size)
            policies[size] = AutoModelForCausalLM.from_pretrained(os.path.join(base_dir, "sft")).eval()
            sft_report = {k: world[k] for k in ("sft_seed", "sft_steps", "sft_gold_win_rate")}
        else:
            policies[size], sft_report = choose_sft(configs[size], tokenizer, train, validation, gold, progress,
                                                    band=SIZED_SFT_BAND)
        report["sizes"][size] = dict(hidden_size=hidden, layers=layers,
                                     parameters=sum(p.numel() for p in policies[size].parameters()),
                                     **{k: sft_report[k] for k in ("sft_seed", "sft_steps", "sft_gold_win_rate")})
        progress(f"{size} ({hidden} wide, {layers} layers): SFT gold win rate {sft_report['sft_gold_win_rate']:.2f}")
    with deterministic(2) as rng:
        # 2. The pairs every proxy trains on: candidates of 2,000 posts, each size's SFT samples on its own share of
        # them, labelled by the gold model; held-out sets of every size's samples for agreement and normalisation
        posts = train[2000:2250 if quick else 4000]
        share = len(posts) // len(sizes)
        sets = [s for i, policy in enumerate(policies.values())
                for s in candidate_sets(rng, policy, tokenizer, posts[i * share: (i + 1) * share])]
        pairs = [(prompt, rng.sample(completions, 2)) for prompt, completions in sets for _ in range(3)]
        gold_pairs = score_sets(gold, pairs, eos)
        pairs = [(prompt, pair, scores.tolist()) for (prompt, pair), scores in zip(pairs, gold_pairs)]
        held_out = {size: held_out_sets(policy, tokenizer, validation[:128 if quick else 256])
                    for size, policy in policies.items()}
        gold_scored = {size: score_sets(gold, sets_, eos) for size, sets_ in held_out.items()}
        every = [s for sets_ in held_out.values() for s in sets_]
        progress(f"gold-labelled pairs from {len(sizes)} sizes' samples")
        for size in sizes:  # 3. a proxy of each size on the same pairs
            proxy, _ = train_reward_model(configs[size], policies[size].state_dict(), pairs,
                                          steps=20 if quick else SIZED_PROXY_STEPS, per_step=64, lr=1e-3, seed=2,
                                          dense=False)
            normalise(proxy, every, eos)
            models[f"policy-{size}"], models[f"proxy-{size}"] = policies[size], proxy
            on_each = {own: agreement(score_sets(proxy, held_out[own], eos), gold_scored[own]) for own in sizes}
            report["sizes"][size].update(
                proxy_gold_agreement=agreement(score_sets(proxy, every, eos), [g for own in sizes
                                                                               for g in gold_scored[own]]),
                proxy_gold_agreement_on=on_each)
            progress(f"proxy {size}: agrees with gold on " + ", ".join(
                f"{own}'s samples {value:.2f}" for own, value in on_each.items()))
    report.update(base=base_dir, base_hash=file_hash(os.path.join(base_dir, CHECKSUMS)), quick=quick,
                  recipe=SIZED_RECIPE)
    save_world(sized_dir, {}, models, tokenizer, report)
    progress(f"saved in {sized_dir}")


def save_world(tiny_dir: str, splits: dict, models: dict, tokenizer, report: dict) -> None:
    """Write the data (one jsonl file per split), the models with the tokenizer, `world.json` and SHA256SUMS to a
    folder beside `tiny_dir`, then rename it into place: an interrupted build leaves no half-built world behind.
    (`report` holds what the world is, not how long its build took: a build repeated on the same machine gives the
    same files, hash included.)"""
    parent = os.path.dirname(os.path.abspath(tiny_dir))
    os.makedirs(parent, exist_ok=True)
    build_dir = tempfile.mkdtemp(prefix=".building-", dir=parent)
    if splits:  # (build_sized's world holds models only)
        os.makedirs(os.path.join(build_dir, "data"))
        for split, rows in splits.items():
            with open(os.path.join(build_dir, "data", f"{split}.jsonl"), "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
        with open(os.path.join(build_dir, "data", "README.md"), "w") as f:  # names the splits for `datasets`,
            f.write("---\nconfigs:\n- config_name: default\n  data_files:\n")  # which would read test_*.jsonl
            f.writelines(f"  - split: {split}\n    path: {split}.jsonl\n" for split in splits)  # as `test`
            f.write("---\n")
    for name, model in models.items():
        model.save_pretrained(os.path.join(build_dir, name))
        tokenizer.save_pretrained(os.path.join(build_dir, name))
    with open(os.path.join(build_dir, "world.json"), "w") as f:
        json.dump(report, f, indent=1)
    write_checksums(build_dir)
    try:
        os.rename(build_dir, tiny_dir)
    except OSError:  # another process finished the same (deterministic) build first
        shutil.rmtree(build_dir, ignore_errors=True)


@torch.no_grad()
def probe_agreement(model, tokenizer, rows: list[dict], prompts: list[list[int]]) -> dict:
    """One-word probes of a reference summary, each of which changes the judge's score: does the model follow?
    (A gold model that missed one of these would be fooled by a policy that found it.)"""
    eos, hits = tokenizer.eos_token_id, {"repeat a topic word": [], "add an off-topic word": [], "add a filler": []}
    for row, prompt in zip(rows, prompts):
        words = row["summary"].split()
        topic = next(w for w in words if w in TOPICS[row["subreddit"]])
        off_topic = next(w for s, ws in TOPICS.items() if s != row["subreddit"] for w in ws)
        for probe, edited in (("repeat a topic word", words + [topic]), ("add an off-topic word", words + [off_topic]),
                              ("add a filler", words + ["the"])):
            change = judge(row["query"], " ".join(edited), True) - judge(row["query"], row["summary"], True)
            if change:  # (a fifth word that is a topic word changes nothing: +1, and -1 for the length)
                texts = [" " + " ".join(summary) + EOS for summary in (words, edited)]
                before, after = reward_scores(model, [prompt] * 2, encode(tokenizer, texts), eos).tolist()
                hits[probe].append((after > before) == (change > 0))
    return {probe: sum(hit) / len(hit) for probe, hit in hits.items()}


def build_other_tokenizer(texts: list[str]):
    """A Llama-like tokenizer for this world's text, for policies and reward models that do not share one
    (tests/test_reward_tokenizer.py, benchmarks/reward_tokenizer_cost.py): another vocabulary (a smaller byte-level
    BPE, so words split differently), a BOS it adds to every text, and another EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")


def build_untrained(cache_dir: str, hidden_size: int, num_layers: int) -> tuple[str, str, str]:
    """For the speed benchmarks: this world's tokenizer and data with an untrained policy of the given size and a
    reward model of random weights (its completions always run to the length cap, which keeps steps uniform).
    Returns the policy's, the reward model's and the dataset's folders."""
    cache_dir = os.path.expanduser(cache_dir)
    paths = tuple(os.path.join(cache_dir, name) for name in ("sft", "reward", "data"))
    if os.path.exists(os.path.join(cache_dir, "world.json")):
        return paths
    import transformers
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, GPTNeoXForSequenceClassification

    transformers.utils.logging.disable_progress_bar()
    with deterministic(0) as rng:
        splits = {split: [make_example(rng) for _ in range(n)] for split, n in (("train", 4000), ("validation", 256))}
        tokenizer = build_tokenizer([r["query"] + r["reference_response"] for r in splits["train"]])
        config = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_layers,
                               num_attention_heads=4, intermediate_size=4 * hidden_size, max_position_embeddings=512,
                               bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id, num_labels=1)
        models = {"sft": GPTNeoXForCausalLM(config), "reward": GPTNeoXForSequenceClassification(config)}
    save_world(cache_dir, splits, models, tokenizer, {})
    return paths


# ---------------------------------------------------------------------------------------------------------------
# The GSM8k miniature (`gsm8k_async_dpo.py --model tiny`)
# ---------------------------------------------------------------------------------------------------------------
MATH_PROMPT = "[MATH_TASK] Problem:\n{question}\n\nSolution:"  # the paper's GSM8k prompt (gsm8k_async_dpo.py)
MATH_NAMES = "Tom Anna Ben Mia Sam Lily Max Zoe".split()
MATH_ITEMS = "pencils apples stickers marbles books coins shells cards".split()
MATH_TEMPLATES = [  # (operation, question, worked solution line)
    ("+", "{n} has {a} {x}. {n} buys {b} more. How many {x} does {n} have now?", "{n} has {a} + {b} = {c} {x} now."),
    ("+", "{n} found {a} {x} on Monday and {b} {x} on Tuesday. How many {x} did {n} find in all?",
     "{n} found {a} + {b} = {c} {x} in all."),
    ("-", "{n} has {a} {x}. {n} gives {b} away. How many {x} does {n} have left?",
     "{n} has {a} - {b} = {c} {x} left."),
    ("-", "There are {a} {x} in a pile. {n} takes {b} of them. How many {x} are left in the pile?",
     "There are {a} - {b} = {c} {x} left."),
]


def make_math_problem(rng: random.Random) -> tuple[tuple, dict]:
    """One GSM8k-shaped row (`question`, and an `answer` of a worked line then "#### N") with its arithmetic fact."""
    operation, question, solution = rng.choice(MATH_TEMPLATES)
    a, b = rng.randint(1, 30), rng.randint(1, 30)
    if operation == "-":
        a, b = max(a, b), min(a, b)
    fields = dict(n=rng.choice(MATH_NAMES), x=rng.choice(MATH_ITEMS), a=a, b=b, c=a + b if operation == "+" else a - b)
    return (operation, a, b), {"question": question.format(**fields),
                               "answer": solution.format(**fields) + f"\n#### {fields['c']}"}


def build_math_tokenizer(texts: list[str], vocab_size: int = 512):
    """A byte-level BPE whose pre-tokenizer isolates every digit (with its leading space): one token per digit makes
    arithmetic learnable at this size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r" ?\d"), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS)
    assert all(len(tokenizer.encode(f"{space}{digit}")) == 1 for space in ("", " ") for digit in range(10))
    assert tokenizer.encode(" 23") == tokenizer.encode(" 2") + tokenizer.encode("3")
    return tokenizer


def train_math_sft(tokenizer, train: list[dict], width: int, lr: float, steps: int, progress, tools: bool = False,
                   rendered: bool = False):
    """The math worlds' SFT policy (GSM8k miniature, chains, tools): GPT-NeoX, `width` wide, 4 layers and heads,
    trained on the worked solutions (the prompt masked; `tools`: solved with the calculator, its answers masked),
    batches of 64, seed 0, reporting every 100 steps."""
    from transformers import GPTNeoXConfig

    eos = tokenizer.eos_token_id
    config = GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=width, num_hidden_layers=4, num_attention_heads=4,
                           intermediate_size=4 * width, max_position_embeddings=512, bos_token_id=eos,
                           eos_token_id=eos)
    rows = train if rendered else [  # (rendered: the rows already have their query and pieces)
        {"query": MATH_PROMPT.format(question=r["question"]), "pieces": [*tool_pieces(r), (EOS, True)]} if tools
        else {"query": MATH_PROMPT.format(question=r["question"]), "reference_response": f" {r['answer']}{EOS}"}
        for r in train]

    def every_100(step: int, _) -> None:
        if step % 100 == 0 and step < steps:
            progress(f"SFT policy, step {step} of {steps}")

    policy = train_sft(config, tokenizer, rows, seed=0, steps=steps, lr=lr, batch_size=64, after_step=every_100)
    progress(f"SFT policy, {steps} steps")
    return policy


def greedy_answers(policy, tokenizer, rows: list[dict], max_tokens: int) -> tuple[list, list]:
    """The policy's greedy completions of the problems in `rows`, and whether each one's answer (the text after its
    last "####") is the reference's."""
    prompts = encode(tokenizer, [MATH_PROMPT.format(question=r["question"]) for r in rows])
    completions = sample(policy, prompts, tokenizer.eos_token_id, 0.0, max_tokens)
    return completions, right_answers(tokenizer, completions, rows)


def right_answers(tokenizer, completions: list[list[int]], rows: list[dict]) -> list[bool]:
    """Whether each completion's answer (its text after the last "####") is its row's reference's."""
    answers = [tokenizer.decode(c, skip_special_tokens=True).split("####")[-1].strip() for c in completions]
    return [a == r["answer"].split("####")[-1].strip() for a, r in zip(answers, rows)]


def math_pass_at_1(policy, tokenizer, rows: list[dict]) -> float:
    """Greedy pass@1: the text after the last "####" of the completion equals the reference's."""
    return sum(greedy_answers(policy, tokenizer, rows, 32)[1]) / len(rows)


def build_gsm8k(tiny_dir: str, quick: bool = False) -> tuple[str, str]:
    """Build the GSM8k miniature once (cached in `tiny_dir`): one-step addition and subtraction word problems with
    numbers up to 30 in four phrasings, GSM8k's column names, and a GPT-NeoX SFT policy (hidden 256, 4 layers)
    trained on the worked solutions of `train`. Two fixed evaluation splits: `test`, 400 new problems over facts
    seen in training (no question of `train`, but the operation and operands of a training problem: what GSM8k's
    test asks of a model that knows its arithmetic), and `test_unseen_facts`, 200 problems whose operation and
    operands no training problem has. Built unless one is there. `quick`: the same layout from a seventh of the
    problems and 2 SFT steps (the tests' check of the builder). Returns the SFT policy's and the dataset's folders."""
    return build_math_world("gsm8k", tiny_dir, quick)


def build_gsm8k_here(tiny_dir: str, quick: str = "0") -> None:
    """The GSM8k miniature's build itself (build_gsm8k runs it in a child process)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    quick = bool(int(quick))
    progress = Progress("the GSM8k miniature" + " (quick)" * quick, tiny_dir)
    sft_steps, scale = (2, 7) if quick else (600, 1)
    with deterministic(0) as rng:
        unseen, unseen_facts = [], set()
        while len(unseen) < 200 // scale:
            fact, row = make_math_problem(rng)
            if fact not in unseen_facts:
                unseen_facts.add(fact)
                unseen.append(row)
        train, train_facts = [], set()
        while len(train) < 7000 // scale:
            fact, row = make_math_problem(rng)
            if fact not in unseen_facts:
                train.append(row)
                train_facts.add(fact)
        # (measured with this SFT policy: new names, items or phrasings are beyond it, greedy pass@1 0.04-0.06 on
        # 400 such problems over seen facts, so new problems recombine the training split's names, items, phrasings)
        test, train_questions, test_rng = [], {r["question"] for r in train}, random.Random(1)
        while len(test) < 400 // scale:
            fact, row = make_math_problem(test_rng)
            if fact in train_facts and row["question"] not in train_questions:
                test.append(row)
        tokenizer = build_math_tokenizer([r["question"] + " " + r["answer"] for r in train])
        progress("problems and tokenizer")
        # (measured: lr 3e-3 at batch 32 memorises the training facts and stays under 10% on the test facts; at lr
        # 1e-3, batch 64, test pass@1 grows with the steps: ~0.1 at 300, ~0.3 at 600, ~0.44 at 900)
        policy = train_math_sft(tokenizer, train, 256, 1e-3, sft_steps, progress)
        report = {"quick": quick, "sft_steps": sft_steps,
                  "sft_test_pass_at_1": math_pass_at_1(policy, tokenizer, test),
                  "sft_unseen_facts_pass_at_1": math_pass_at_1(policy, tokenizer, unseen),
                  "sft_train_pass_at_1": math_pass_at_1(policy, tokenizer, train[:200 // scale])}
    save_world(tiny_dir, {"train": train, "test": test, "test_unseen_facts": unseen}, {"sft": policy}, tokenizer,
               report)
    progress(f"built: greedy pass@1 {report['sft_test_pass_at_1']:.2f} on the test split; saved in {tiny_dir}")


# ---------------------------------------------------------------------------------------------------------------
# The long-tailed chains (`fully_async_grpo.py --model tiny`)
# ---------------------------------------------------------------------------------------------------------------
CHAIN_MOVES = {"+": ("{n} gets {b} more.", "{n} finds {b}."), "-": ("{n} gives {b} away.", "{n} loses {b}.")}
CHAIN_LONGEST = 12  # steps a chain may take


def chain_steps(rng: random.Random) -> int:
    """How many steps a chain takes: 1, then one more with probability 1/2 each time (a geometric tail), so half
    the problems take one step, one in 64 takes seven or more: most worked solutions are short, a few long."""
    steps = 1
    while steps < CHAIN_LONGEST and rng.random() < 0.5:
        steps += 1
    return steps


def make_chain_problem(rng: random.Random, steps: Optional[int] = None) -> dict:
    """A GSM8k-shaped row (`question`, `answer`: one worked line per step, then "#### N") of a chain of additions
    and subtractions that keeps its count between 0 and 99, and its number of steps (`steps`, else chain_steps')."""
    name, item, value = rng.choice(MATH_NAMES), rng.choice(MATH_ITEMS), rng.randint(1, 30)
    steps = chain_steps(rng) if steps is None else steps
    sentences, lines = [f"{name} has {value} {item}."], []
    for _ in range(steps):
        operation = "-" if value > 1 and (value > 79 or rng.random() < 0.5) else "+"
        b = rng.randint(1, min(20, value - 1)) if operation == "-" else rng.randint(1, 20)
        new = value + b if operation == "+" else value - b
        sentences.append(rng.choice(CHAIN_MOVES[operation]).format(n=name, b=b))
        lines.append(f"{value} {operation} {b} = {new}.")
        value = new
    question = " ".join(sentences) + f" How many {item} does {name} have now?"
    return {"question": question, "answer": "\n".join(lines) + f"\n#### {value}", "steps": steps}


def build_chains(tiny_dir: str, quick: bool = False) -> tuple[str, str]:
    """Build the long-tailed chains world into `tiny_dir` unless one is there: chains of 1 to 12 additions and
    subtractions (`chain_steps`: half take one step), GSM8k's columns, the GSM8k miniature's tokenizer recipe (every
    digit a token of its own) and a GPT-NeoX SFT policy (hidden 128, 4 layers) trained on the worked solutions. A
    completion's length grows with its chain's steps, so its lengths have a long tail: the task of the fully
    asynchronous pipeline, where a synchronous batch waits for its longest completion. `quick`: the same layout
    from a tenth of the problems and 2 SFT steps (the tests' check of the builder). Returns the SFT policy's and
    the dataset's folders."""
    return build_math_world("chains", tiny_dir, quick)


def problem_splits(make_problem, rng: random.Random, scale: int) -> tuple[list, list]:
    """The chains worlds' splits: 12,000 / scale training problems drawn with `rng`, and 400 / scale test problems
    (their own generator, seed 1) whose questions are not in training (a new question; its steps' facts are
    training's, mostly)."""
    train = [make_problem(rng) for _ in range(12000 // scale)]
    questions = {r["question"] for r in train}
    test, test_rng = [], random.Random(1)
    while len(test) < 400 // scale:
        row = make_problem(test_rng)
        if row["question"] not in questions:
            test.append(row)
    return train, test


def build_chains_here(tiny_dir: str, quick: str = "0") -> None:
    """The chains world's build itself (build_chains runs it in a child process)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    quick = bool(int(quick))
    progress = Progress("the long-tailed chains" + " (quick)" * quick, tiny_dir)
    sft_steps, scale = (2, 10) if quick else (CHAIN_SFT_STEPS, 1)
    with deterministic(0) as rng:
        train, test = problem_splits(make_chain_problem, rng, scale)
        digits = [" 0 1 2 3 4 5 6 7 8 9"] * 100  # (no chain reaches 0: " 0" would get no token of its own)
        tokenizer = build_math_tokenizer([r["question"] + " " + r["answer"] for r in train] + digits)
        progress("problems and tokenizer")
        policy = train_math_sft(tokenizer, train, 128, 2e-3, sft_steps, progress)
        report = {"quick": quick, "sft_steps": sft_steps, **chain_report(policy, tokenizer, test)}
    save_world(tiny_dir, {"train": train, "test": test}, {"sft": policy}, tokenizer, report)
    progress(f"built: greedy pass@1 {report['sft_test_pass_at_1']:.2f}, completion length p50 "
             f"{report['sft_length_p50']:.0f} and p99 {report['sft_length_p99']:.0f} tokens; saved in {tiny_dir}")


CHAIN_SFT_STEPS = 900  # (a probe of one thread: greedy pass@1 0.07, 0.12, 0.22 and 0.45 at 250, 500, 750 and 1000)


def pass_at_1_by_steps(rows: list[dict], right: list[bool]) -> dict:
    """Greedy pass@1 on `rows`, overall and by the chain's steps (6 and more together)."""
    by_steps = {}
    for row, ok in zip(rows, right):
        by_steps.setdefault(min(row["steps"], 6), []).append(ok)
    return {"sft_test_pass_at_1": sum(right) / len(right),
            "sft_pass_at_1_by_steps": {f"{s}{'+' * (s == 6)}": sum(v) / len(v) for s, v in sorted(by_steps.items())}}


def chain_report(policy, tokenizer, rows: list[dict]) -> dict:
    """The SFT policy on `rows`: greedy pass@1 (overall and by the chain's steps) and its greedy completions'
    length percentiles in tokens (the tail the fully asynchronous pipeline is for)."""
    completions, right = greedy_answers(policy, tokenizer, rows, 128)
    lengths = sorted(len(c) for c in completions)
    return {**pass_at_1_by_steps(rows, right),
            "sft_length_p50": lengths[len(lengths) // 2], "sft_length_p90": lengths[int(0.9 * len(lengths))],
            "sft_length_p99": lengths[int(0.99 * len(lengths))]}


# ---------------------------------------------------------------------------------------------------------------
# The chains with a calculator (`agentic_grpo.py --model tiny`)
# ---------------------------------------------------------------------------------------------------------------
CALL, END_CALL = "<<", ">>"  # a call, "<<23 + 11>>": the policy stops at ">>", and the tool answers " = 34\n"
TOOLS_SFT_STEPS = 300  # a probe read greedy pass@1 0.15, 0.53, 0.605, 0.448, 0.675 at 150-600 steps: no cliff


def calculator(expression: str) -> Optional[int]:
    """The tool: `a + b` or `a - b` on whole numbers; None for anything else (a malformed call)."""
    match = re.fullmatch(r"\s*(\d{1,4})\s*([+-])\s*(\d{1,4})\s*", expression)
    if match is None:
        return None
    a, b = int(match[1]), int(match[3])
    return a + b if match[2] == "+" else a - b


def call_result(turn_text: str) -> Optional[int]:
    """The calculator's result for the call a turn ends with ("... <<23 + 11>>": 34); None for a turn without a call
    it can compute (no opening mark, or not `a + b` / `a - b`)."""
    if CALL not in turn_text:
        return None
    return calculator(turn_text.rsplit(CALL, 1)[-1].removesuffix(END_CALL))


def tool_answer(result: Optional[int]) -> str:
    """What the tool appends after a call: its result, or an error the policy can read."""
    return " = error\n" if result is None else f" = {result}\n"


def tool_world_format(tiny_dir: str) -> tuple[str, str, str]:
    """A tool world's prompt format, answer format and tool parser (agentic_grpo.py's defaults for it): what its
    world.json says (the chat tool world: its chat template, calls as <tool_call> JSON), else tools-v1's (the math
    prompt, "####", the calculator's "<<23 + 11>>")."""
    report = json.load(open(os.path.join(os.path.expanduser(tiny_dir), "world.json")))
    return tuple(report.get("format", (MATH_PROMPT, "####", "calculator")))


def tool_pieces(row: dict) -> list[tuple[str, bool]]:
    """A chains problem's worked solution as a tool episode: (text, written by the policy) pieces, a call per step
    and the tool's answer to it, then the final answer: " <<23 + 11>>", " = 34\n", "<<34 - 5>>", " = 29\n",
    "#### 29"."""
    pieces = []
    for i, line in enumerate(row["answer"].split("\n")[:-1]):  # "23 + 11 = 34."
        expression, result = line.rstrip(".").split(" = ")
        pieces += [(f"{' ' * (i == 0)}{CALL}{expression}{END_CALL}", True), (tool_answer(int(result)), False)]
    return pieces + [(row["answer"].split("\n")[-1], True)]


def make_tool_problem(rng: random.Random, distractors: float = 0.5, steps: Optional[int] = None) -> dict:
    """A chain problem (of `steps` steps, else chain_steps') with other people's counts woven in (each sentence after
    the first followed by another person's move with probability `distractors`): the policy must read which numbers
    are its chain's before it calls the tool, which does only the arithmetic."""
    row = make_chain_problem(rng, steps)
    sentences = row["question"].split(". ")
    name = sentences[0].split()[0]
    others = [n for n in MATH_NAMES if n != name]
    woven = [sentences[0]]
    for sentence in sentences[1:-1]:
        woven.append(sentence)
        if rng.random() < distractors:
            other, b = rng.choice(others), rng.randint(1, 20)
            woven.append(rng.choice(CHAIN_MOVES[rng.choice("+-")]).format(n=other, b=b).rstrip("."))
    woven.append(sentences[-1])
    return {**row, "question": ". ".join(woven)}


CALLS = (1, 2, 4)  # the calls world's chains: as many calls as steps, a third of the problems each
CALLS_DISTRACTORS = 0.25  # (tools-v1's 0.5 left its SFT policy at 0.25 on two steps, 0.00 on four: see tiny_world.md)
CALLS_SFT_STEPS = 300  # a 400-step probe read pass@1 0.085, 0.32, 0.55 at steps 150, 200, 300 (4 calls: 0.21 at 300)


def make_calls_problem(rng: random.Random) -> dict:
    """The calls world's problem: a tool problem of 1, 2 or 4 steps (a third each), fewer people's moves woven in
    than tools-v1's, so that the SFT policy solves each length at a useful rate and an experiment can vary the turns
    an episode takes."""
    return make_tool_problem(rng, CALLS_DISTRACTORS, rng.choice(CALLS))


def tool_episodes(policy, tokenizer, rows: list[dict], temperature: float = 0.0, max_turns: int = 16,
                  max_tokens: int = 128) -> list[list[int]]:
    """The policy solving `rows` with the calculator, with transformers' generate: each turn samples until a call
    ends (or EOS), the tool's answer is appended as ids (the sampled ids are never re-encoded), until EOS, the turns
    or the tokens run out. Returns each episode's ids after the prompt."""
    end_call, eos = tokenizer.convert_tokens_to_ids(END_CALL), tokenizer.eos_token_id
    prompts = encode(tokenizer, [MATH_PROMPT.format(question=r["question"]) for r in rows])
    episodes, active = [[] for _ in rows], list(range(len(rows)))
    for _ in range(max_turns):
        turns = sample(policy, [prompts[i] + episodes[i] for i in active], eos, temperature, max_tokens, (end_call,))
        still = []
        for i, turn in zip(active, turns):
            episodes[i] += turn
            if turn and turn[-1] == end_call and len(episodes[i]) < max_tokens:
                episodes[i] += encode(tokenizer, [tool_answer(call_result(tokenizer.decode(turn)))])[0]
                still.append(i)
        active = still
        if not active:
            break
    return episodes


def tool_report(policy, tokenizer, rows: list[dict]) -> dict:
    """The SFT policy with the tool on `rows`: greedy pass@1 (overall and by the chain's steps), its episodes' turns
    and lengths in tokens."""
    episodes = tool_episodes(policy, tokenizer, rows)
    end_call = tokenizer.convert_tokens_to_ids(END_CALL)
    right = right_answers(tokenizer, episodes, rows)
    turns, lengths = sorted(e.count(end_call) + 1 for e in episodes), sorted(map(len, episodes))
    return {**pass_at_1_by_steps(rows, right),
            "sft_turns_p50": turns[len(turns) // 2], "sft_turns_p90": turns[int(0.9 * len(turns))],
            "sft_turns_p99": turns[int(0.99 * len(turns))], "sft_length_p50": lengths[len(lengths) // 2],
            "sft_length_p99": lengths[int(0.99 * len(lengths))]}


def build_tools(tiny_dir: str, quick: bool = False) -> tuple[str, str]:
    """Build the chains-with-a-calculator world into `tiny_dir` unless one is there: the chains world's problems
    with other people's moves woven in (make_tool_problem: the policy must pick its chain's numbers), its tokenizer
    recipe with the call's two marks as tokens of their own, and a GPT-NeoX SFT policy (hidden 128, 4 layers)
    trained on the worked solutions solved with the tool (a call per step; the tool's answers masked from the loss:
    it calls, the tool computes). A long chain is a long episode: the tail is in turns as well as tokens. `quick`:
    a tenth of the problems and 2 SFT steps (the builder's test). Returns the SFT policy's and the dataset's
    folders."""
    return build_math_world("tools", tiny_dir, quick)


def build_calls(tiny_dir: str, quick: bool = False) -> tuple[str, str]:
    """Build the calls world into `tiny_dir` unless one is there: the tool world's recipe on problems of 1, 2 or 4
    calls (make_calls_problem), for the experiment that varies the turns an episode takes (docs/agentic.md).
    `quick`: a tenth of the problems and 2 SFT steps. Returns the SFT policy's and the dataset's folders."""
    return build_math_world("calls", tiny_dir, quick)


def build_calls_here(tiny_dir: str, quick: str = "0") -> None:
    """The calls world's build itself (build_calls runs it in a child process)."""
    build_tools_here(tiny_dir, quick, "calls")


def build_tools_here(tiny_dir: str, quick: str = "0", kind: str = "tools") -> None:
    """The tool world's build itself (build_tools runs it in a child process); `kind` "calls": the calls world's."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    quick = bool(int(quick))
    make_problem, steps, what = {"tools": (make_tool_problem, TOOLS_SFT_STEPS, "the chains with a calculator"),
                                 "calls": (make_calls_problem, CALLS_SFT_STEPS, "1, 2 or 4 calls")}[kind]
    progress = Progress(what + " (quick)" * quick, tiny_dir)
    sft_steps, scale = (2, 10) if quick else (steps, 1)
    with deterministic(0) as rng:
        train, test = problem_splits(make_problem, rng, scale)
        digits = [" 0 1 2 3 4 5 6 7 8 9"] * 100
        texts = [r["question"] + "".join(text for text, _ in tool_pieces(r)) for r in train]
        tokenizer = build_math_tokenizer(texts + digits)
        tokenizer.add_special_tokens({"additional_special_tokens": [CALL, END_CALL]})
        progress("problems and tokenizer")
        policy = train_math_sft(tokenizer, train, 128, 2e-3, sft_steps, progress, tools=True)
        report = {"quick": quick, "sft_steps": sft_steps, **tool_report(policy, tokenizer, test)}
    save_world(tiny_dir, {"train": train, "test": test}, {"sft": policy}, tokenizer, report)
    progress(f"built: greedy pass@1 with the tool {report['sft_test_pass_at_1']:.2f}, turns p50 "
             f"{report['sft_turns_p50']} and p99 {report['sft_turns_p99']}; saved in {tiny_dir}")


# ---------------------------------------------------------------------------------------------------------------
# The chains with a calculator in chat form (`agentic_grpo.py --model tiny --tiny_dir worlds/chat-tools-v1`)
# ---------------------------------------------------------------------------------------------------------------
IM_START, IM_END, TOOL_CALL, END_TOOL_CALL = "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"
# ChatML with tools, compact: the system turn names the tools; an assistant's calls are Hermes/Qwen <tool_call> JSON;
# a tool's reply is a `tool` turn (vLLM's `hermes` parser reads the calls)
CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {% for tool in tools %}{{ tool.function.name }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT_FORMAT = ("chat:{question}", "####", "hermes")  # agentic_grpo.py's prompt format, answer format, tool parser
CALCULATOR_SCHEMA = {"type": "function", "function": {
    "name": "calculator", "description": "Computes a sum or a difference of two whole numbers.",
    "parameters": {"type": "object", "properties": {"expression": {
        "type": "string", "description": "the sum or difference, as \"23 + 11\" or \"40 - 7\""}},
        "required": ["expression"]}}}


def chat_call(expression: str) -> str:
    """An assistant turn calling the calculator, as CHAT_TEMPLATE writes it (the end of turn included)."""
    return f"{TOOL_CALL}{json.dumps(dict(name='calculator', arguments=dict(expression=expression)))}{END_TOOL_CALL}" \
        + IM_END


def chat_reply(result: str) -> str:
    """The tool's reply and the next assistant header, as CHAT_TEMPLATE writes them after a call's end of turn."""
    return f"\n{IM_START}tool\n{result}{IM_END}\n{IM_START}assistant\n"


def chat_pieces(row: dict) -> list[tuple[str, bool]]:
    """A chains problem's worked solution as a chat tool episode: (text, written by the policy) pieces, a turn
    calling the calculator per step and the tool's reply, then the final answer's turn: '<tool_call>{"name":
    "calculator", "arguments": {"expression": "23 + 11"}}</tool_call><|im_end|>', '\n<|im_start|>tool\n34<|im_end|>
    \n<|im_start|>assistant\n', ..., "#### 29<|im_end|>"."""
    pieces = []
    for line in row["answer"].split("\n")[:-1]:  # "23 + 11 = 34."
        expression, result = line.rstrip(".").split(" = ")
        pieces += [(chat_call(expression), True), (chat_reply(result), False)]
    return pieces + [(row["answer"].split("\n")[-1] + IM_END, True)]


def chat_prompt(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template([dict(role="user", content=question)], tools=[CALCULATOR_SCHEMA],
                                         add_generation_prompt=True, tokenize=False)


def chat_tool_report(policy, tokenizer, rows: list[dict], max_turns: int = 16, max_tokens: int = 256) -> dict:
    """The SFT policy solving `rows` greedily in chat form with the calculator (transformers' generate): a turn ends
    at <|im_end|>; a turn with a <tool_call> gets the tool's reply as ids of their own. Greedy pass@1 (overall and
    by the chain's steps), turns and lengths in tokens."""
    end = tokenizer.convert_tokens_to_ids(IM_END)
    prompts = encode(tokenizer, [chat_prompt(tokenizer, r["question"]) for r in rows])
    episodes, turns, active = [[] for _ in rows], [0] * len(rows), list(range(len(rows)))
    for _ in range(max_turns):
        sampled = sample(policy, [prompts[i] + episodes[i] for i in active], tokenizer.eos_token_id, 0.0,
                         max_tokens, (end,))
        still = []
        for i, turn in zip(active, sampled):
            episodes[i], turns[i] = episodes[i] + turn, turns[i] + 1
            text = tokenizer.decode(turn)
            if TOOL_CALL in text and len(episodes[i]) < max_tokens:
                try:
                    call = json.loads(text.split(TOOL_CALL, 1)[1].split(END_TOOL_CALL, 1)[0])
                    result = calculator(call["arguments"]["expression"])
                except (ValueError, KeyError, TypeError, IndexError):
                    result = None
                episodes[i] += encode(tokenizer, [chat_reply("error" if result is None else str(result))])[0]
                still.append(i)
        active = still
        if not active:
            break
    right = right_answers(tokenizer, episodes, rows)
    turns, lengths = sorted(turns), sorted(map(len, episodes))
    return {**pass_at_1_by_steps(rows, right),
            "sft_turns_p50": turns[len(turns) // 2], "sft_turns_p99": turns[int(0.99 * len(turns))],
            "sft_length_p50": lengths[len(lengths) // 2], "sft_length_p99": lengths[int(0.99 * len(lengths))]}


def build_chat_tools(tiny_dir: str, quick: bool = False) -> tuple[str, str]:
    """Build the chat tool world into `tiny_dir` unless one is there: tools-v1's problems (the same generator and
    seed), a tokenizer with ChatML's and Hermes' marks as special tokens and CHAT_TEMPLATE, and a GPT-NeoX SFT
    policy (hidden 128, 4 layers) trained on the worked solutions in chat form: a turn per call, '<tool_call>
    {"name": "calculator", ...}</tool_call>', the tool's replies as `tool` turns (masked from the loss), the last
    turn the answer. `quick`: a tenth of the problems and 2 SFT steps. Returns the SFT policy's and the dataset's
    folders."""
    tiny_dir = os.path.expanduser(tiny_dir)
    if not os.path.exists(os.path.join(tiny_dir, "world.json")):
        build_in_own_process("chat-tools", tiny_dir, str(int(quick)))
    return os.path.join(tiny_dir, "sft"), os.path.join(tiny_dir, "data")


def build_chat_tools_here(tiny_dir: str, quick: str = "0") -> None:
    """The chat tool world's build itself (build_chat_tools runs it in a child process)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    quick = bool(int(quick))
    progress = Progress("the chains with a calculator, in chat form" + " (quick)" * quick, tiny_dir)
    sft_steps, scale = (2, 10) if quick else (CHAT_TOOLS_SFT_STEPS, 1)
    with deterministic(0) as rng:
        train, test = problem_splits(make_tool_problem, rng, scale)
        marks = [IM_START, IM_END, TOOL_CALL, END_TOOL_CALL]
        texts = [f"system\nTools: calculator\nuser\n{r['question']}\nassistant\n"
                 + "".join(text for text, _ in chat_pieces(r)) for r in train]
        for mark in marks:
            texts = [text.replace(mark, "\n") for text in texts]  # (the marks are tokens of their own)
        tokenizer = build_math_tokenizer(texts + [" 0 1 2 3 4 5 6 7 8 9"] * 100)
        tokenizer.add_special_tokens({"additional_special_tokens": marks})
        tokenizer.chat_template = CHAT_TEMPLATE
        progress("problems and tokenizer")
        rows = [{"query": chat_prompt(tokenizer, r["question"]), "pieces": chat_pieces(r)} for r in train]
        policy = train_math_sft(tokenizer, rows, 128, 2e-3, sft_steps, progress, rendered=True)
        report = {"quick": quick, "sft_steps": sft_steps, "format": list(CHAT_FORMAT),
                  **chat_tool_report(policy, tokenizer, test)}
    save_world(tiny_dir, {"train": train, "test": test}, {"sft": policy}, tokenizer, report)
    progress(f"built: greedy pass@1 with the tool {report['sft_test_pass_at_1']:.2f}, turns p50 "
             f"{report['sft_turns_p50']} and p99 {report['sft_turns_p99']}; saved in {tiny_dir}")


CHAT_TOOLS_SFT_STEPS = 300  # tools-v1's


if __name__ == "__main__":  # python tiny_world.py tldr|gsm8k|sized FOLDER [--quick] [--base TLDR_FOLDER] (sized)
    if sys.argv[1:2] == ["--build"]:  # (build_in_own_process's child)
        kind, folder, *options = sys.argv[2:]
        {"tldr": build_tldr_here, "gsm8k": build_gsm8k_here, "chains": build_chains_here, "tools": build_tools_here,
         "chat-tools": build_chat_tools_here, "calls": build_calls_here,
         "sized": build_sized_here}[kind](folder, *options)
        sys.exit()
    import argparse

    parser = argparse.ArgumentParser(description="Build a toy world into a folder (nothing is built over one).")
    parser.add_argument("kind", choices=["tldr", "gsm8k", "chains", "tools", "chat-tools", "calls", "sized"])
    parser.add_argument("folder")
    parser.add_argument("--quick", action="store_true", help="the same layout on a fraction of the work (tests)")
    parser.add_argument("--base", default=SHIPPED["tldr"], help="sized: the TL;DR world the sizes are built beside")
    cli = parser.parse_args()
    if cli.kind == "sized":
        build_sized(cli.folder, cli.base, cli.quick)
    else:
        {"tldr": build_tldr, "gsm8k": build_gsm8k, "chains": build_chains, "tools": build_tools,
         "chat-tools": build_chat_tools, "calls": build_calls}[cli.kind](
            cli.folder, cli.quick)
    print(open(os.path.join(os.path.expanduser(cli.folder), "world.json")).read())
