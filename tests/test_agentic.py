"""agentic_grpo.py: the tool (bad calls answered, wrong answers on purpose, its latency), bad flags, and episodes
end to end with a real vLLM engine: token in and token out (every policy token's log-prob is its own version's on
exactly the ids the learner trains on; the tool's ids are its answer, masked; a fork that re-tokenises is caught),
the staleness bound counted from each episode's oldest token under `pace` with in-flight loads, the episode-atomic
control, the first-turn arm, and a dead generator."""
import importlib.util
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import REPO, run_in_process, run_script, start_as_a_foreground_job
from test_end_to_end import read_metrics
from test_failures import STOPS_WITHIN, assert_all_gone, wait_for_training
from test_shutdown import assert_clean_exit
from transformers import AutoTokenizer

import agentic_grpo as ag
import tiny_world
from benchmarks import token_versions
from plumbing import core, tools


@pytest.fixture(scope="session")
def tokenizer(tools_dir):
    return AutoTokenizer.from_pretrained(os.path.join(tools_dir, "sft"))


def call(tokenizer, text: str, error_rate: float = 0.0, seed: int = 0) -> tuple[str, str]:
    """A turn ending in `text`, through the generator's own path (the calculator's parser, the tool in its thread,
    the reply appended): the reply's text and what happened."""
    turn_format = tools.turn_format(tokenizer, "calculator", [tiny_world.CALCULATOR_SCHEMA], False,
                                   tokenizer.eos_token_id, "tools-v1")
    stream = tool_stream(tokenizer, turn_format, error_rate=error_rate, seed=seed)
    episode = ag.new_episode({})
    reply = take_turn(stream, episode, text)
    outcome = "wrong" if episode["wrong"] else "malformed" if episode["errors"] + episode["parse_failures"] else "ok"
    return reply, outcome


def tool_stream(tokenizer, turn_format: dict, **tool) -> "ag.Stream":
    """An engine's stream as far as its episodes' tools need it: the settings, vLLM's parser, the tools' threads."""
    settings = dict(turn_format=turn_format, max_turns=8, timeout=30.0, max_output_tokens=256, error_rate=0.0,
                    latency=0.0, latency_distribution="fixed", seed=0)
    settings.update(tool)
    stream = ag.Stream(None, [], None, 0, None, settings, tokenizer, [], [])
    stream.parser, stream.pool = tools.make_parser(turn_format["parser"], tokenizer), ThreadPoolExecutor(8)
    stream.tool_rng = ag.random.Random(f"{settings['seed']}/tool/0")
    return stream


def take_turn(stream, episode: dict, text: str, max_tokens: int = 512) -> str:
    """A turn whose sampled ids are `text`'s, read (read_turn: its calls started) and answered once its calls are
    (append_replies): the reply's text (empty: the episode ended)."""
    ids = stream.tokenizer.encode(text, add_special_tokens=False)
    before = len(episode["ids"]) + len(ids)
    if ag.read_turn(stream, episode, ids, "stop", go_on=True, max_tokens=max_tokens) and episode["pending"]:
        while (outputs := tools.call_outputs(episode["pending"], stream.tool["timeout"], time.time())) is None:
            time.sleep(0.01)
        ag.append_replies(stream, episode, outputs, max_tokens)
    return stream.tokenizer.decode(episode["ids"][before:])


def test_the_tool_answers_calls_bad_calls_and_errs_on_purpose(tokenizer):
    """A call is computed (" <<23 + 11>>" -> " = 34\\n", the answer's ids encoded alone); a call the calculator
    cannot read is answered " = error\\n" (the episode goes on); --tool_error_rate 1 answers every call off by 1 to
    9, 0.3 about three in ten."""
    assert call(tokenizer, " <<23 + 11>>") == (" = 34\n", "ok")
    assert call(tokenizer, "Then <<40 - 7>>") == (" = 33\n", "ok")
    for bad in (" <<23 * 11>>", " <<>>", " <<23 + >>", " 23 + 11>>"):
        assert call(tokenizer, bad) == (" = error\n", "malformed"), bad
    wrong = [call(tokenizer, " <<23 + 11>>", 1.0, seed) for seed in range(50)]
    assert all(outcome == "wrong" and 1 <= abs(int(text.split("=")[1]) - 34) <= 9 for text, outcome in wrong)
    share = statistics.mean(call(tokenizer, " <<2 + 2>>", 0.3, seed)[1] == "wrong" for seed in range(400))
    assert 0.22 < share < 0.38, share


def test_the_tools_latency_fixed_and_long_tailed():
    """--tool_latency 0.2: `fixed` is 0.2 every call; `lognormal` has that mean (sigma 1: a long tail)."""
    rng = ag.random.Random(0)
    fixed = dict(latency=0.2, latency_distribution="fixed")
    assert tools.latency(fixed, rng) == 0.2
    draws = [tools.latency(dict(fixed, latency_distribution="lognormal"), rng) for _ in range(20000)]
    assert abs(statistics.mean(draws) - 0.2) < 0.01 and max(draws) > 1.0  # (a tail: 5x the mean)
    with pytest.raises(ValueError, match="unknown --tool_latency_distribution pareto"):
        tools.latency(dict(fixed, latency_distribution="pareto"), rng)


@pytest.mark.parametrize("flags_, message", [
    (["--max_turns", "0"], "--max_turns must be at least 1"),
    (["--tool_error_rate", "1.5"], "--tool_error_rate is a share, 0 to 1"),
    (["--tool_latency", "-1"], "--tool_latency must not be negative"),
    (["--episode_atomic", "--inflight_updates"], "--episode_atomic loads only between episodes"),
    (["--behaviour_version", "first_turn", "--stale_policy", "drop"], "--behaviour_version first_turn"),
])
def test_bad_flags_get_one_clear_error(flags_, message, tmp_path, capsys):
    code, stderr = run_in_process("agentic_grpo.py", "--model", "tiny", "--output_dir", str(tmp_path), *flags_,
                                  capsys=capsys)
    assert code == 2 and message in stderr, stderr


def run_flags(tools_dir: str, out, *flags_: str) -> tuple:
    return ("--model", "tiny", "--tiny_dir", tools_dir, "--output_dir", str(out), "--eval_every", "0",
            "--num_eval_prompts", "16", "--num_final_eval_prompts", "32", "--total_episodes", "512", *flags_)


def episodes_metrics(out) -> list:
    return read_metrics(str(out), step_metric="staleness/mean", eval_metric="eval/pass_at_1")[0]


def learner_rows(module, groups: list, tokenizer) -> dict:
    """What `module`'s learner trains on for the recorded groups: its make_rollout (each group's prompt by index)."""
    prompts = {g["index"]: g["prompt"] for g in groups}
    order = list(range(max(prompts) + 1))
    train_prompts = [prompts.get(i, []) for i in order]
    args = ag.Args(rank=0, world_size=1, answer_format="####")
    run = core.Run(torch.device("cpu"), torch.autocast("cpu", enabled=False), tokenizer.eos_token_id, 0)
    return module.make_rollout(groups, order, train_prompts, ["#### 0"] * len(order), tokenizer, args, run)


def trains_on_the_sampled_ids(rollout: dict, groups: list) -> list[str]:
    """Where the learner's rows differ from the episodes as sampled and appended: the ids (each row, its episode's),
    the loss's mask (1 exactly on the policy's tokens, 0 on the tool's) and mu (the sampler's log-prob of each policy
    token). Empty: it trains on exactly them."""
    differences = []
    episodes = [(g["index"], r, lp, spans) for g in groups for r, lp, spans in zip(
        g["responses"], g["logprobs"], g["spans"])]
    for row, (index, response, logprobs, spans) in enumerate(episodes):
        policy = [float(v >= 0) for v in ag.versions_of(spans)]
        if rollout["responses"][row] != response:
            differences.append(f"group {index}: ids")
        elif rollout["response_mask"][row, : len(response)].tolist() != policy:
            differences.append(f"group {index}: mask")
        elif not torch.allclose(rollout["behaviour_logprobs"][row, : len(response)],
                                torch.tensor(logprobs) * torch.tensor(policy)):
            differences.append(f"group {index}: mu")
    return differences


def with_a_non_canonical_split(groups: list, tokenizer) -> list:
    """The groups with one policy token of the first episode sampled as two ids that decode to the same text (a
    split the policy samples at temperature 1 now and then, and a decode and encode merges back), its spans and
    log-probs moved along: a fork that re-tokenises changes this episode's ids, whatever the run sampled."""
    group = json.loads(json.dumps(groups[0]))  # (a copy)
    response, logprobs, spans = group["responses"][0], group["logprobs"][0], group["spans"][0]
    for i in [i for version, start, end in spans if version >= 0 for i in range(start, end)]:
        text = tokenizer.decode([response[i]])
        pieces = [*tokenizer.encode(text[:1], add_special_tokens=False),
                  *tokenizer.encode(text[1:], add_special_tokens=False)] if len(text) > 1 else []
        if len(pieces) == 2 and tokenizer.decode(pieces) == text:
            more = len(pieces) - 1
            group["responses"][0] = response[:i] + pieces + response[i + 1:]
            group["logprobs"][0] = logprobs[:i] + [logprobs[i]] * len(pieces) + logprobs[i + 1:]
            group["spans"][0] = [[v, s + more * (s > i), e + more * (e > i)] for v, s, e in spans]
            return [group, *groups[1:]]
    raise AssertionError("no policy token of the first episode splits in two")


def re_tokenising_fork(tmp_path):
    """agentic_grpo.py as a fork that keeps episodes as text and tokenises them for the learner (decode, encode):
    the text is the same, the ids may not be."""
    source = open(os.path.join(REPO, "agentic_grpo.py")).read()
    line = "            responses.append(response)\n"
    assert source.count(line) == 1
    prompt = "train_prompts[index]"
    fork = source.replace(line, f"            responses.append(tokenizer.encode(tokenizer.decode({prompt} + "
                                f"response), add_special_tokens=False)[len({prompt}):])\n")
    path = tmp_path / "agentic_fork.py"
    path.write_text(fork)
    spec = importlib.util.spec_from_file_location("agentic_fork", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_token_in_token_out_masks_and_the_bound_in_flight(tools_dir, tokenizer, tmp_path):
    """k = 2, pace, in-flight loads, a wrong tool answer one call in five and a long-tailed tool latency, every
    episode recorded. Token in, token out: every policy token's log-prob, recomputed on the recorded ids under the
    version that sampled it, is the sampler's (float error); every tool span is the calculator's answer to the call
    before it, encoded alone (or off by 1 to 9: counted wrong, or " = error\\n"); the learner's rows are exactly these
    ids, its loss mask 0 exactly on the tool's tokens, mu the sampler's. A fork that re-tokenises the episodes'
    text is caught by the same check. The bound, counted from each episode's oldest token, holds at every step,
    while episodes span versions (within-episode staleness up to 2); the engine sampled during the tools' time, several
    turns a step. (B = 4 groups a step, so that versions arrive while episodes run: at the demo's B = 16, 3 of 640
    episodes spanned two versions, and a run with none failed the test.)"""
    out = tmp_path / "run"
    result = run_script(*run_flags(tools_dir, out, "--max_staleness", "2", "--inflight_updates", "--record_rollouts",
                                   "--tool_error_rate", "0.2", "--tool_latency", "0.02", "--tool_latency_distribution",
                                   "lognormal", "--batch_size", "16", "--per_device_train_batch_size", "16",
                                   "--total_episodes", "256"),
                        script="agentic_grpo.py")
    assert result.returncode == 0, result.stderr[-3000:]
    gaps = token_versions.token_gaps(str(out))
    assert max(gaps["first"].max(), gaps["later"].max()) < token_versions.TOLERANCE, gaps
    assert len(gaps["later"]) > 0  # (tokens sampled by a version newer than their episode's first)
    groups = [json.loads(line) for line in open(out / "rollouts.jsonl")]
    trained = [g for g in groups if g["fate"] == "trained"]
    outcomes = {"ok": 0, "wrong": 0, "malformed": 0}
    for group in groups:
        for response, spans in zip(group["responses"], group["spans"]):
            turn_start = 0  # (a turn may span several versions: in flight)
            for version, start, end in spans:
                if version != -1:
                    continue
                answer, turn = tokenizer.decode(response[start:end]), tokenizer.decode(response[turn_start:start])
                turn_start = end
                expected = tiny_world.call_result(turn)
                assert response[start:end] == tokenizer.encode(answer, add_special_tokens=False)
                if expected is None:
                    outcomes["malformed"] += answer == " = error\n"
                elif answer == tiny_world.tool_answer(expected):
                    outcomes["ok"] += 1
                else:
                    assert 1 <= abs(int(answer.split("=")[1]) - expected) <= 9, answer
                    outcomes["wrong"] += 1
    calls = sum(outcomes.values())
    assert outcomes["ok"] > 100 and 0.1 < outcomes["wrong"] / calls < 0.3, outcomes
    assert trains_on_the_sampled_ids(learner_rows(ag, trained, tokenizer), trained) == []
    split = with_a_non_canonical_split(trained, tokenizer)  # (what the policy samples now and then; a run may not)
    assert trains_on_the_sampled_ids(learner_rows(ag, split, tokenizer), split) == []
    caught = trains_on_the_sampled_ids(learner_rows(re_tokenising_fork(tmp_path), split, tokenizer), split)
    assert caught and all(difference.endswith("ids") for difference in caught), caught
    steps = episodes_metrics(out)
    assert len(steps) == 16 and all(r["staleness/max"] <= 2 and r["rollouts/discarded"] == 0 for r in steps), steps
    assert max(r["staleness/within_episode_max"] for r in steps) >= 1
    assert all(r["staleness/within_episode_max"] <= r["staleness/max"] for r in steps)
    assert sum(r["tools/wrong"] for r in steps) > 0 and steps[-1]["tools/overlap_fraction"] > 0.3, steps[-1]
    assert steps[-1]["generator/turns_per_step"] > 2  # (the engine steps several episodes' turns at once)
    assert max(r["episode/turns_p90"] for r in steps) >= 3


def test_episode_atomic_keeps_one_version_an_episode_and_first_turn_recomputes_mu(tools_dir, tmp_path):
    """--episode_atomic: a version loads only between episodes, so no episode spans two (within-episode staleness 0
    at every step, the bound kept). --behaviour_version first_turn: mu is recomputed under each episode's first
    turn's version, so the first step (every episode sampled by the learner's own weights) has importance weights 1
    within float error, as `token` has."""
    out = tmp_path / "atomic"
    result = run_script(*run_flags(tools_dir, out, "--episode_atomic", "--behaviour_version", "first_turn",
                                   "--total_episodes", "256"), script="agentic_grpo.py")  # (4 steps)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = episodes_metrics(out)
    assert all(r["staleness/within_episode_max"] == 0 and r["staleness/max"] <= 2 for r in steps), steps
    assert max(r["staleness/max"] for r in steps) == 2
    assert abs(steps[0]["is/weight_mean"] - 1) < 1e-4 and abs(steps[0]["is/weight_max"] - 1) < 1e-3


def test_a_dead_generator_stops_the_learner(tools_dir, tmp_path):
    """The engine killed mid-run, episodes waiting on the tool: the learner exits 1 within seconds, saying the
    generator died, and nothing is left behind."""
    out = tmp_path / "killed"
    process = start_as_a_foreground_job("agentic_grpo.py", *run_flags(
        tools_dir, out, "--total_episodes", "100000", "--tool_latency", "0.05"))
    children = wait_for_training(process, str(out), step_metric="staleness/mean")
    next(c for c in children if "multiprocessing.spawn" in " ".join(c.cmdline())).kill()
    stopped_at = time.time()
    stderr = assert_clean_exit(process, stopped_at, 1)
    assert time.time() - stopped_at < STOPS_WITHIN and "exited unexpectedly (exit code -9)" in stderr, stderr[-2000:]
    assert_all_gone(children)


def test_a_closing_mark_of_several_tokens_is_read_on_the_turns_text(chains_dir):
    """A tokenizer that writes the closing mark ">>" as two tokens (the chains world's): a turn stops at each ">",
    and goes on when the turn's text does not end in the whole mark; once it does, the call is read and answered."""
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(chains_dir, "sft"))
    turn_format = tools.turn_format(tokenizer, "calculator", [tiny_world.CALCULATOR_SCHEMA], False,
                                    tokenizer.eos_token_id, "chains-v1")
    assert turn_format["stop_ids"] == tokenizer.encode(">", add_special_tokens=False)
    stream, episode = tool_stream(tokenizer, turn_format), ag.new_episode({})
    first = tokenizer.encode(" <<23 + 11>", add_special_tokens=False)
    assert ag.read_turn(stream, episode, first, "stop", go_on=True, max_tokens=128)  # (a lone ">": the turn goes on)
    assert (episode["pieces"], episode["turns"], episode["pending"]) == (1, 0, [])
    assert take_turn(stream, episode, ">") == " = 34\n" and episode["turns"] == 1 and episode["calls"] == 1


def test_a_policy_that_calls_no_tool_is_said_once(capsys):
    """After the third step, a run whose policy called no tool says so once, with the format the parser reads; one
    whose calls were all unreadable says that; one that calls says nothing."""
    tool = dict(turn_format=dict(example="x <<1 + 2>>"))
    args = ag.Args(tool_parser="calculator", num_steps=10)

    def said(calls: int, failures: int) -> str:
        ledger, batch = dict(calls_seen=[0, 0, 0]), [dict(calls=[calls, 0], parse_failures=[failures, 0])] * 4
        for version in range(1, 6):
            tools.say_if_no_calls(batch, ledger, tool, version, args)
        return capsys.readouterr().out

    assert said(0, 0).count("warning: the policy called no tool in its first 24 episodes") == 1
    assert "--tool_parser calculator reads calls written like 'x <<1 + 2>>'" in said(0, 0)
    assert said(1, 1).count("none of the policy's 12 calls in its first 24 episodes could be read") == 1
    assert said(1, 0) == ""
