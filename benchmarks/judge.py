"""The paper's evaluation for chat: a pairwise LLM judge of the policy's answers against the references.

Reads the completions a run saved at its final evaluation ({output_dir}/final_completions.jsonl: prompt, the policy's
answer, the reference answer) and asks an OpenAI-compatible chat endpoint (`--base_url`, `--model`: a GPT-4o-class API,
or a local `vllm serve`) which of the two answers is better, twice per prompt with the answers in both orders, so
that a judge's preference for the first or the second position cancels. A prompt's score is the policy's share of
the orders it won (0, 0.5 or 1; an order whose reply names neither answer is left out and counted as unparsed); the
win rate is the mean over prompts, with its standard error. Also printed: the answers' mean lengths in tokens (the
paper reports them: a longer answer tends to win).

The prompt is AlpacaFarm-style pairwise comparison, as the paper's GPT-4o evaluation (a system line, the instruction,
the two outputs, a one-token verdict); its wording is ours, and the paper's judge saw one order per prompt, where this
one asks both. Requests run concurrently (--concurrency), each retried on errors with back-off (--max_retries); every
verdict is appended to --judgements as it arrives, and a second run asks only what is not there yet (resumable).

    python benchmarks/judge.py runs/my_run --base_url https://api.openai.com/v1 --model gpt-4o-2024-08-06
    python benchmarks/judge.py runs/my_run --base_url http://localhost:8000/v1 --model my-judge   # vllm serve
"""
import http.client
import json
import math
import os
import re
import statistics
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import tyro

SYSTEM = "You are a helpful assistant who judges which of two answers to an instruction is better."
TEMPLATE = """Select the output, (a) or (b), that best matches the instruction: the one that follows it most \
helpfully, accurately and harmlessly. Judge the content only: do not let the order of the outputs or their length \
decide.

# Instruction:
{instruction}

# Output (a):
{first}

# Output (b):
{second}

# Which is best, Output (a) or Output (b)? Answer with "Output (a)" or "Output (b)" and nothing else."""
VERDICT = re.compile(r"output\s*\(?([ab])\)?", re.IGNORECASE)


@dataclass
class Args:
    run: tyro.conf.Positional[str]
    """a run's folder (its final_completions.jsonl) or the file itself"""
    base_url: str = "https://api.openai.com/v1"
    """the OpenAI-compatible endpoint (its /chat/completions is asked)"""
    model: str = "gpt-4o-2024-08-06"
    """the judge model's name at that endpoint"""
    api_key_env: str = "OPENAI_API_KEY"
    """environment variable holding the API key (a local server needs none)"""
    judgements: Optional[str] = None
    """where verdicts are appended, and read back to resume (default: judgements.jsonl beside the completions)"""
    concurrency: int = 8
    """requests in flight at once"""
    max_retries: int = 5
    """retries of a failed request (back-off 1, 2, 4, ... s); after them the order is left for the next run"""
    timeout: float = 120.0
    """seconds a request may take"""
    max_tokens: int = 16
    """the judge's reply length (a verdict is a few tokens)"""
    limit: Optional[int] = None
    """judge only the first this many prompts"""


def instruction_text(prompt) -> str:
    """A chat's turns as 'role: content' paragraphs, or a plain prompt as it is."""
    if isinstance(prompt, str):
        return prompt.strip()
    return "\n\n".join(f"{turn['role']}: {turn['content']}" for turn in prompt)


def ask(args: Args, api_key: Optional[str], item: dict, policy_first: bool) -> dict:
    """One verdict: the reply, and which answer it names ('policy', 'reference', or None: unparsed); after
    --max_retries failures, the error instead."""
    first, second = (item["response"], item["reference"]) if policy_first else (item["reference"], item["response"])
    body = json.dumps(dict(model=args.model, temperature=0.0, max_tokens=args.max_tokens, messages=[
        dict(role="system", content=SYSTEM),
        dict(role="user", content=TEMPLATE.format(instruction=instruction_text(item["prompt"]), first=first.strip(),
                                                  second=second.strip()))])).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    for attempt in range(args.max_retries + 1):
        try:
            request = urllib.request.Request(args.base_url.rstrip("/") + "/chat/completions", body, headers)
            with urllib.request.urlopen(request, timeout=args.timeout) as response:
                reply = json.load(response)["choices"][0]["message"]["content"] or ""
            if not isinstance(reply, str):
                raise TypeError(f"the reply's content is {type(reply).__name__}, not text")
            break
        # A reply of another shape (no choices, a null), not JSON, or cut short (IncompleteRead: an HTTPException,
        # not an OSError) is a failed attempt too
        except (urllib.error.URLError, TimeoutError, OSError, http.client.HTTPException, KeyError, IndexError,
                TypeError, json.JSONDecodeError, UnicodeDecodeError) as error:
            refused = isinstance(error, urllib.error.HTTPError) and 400 <= error.code < 500 and error.code not in (
                408, 429)  # the request itself is wrong (too long, unknown model): asking again will not help
            if attempt == args.max_retries or refused:
                return dict(error=f"{type(error).__name__}: {error}")
            time.sleep(2**attempt)
    match = VERDICT.search(reply)
    named = None if match is None else ("a" if match.group(1).lower() == "a" else "b")
    winner = None if named is None else ("policy" if (named == "a") == policy_first else "reference")
    return dict(reply=reply, winner=winner)


if __name__ == "__main__":
    args = tyro.cli(Args)
    path = os.path.join(args.run, "final_completions.jsonl") if os.path.isdir(args.run) else args.run
    if not os.path.isfile(path):
        sys.exit(f"--run {args.run}: no final_completions.jsonl (a run writes it at its final evaluation)")
    items = [json.loads(line) for line in open(path)][: args.limit]
    judgements_path = args.judgements or os.path.join(os.path.dirname(path), "judgements.jsonl")
    done = {}  # (prompt index, policy first) -> verdict, from an earlier run
    if os.path.exists(judgements_path):
        for line in open(judgements_path):
            verdict = json.loads(line)
            if verdict["index"] < len(items):  # one for a prompt past --limit stays in the file, uncounted
                done[verdict["index"], verdict["policy_first"]] = verdict
    todo = [(i, order) for i in range(len(items)) for order in (True, False) if (i, order) not in done]
    print(f"{len(items)} prompts, both orders: {len(done)} verdicts already in {judgements_path}, asking "
          f"{len(todo)} of {args.model} at {args.base_url}", flush=True)

    api_key, failed, first_error = os.environ.get(args.api_key_env), 0, None
    with ThreadPoolExecutor(args.concurrency) as pool, open(judgements_path, "a") as out:
        futures = [(i, order, pool.submit(ask, args, api_key, items[i], order)) for i, order in todo]
        for i, order, future in futures:
            verdict = future.result()
            if "error" in verdict:  # not written: asked again next run
                failed, first_error = failed + 1, first_error or verdict["error"]
                continue
            verdict.update(index=i, policy_first=order)
            out.write(json.dumps(verdict) + "\n")
            out.flush()
            done[i, order] = verdict

    # A prompt's score: the policy's share of its parsed orders; prompts with none parsed are left out
    scores, unparsed = [], sum(v["winner"] is None for v in done.values())
    for i in range(len(items)):
        wins = [done[i, o]["winner"] == "policy" for o in (True, False) if (i, o) in done and done[i, o]["winner"]]
        if wins:
            scores.append(sum(wins) / len(wins))
    first_wins = [v["winner"] == "policy" for (_, order), v in done.items() if order and v["winner"]]
    second_wins = [v["winner"] == "policy" for (_, order), v in done.items() if not order and v["winner"]]
    print(f"verdicts: {len(done)} of {2 * len(items)} ({failed} failed after retries this run: run again to ask "
          f"them), {unparsed} unparsed (the reply named neither output)")
    if first_error:  # (a wrong --base_url, key or model fails every request the same way)
        print(f"the first failure: {first_error[:300]}")
    if scores:
        stderr = statistics.stdev(scores) / math.sqrt(len(scores)) if len(scores) > 1 else 0.0
        print(f"win rate against the references: {statistics.mean(scores):.3f} ± {stderr:.3f} over {len(scores)} "
              f"prompts (policy shown first: {statistics.mean(first_wins or [0]):.3f}, second: "
              f"{statistics.mean(second_wins or [0]):.3f})")
    else:
        print("win rate against the references: none (no verdict parsed)")
    print(f"mean length in tokens: policy {statistics.mean(it['response_tokens'] for it in items):.1f}, reference "
          f"{statistics.mean(it['reference_tokens'] for it in items):.1f}")
