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
one asks both. The requests go through the `openai` package's client (vLLM installs it), --concurrency of them at once:
it retries what a second try may fix (connection errors, timeouts, 408, 409, 429, 5xx) with its own back-off
(--max_retries); a request refused (400: too long, an unknown model) or a reply with no text is not asked again at once
and counts as failed. Every verdict is appended to --judgements as it arrives, and a second run asks only what is not
there yet (resumable), the failed orders included.

    python benchmarks/judge.py runs/my_run --base_url https://api.openai.com/v1 --model gpt-4o-2024-08-06
    python benchmarks/judge.py runs/my_run --base_url http://localhost:8000/v1 --model my-judge   # vllm serve
"""
import json
import math
import os
import re
import statistics
import sys
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import openai
import tyro
from openai.types.chat import ChatCompletion

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
    """environment variable holding the API key (the OpenAI API needs one; a local server none)"""
    judgements: Optional[str] = None
    """where verdicts are appended, and read back to resume (default: judgements.jsonl beside the completions)"""
    concurrency: int = 8
    """requests in flight at once"""
    max_retries: int = 5
    """the openai client's retries of a request that failed in transit or with 408/409/429/5xx (back-off 0.5, 1, 2, ...
    up to 8 s, or the server's Retry-After); after them the order is left for the next run"""
    timeout: float = 120.0
    """seconds the client waits on the server (to connect, for the reply), each try"""
    max_tokens: int = 16
    """the judge's reply length (a verdict is a few tokens)"""
    limit: Optional[int] = None
    """judge only the first this many prompts"""


def instruction_text(prompt) -> str:
    """A chat's turns as 'role: content' paragraphs, or a plain prompt as it is."""
    if isinstance(prompt, str):
        return prompt.strip()
    return "\n\n".join(f"{turn['role']}: {turn['content']}" for turn in prompt)


def api_key(args: Args) -> str:
    """The key from --api_key_env. The OpenAI API refuses a request without one, so its absence ends the run before
    asking anything; a local server (`vllm serve`) checks none, but the client wants one: a placeholder."""
    key = os.environ.get(args.api_key_env)
    if key:
        return key
    if urllib.parse.urlparse(args.base_url).hostname == "api.openai.com":
        sys.exit(f"--base_url {args.base_url} needs an API key: set {args.api_key_env} (or name another variable "
                 "with --api_key_env)")
    return "EMPTY"


def reply_text(completion: ChatCompletion) -> str:
    """The reply's text. The client checks the status and that the body is JSON, not its shape (a server may leave out
    fields we do not read), so a reply with no choice or no text is caught here, as a ValueError."""
    try:
        choice = completion.choices[0]
        content = choice.message.content
    except (AttributeError, IndexError, KeyError, TypeError) as error:
        raise ValueError(f"a reply of another shape ({type(error).__name__}: {error})") from None
    if not isinstance(content, str):  # (None when the judge ran out of --max_tokens thinking, or refused)
        raise ValueError(f"the reply's content is {content!r}, not text (finish_reason {choice.finish_reason!r})")
    return content


def ask(client: openai.OpenAI, args: Args, item: dict, policy_first: bool) -> dict:
    """One verdict: the reply, and which answer it names ('policy', 'reference', or None: unparsed); or the error,
    after the client's retries. A reply the server sent whole but with no text is not asked again here: at
    temperature 0 the same request gets the same reply, and the next run asks the order again anyway."""
    first, second = (item["response"], item["reference"]) if policy_first else (item["reference"], item["response"])
    messages = [dict(role="system", content=SYSTEM),
                dict(role="user", content=TEMPLATE.format(instruction=instruction_text(item["prompt"]),
                                                          first=first.strip(), second=second.strip()))]
    try:
        completion = client.chat.completions.create(model=args.model, messages=messages, temperature=0.0,
                                                    max_tokens=args.max_tokens)
        reply = reply_text(completion)
    # The client's typed errors (APIConnectionError, APITimeoutError, APIStatusError: RateLimitError,
    # BadRequestError, ...), a body not JSON (its json.JSONDecodeError or UnicodeDecodeError) or of another shape
    except (openai.APIError, ValueError) as error:
        cause = f" ({error.__cause__!r})" if error.__cause__ else ""  # (a connection error's own says why)
        return dict(error=f"{type(error).__name__}: {error}{cause}")
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
    key = api_key(args) if todo else "EMPTY"  # (nothing to ask: the results need no key)
    print(f"{len(items)} prompts, both orders: {len(done)} verdicts already in {judgements_path}, asking "
          f"{len(todo)} of {args.model} at {args.base_url}", flush=True)

    client = openai.OpenAI(base_url=args.base_url, api_key=key, max_retries=args.max_retries,
                           timeout=args.timeout)  # (one for all threads: it is thread-safe)
    failed, first_error = 0, None
    with client, ThreadPoolExecutor(args.concurrency) as pool, open(judgements_path, "a") as out:
        futures = [(i, order, pool.submit(ask, client, args, items[i], order)) for i, order in todo]
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
    print(f"verdicts: {len(done)} of {2 * len(items)} ({failed} failed this run: run again to ask them), {unparsed} "
          "unparsed (the reply named neither output)")
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
