"""The toy worlds (tiny_world.py): the judge on hand-made summaries, the data's design, the targets the build must
reach, recomputed from the shipped world rather than read from its report; the builder, on a quick build of each
world, laid out as the shipped one; and a damaged world refused, naming the file."""
import collections
import json
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, run_script
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import tiny_world
from tiny_world import EOS, TOPICS, judge

DOGS = "SUBREDDIT: r/dogs\n\nTITLE: my puppy\n\nPOST: my puppy ate the leash.\n\nTL;DR:"


@pytest.mark.parametrize("summary, has_eos, score", [
    ("puppy leash", True, 2.0),  # +1 per topic word of the post's subreddit
    ("puppy the leash", True, 1.5),  # -0.5 per other word
    ("kitten", True, -0.5),  # another subreddit's topic word is just another word
    ("puppy leash bark walk", True, 4.0),  # the best a summary can do
    ("puppy leash bark walk vet", True, 4.0),  # a fifth topic word: +1, and -1 for the length
    ("puppy puppy puppy puppy", True, 4.0),  # repeats count
    ("puppy the the the the", True, 1.0 - 2.0 - 1.0),
    ("puppy leash", False, -1.0),  # -3 without EOS
    ("", True, 0.0),
])
def test_judge_on_hand_made_summaries(summary, has_eos, score):
    assert judge(DOGS, summary, has_eos) == score


def test_data_is_in_the_hub_format_with_decent_but_beatable_references():
    rng = random.Random(0)
    rows = [tiny_world.make_example(rng) for _ in range(300)]
    for row in rows:
        assert row["query"].startswith(f"SUBREDDIT: r/{row['subreddit']}\n\nTITLE: ")
        assert row["query"].endswith("\n\nTL;DR:")
        assert row["reference_response"] == f" {row['summary']}{EOS}"
        own = [w for w in row["post"][:-1].split() if w in TOPICS[row["subreddit"]]]
        assert 4 <= len(own) <= 8 and all(own.count(w) == 2 for w in own)  # 2-4 topic words, each twice
        assert all(w in own for w in row["summary"].split() if w != "the")
    scores = [judge(r["query"], r["summary"], True) for r in rows]
    assert set(scores) == {1.5, 2.5} and 1.9 < sum(scores) / len(scores) < 2.4  # of a possible 4


@pytest.fixture(scope="module")
def world(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(tiny_dir, "sft"))
    models = {name: AutoModelForSequenceClassification.from_pretrained(os.path.join(tiny_dir, name)).eval()
              for name in ("gold", "proxy")}
    models["sft"] = AutoModelForCausalLM.from_pretrained(os.path.join(tiny_dir, "sft")).eval()
    validation = [json.loads(line) for line in open(os.path.join(tiny_dir, "data", "validation.jsonl"))]
    report = json.load(open(os.path.join(tiny_dir, "world.json")))
    return tokenizer, models, validation, report


def test_gold_and_proxy_agreement_reach_their_targets(world):
    tokenizer, models, validation, report = world
    held_out = tiny_world.held_out_sets(models["sft"], tokenizer, validation[:256])
    judged = [torch.tensor([tiny_world.judge_tokens(tokenizer, row["query"], c) for c in completions])
              for (_, completions), row in zip(held_out, validation)]
    gold, proxy = (tiny_world.score_sets(models[name], held_out, tokenizer.eos_token_id) for name in ("gold", "proxy"))
    gold_judge, proxy_gold = tiny_world.agreement(gold, judged), tiny_world.agreement(proxy, gold)
    assert gold_judge >= 0.9  # the gold model learned the judge
    assert 0.65 <= proxy_gold <= 0.85  # the proxy is decent but imperfect
    assert gold_judge == pytest.approx(report["gold_judge_agreement"], abs=0.01)
    assert proxy_gold == pytest.approx(report["proxy_gold_agreement"], abs=0.01)


def test_sft_policy_loses_to_the_references_most_of_the_time_under_gold(world):
    tokenizer, models, validation, report = world
    eos = tokenizer.eos_token_id
    prompts = tiny_world.encode(tokenizer, [r["query"] for r in validation])
    with torch.no_grad():
        greedy = tiny_world.sample(models["sft"], prompts, eos, 0.0, 16)
        policy_scores = tiny_world.reward_scores(models["gold"], prompts, greedy, eos)
        reference_scores = tiny_world.reward_scores(
            models["gold"], prompts, tiny_world.encode(tokenizer, [r["reference_response"] for r in validation]), eos)
    win_rate = (policy_scores > reference_scores).float().mean().item()
    assert 0.15 <= win_rate <= 0.45
    assert win_rate == pytest.approx(report["sft_gold_win_rate"], abs=0.02)
    # Its summaries depend on the post: on its subreddit at least (today's SFT policy is not a constant answer)
    assert len({tuple(g) for g in greedy}) >= 2 * len(TOPICS)
    judged = [tiny_world.judge_tokens(tokenizer, r["query"], g) for r, g in zip(validation, greedy)]
    assert sum(score > 0 for score in judged) / len(judged) > 0.9


def test_gold_model_follows_one_word_probes(world):
    """A gold model fooled by one word (a repeat, an off-topic word, a filler) would be gamed by the policy."""
    tokenizer, models, validation, _ = world
    prompts = tiny_world.encode(tokenizer, [r["query"] for r in validation[:128]])
    probes = tiny_world.probe_agreement(models["gold"], tokenizer, validation[:128], prompts)
    assert min(probes.values()) >= 0.9, probes


@pytest.mark.slow
def test_sized_policies_and_proxies_share_the_gold_model_and_leave_the_world_as_it_was(tiny_dir, sized_dir):
    """tiny_world.build_sized (quick: two sizes): each policy is a causal LM of its size, "base" the world's own
    policy weight for weight; each proxy a reward model of its size, trained on pairs of every size's samples,
    normalised on held-out summaries and ordering them mostly as gold does, its agreement reported on each size's;
    the gold model, data and tokenizer stay the world's, whose folder is not touched."""
    report = json.load(open(os.path.join(sized_dir, "world.json")))
    assert list(report["sizes"]) == ["small", "base"] and report["base"] == tiny_dir
    small, base = (report["sizes"][size] for size in ("small", "base"))
    assert small["parameters"] * 2.5 < base["parameters"]
    world = json.load(open(os.path.join(tiny_dir, "world.json")))
    assert base["sft_gold_win_rate"] == world["sft_gold_win_rate"] and 0 <= small["sft_gold_win_rate"] <= 1
    own = AutoModelForCausalLM.from_pretrained(os.path.join(tiny_dir, "sft"))
    copy = AutoModelForCausalLM.from_pretrained(os.path.join(sized_dir, "policy-base"))
    assert all(torch.equal(a, b) for a, b in zip(own.state_dict().values(), copy.state_dict().values()))
    for size, (hidden, layers, _) in tiny_world.SIZES.items():
        if size not in report["sizes"]:
            continue
        proxy = AutoModelForSequenceClassification.from_pretrained(os.path.join(sized_dir, f"proxy-{size}"))
        assert (proxy.config.hidden_size, proxy.config.num_hidden_layers) == (hidden, layers)
        assert report["sizes"][size]["proxy_gold_agreement"] > 0.55, size
        # trained on every size's samples, and measured on each size's own
        assert set(report["sizes"][size]["proxy_gold_agreement_on"]) == set(report["sizes"]), size
    assert report["recipe"] == tiny_world.SIZED_RECIPE
    assert not os.path.exists(os.path.join(sized_dir, "gold")) and not os.path.exists(os.path.join(sized_dir, "data"))
    # the world it was built beside is as it was, file for file
    assert report["base_hash"] == tiny_world.check_world(tiny_dir, "tldr")


@pytest.mark.parametrize("expression, result", [("23 + 11", 34), (" 34 - 5 ", 29), ("7-9", -2), ("23 +", None),
                                                ("23 * 2", None), ("", None), ("1 + 2 + 3", None)])
def test_the_calculator_answers_or_says_error(expression, result):
    assert tiny_world.calculator(expression) == result
    assert tiny_world.tool_answer(result) == (" = error\n" if result is None else f" = {result}\n")


@pytest.mark.parametrize("kind", ["tools", "calls"])
def test_the_tool_worlds_sft_policy_calls_the_tool_and_solves_what_its_report_says(kind):
    """The shipped tool worlds: their worked solutions are a call per step, each answered by the tool, then the final
    answer; the SFT policy trained on them (the tool's answers masked) solves the test problems with the tool,
    greedily, as often as its report says (recomputed here: 400 problems, every turn through the calculator), most
    episodes taking more than one turn. The problems are chains with other people's moves woven in: a question of
    more than one step names another person often (the policy must pick its chain's numbers). The calls world's
    problems take 1, 2 or 4 calls, about a third each, and its policy solves each length at a useful rate."""
    folder = tiny_world.SHIPPED[kind]
    sft, data, _ = tiny_world.math_world(folder, kind)
    rows = [json.loads(line) for line in open(os.path.join(data, "test.jsonl"))]
    longer = [r for r in rows if r["steps"] > 1]
    woven = [r for r in longer if len({w for w in r["question"].split() if w in tiny_world.MATH_NAMES}) > 1]
    assert {"tools": 0.4, "calls": 0.25}[kind] < len(woven) / len(longer) < 0.95, len(woven) / len(longer)
    pieces = tiny_world.tool_pieces(rows[0])
    steps = rows[0]["answer"].count("\n")
    assert len(pieces) == 2 * steps + 1 and [keep for _, keep in pieces] == [True, False] * steps + [True]
    policy, tokenizer = AutoModelForCausalLM.from_pretrained(sft).eval(), AutoTokenizer.from_pretrained(sft)
    assert all(len(tokenizer.encode(mark, add_special_tokens=False)) == 1 for mark in (tiny_world.CALL,
                                                                                       tiny_world.END_CALL))
    report = json.load(open(os.path.join(folder, "world.json")))
    recomputed = tiny_world.tool_report(policy, tokenizer, rows)
    assert recomputed["sft_test_pass_at_1"] == pytest.approx(report["sft_test_pass_at_1"], abs=1e-9)
    assert recomputed["sft_turns_p50"] >= 2 and 0.15 < recomputed["sft_test_pass_at_1"] < 0.7
    if kind == "calls":
        counts = collections.Counter(r["steps"] for r in rows)
        assert set(counts) == {1, 2, 4} and min(counts.values()) > len(rows) / 4, counts
        assert min(recomputed["sft_pass_at_1_by_steps"].values()) > 0.1, recomputed["sft_pass_at_1_by_steps"]


def layout(folder: str) -> set:
    return {os.path.relpath(os.path.join(root, name), folder) for root, _, names in os.walk(folder) for name in names}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tldr", "gsm8k", "chains", "tools", "chat-tools"])
def test_the_builder_writes_a_world_laid_out_as_the_shipped_one(kind, tmp_path):
    """`python tiny_world.py KIND FOLDER --quick`, the builder's command on a fraction of the work: the same files as
    the world shipped in worlds/ (Hugging Face model folders, the dataset with its card, world.json with the same
    entries, SHA256SUMS), models of the same architecture, and a world the scripts accept (its hashes check)."""
    folder = tmp_path / kind
    result = subprocess.run([sys.executable, os.path.join(REPO, "tiny_world.py"), kind, str(folder), "--quick"],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    shipped = tiny_world.SHIPPED[kind]
    assert layout(folder) == layout(shipped)
    built, theirs = (json.load(open(os.path.join(f, "world.json"))) for f in (folder, shipped))
    assert set(built) == set(theirs) and built["quick"] and not theirs["quick"]
    for model in {path.split("/")[0] for path in layout(shipped) if path.endswith("config.json")}:
        configs = [json.load(open(os.path.join(f, model, "config.json"))) for f in (folder, shipped)]
        for key in ("architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads"):
            assert configs[0][key] == configs[1][key], (model, key)
    assert open(folder / "data" / "README.md").read() == open(os.path.join(shipped, "data", "README.md")).read()
    world = tiny_world.tldr_world(str(folder)) if kind == "tldr" else tiny_world.math_world(str(folder), kind)
    assert world[-1] == tiny_world.file_hash(folder / tiny_world.CHECKSUMS) != tiny_world.check_world(shipped, kind)


def test_a_world_with_a_file_missing_or_changed_is_refused_naming_it(tiny_dir, tmp_path, capsys):
    """A world folder is checked file by file against its SHA256SUMS before anything runs: a missing model file
    stops the script with an error naming it and the command that builds a world (it used to build one, minutes,
    over what was there); a changed file is named too; nothing is rebuilt."""
    copy = tmp_path / "world"
    shutil.copytree(tiny_dir, copy)
    (copy / "proxy" / "model.safetensors").unlink()
    result = run_script("--model", "tiny", "--tiny_dir", str(copy), "--output_dir", str(tmp_path / "run"), timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "proxy/model.safetensors is missing" in result.stderr and "python tiny_world.py tldr" in result.stderr
    assert not (copy / "proxy" / "model.safetensors").exists() and not (tmp_path / "run").exists()
    shutil.copy(os.path.join(tiny_dir, "proxy", "model.safetensors"), copy / "proxy")
    with open(copy / "data" / "validation.jsonl", "a") as f:
        f.write("\n")
    with pytest.raises(SystemExit):
        tiny_world.tldr_world(str(copy))
    assert "data/validation.jsonl is not the file this world was built with" in capsys.readouterr().err
