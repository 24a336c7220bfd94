"""agentic_grpo.py with tools in the model's own format, on the chat tool world (worlds/chat-tools-v1: its policy
writes Hermes <tool_call> JSON in a ChatML template): calls read by vLLM's parser, several in a turn, the replies the
template's tool turns encoded on their own; an unreadable call, an unknown tool, a raising tool, a timeout and a long
output answered, never a crash; a stateful environment; the checks at start (a template that is not prefix-stable, a
parser that does not read the template's calls); a `messages` dataset through both GRPO twins; and a fork's own
environment end to end through real vLLM, the learner's rows exactly the sampled ids."""
import importlib.util
import json
import os
import time

import datasets
import pytest
from conftest import REPO, run_in_process, run_script
from test_agentic import learner_rows, take_turn, tool_stream, trains_on_the_sampled_ids
from test_end_to_end import read_metrics
from transformers import AutoTokenizer

import agentic_grpo as ag
import tiny_world
from plumbing import tools
from plumbing.chat import end_of_turn_id

CALL = tiny_world.chat_call  # an assistant turn calling the calculator, as the template writes it


@pytest.fixture(scope="module")
def chat_tokenizer(chat_tools_dir):
    return AutoTokenizer.from_pretrained(os.path.join(chat_tools_dir, "sft"))


def chat_format(tokenizer, parser: str = "hermes", model_path: str = "chat-tools-v1") -> dict:
    return tools.turn_format(tokenizer, parser, [tiny_world.CALCULATOR_SCHEMA], True, end_of_turn_id(tokenizer),
                             model_path)


def test_calls_in_the_models_format_several_a_turn_each_answered_as_a_tool_turn(chat_tokenizer):
    """Two calls in one turn, read by vLLM's hermes parser, run, and answered by the template's two tool turns and
    the next assistant header, as ids encoded on their own; a turn with no call ends the episode, answered."""
    stream = tool_stream(chat_tokenizer, chat_format(chat_tokenizer))
    episode = ag.new_episode({})
    two_calls = CALL("23 + 11").removesuffix("<|im_end|>") + CALL("40 - 7")
    reply = take_turn(stream, episode, two_calls)
    assert reply == "\n<|im_start|>tool\n34<|im_end|>\n<|im_start|>tool\n33<|im_end|>\n<|im_start|>assistant\n"
    tool_span = [(start, end) for version, start, end in episode["spans"] if version == -1]
    assert len(tool_span) == 1 and episode["ids"][tool_span[0][0]:] == chat_tokenizer.encode(
        reply, add_special_tokens=False)  # (encoded alone, appended as ids)
    assert (episode["calls"], episode["errors"], episode["parse_failures"], episode["done"]) == (2, 0, 0, False)
    assert take_turn(stream, episode, "#### 33<|im_end|>") == "" and episode["done"] and episode["ended"]


def test_bad_calls_become_tool_turns_the_policy_reads(chat_tokenizer):
    """An unreadable call, an unknown tool, a raising tool, a timeout and a long output: each a tool turn the
    policy reads (counted as a parse failure or an error), never a crash; the episode goes on."""
    stream = tool_stream(chat_tokenizer, chat_format(chat_tokenizer), timeout=0.3, max_output_tokens=8)

    def slow(seconds: int) -> str:
        """Sleeps.

        Args:
            seconds: how long
        """
        time.sleep(seconds)
        return "late"

    def long(words: int) -> str:
        """Talks.

        Args:
            words: how many words
        """
        return " ".join(["word"] * words)

    episode = ag.new_episode({})
    episode["env"] = dict(tools=[ag.calculator, slow, long])
    unreadable = '<tool_call>{"name": "calculator", "argu</tool_call><|im_end|>'
    assert "error: no call could be read; a call is written '<tool_call>{" in take_turn(stream, episode, unreadable)
    call = '<tool_call>{{"name": "{}", "arguments": {}}}</tool_call><|im_end|>'
    assert "error: no tool named 'search'" in take_turn(stream, episode, call.format("search", "{}"))
    assert ("error: calculator raised ValueError: not a + b or a - b: '2 * 3'" in
            take_turn(stream, episode, CALL("2 * 3")))
    started = time.time()
    assert "error: slow timed out after 0.3 s" in take_turn(stream, episode, call.format("slow", '{"seconds": 5}'))
    assert time.time() - started < 2
    cut = take_turn(stream, episode, call.format("long", '{"words": 100}'))
    assert cut.startswith("\n<|im_start|>tool\nword") and " [cut]<|im_end|>" in cut and cut.count("w") < 10, cut
    assert (episode["parse_failures"], episode["errors"], episode["calls"], episode["done"]) == (1, 3, 5, False)


def test_a_stateful_environment_ends_and_scores_its_episode(chat_tokenizer):
    """An environment keeping a key-value store per episode: its tools share the episode's state, `done()` ends the
    episode after the replies, `score(text)` is its reward; another episode starts with a fresh store."""

    def start_episode(problem: dict) -> dict:
        store = {}

        def put(key: str, value: str) -> str:
            """Stores a value.

            Args:
                key: the key
                value: the value
            """
            store[key] = value
            return "stored"

        def get(key: str) -> str:
            """Reads a value.

            Args:
                key: the key
            """
            return store.get(key, "missing")

        return dict(tools=[put, get], done=lambda: "answer" in store,
                    score=lambda text: float(store.get("answer") == problem["answer"]))

    schemas = tools.schemas(start_episode({})["tools"])
    stream = tool_stream(chat_tokenizer, tools.turn_format(chat_tokenizer, "hermes", schemas, True,
                                                           end_of_turn_id(chat_tokenizer), "chat-tools-v1"))
    call = '<tool_call>{{"name": "{}", "arguments": {}}}</tool_call><|im_end|>'
    first, second = ag.new_episode({"answer": "7"}) | {"env": start_episode({"answer": "7"})}, \
        ag.new_episode({}) | {"env": start_episode({"answer": "7"})}
    assert "stored" in take_turn(stream, first, call.format("put", '{"key": "x", "value": "3"}'))
    assert "\n3<|im_end|>" in take_turn(stream, first, call.format("get", '{"key": "x"}'))
    assert "missing" in take_turn(stream, second, call.format("get", '{"key": "x"}'))  # (its own store)
    assert not first["done"]
    take_turn(stream, first, call.format("put", '{"key": "answer", "value": "7"}'))
    assert first["done"] and first["ended"] and first["score"] == 1.0


def test_a_template_that_is_not_prefix_stable_is_refused(chat_tools_dir, tmp_path, capsys):
    """A template that rewrites an earlier turn once a later one exists (it writes an assistant's calls only in its
    last turn, as templates that strip past reasoning do): the reply appended as ids would not be the chat the
    template renders, so the run refuses it at start, before vLLM starts."""
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(chat_tools_dir, "sft"))
    calls = "{%- for call in message.tool_calls or [] %}"
    assert calls in tiny_world.CHAT_TEMPLATE
    tokenizer.chat_template = tiny_world.CHAT_TEMPLATE.replace(
        calls, "{%- for call in (message.tool_calls or []) if message is sameas messages[-1] %}")
    with pytest.raises(SystemExit):
        chat_format(tokenizer, model_path="rewriting")
    assert "rewriting: its chat template is not prefix-stable" in capsys.readouterr().err
    tokenizer.save_pretrained(tmp_path / "sft")
    for name in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(chat_tools_dir, "sft", name), tmp_path / "sft" / name)
    code, stderr = run_in_process("agentic_grpo.py", "--model", "tiny", "--tiny_dir", chat_tools_dir,
                                  "--sft_model_path", str(tmp_path / "sft"), "--output_dir", str(tmp_path / "out"),
                                  capsys=capsys)
    assert code == 2 and "not prefix-stable" in stderr, stderr


@pytest.mark.parametrize("parser, message", [
    ("calculator", "--tool_parser calculator does not read the calls the chat template"),
    ("llama3_json", "--tool_parser llama3_json does not fit the policy's tokenizer"),
    ("nonesuch", "--tool_parser nonesuch: not one of vLLM's parsers"),
])
def test_a_parser_that_does_not_read_the_policys_calls_is_refused(parser, message, chat_tools_dir, tmp_path,
                                                                  capsys):
    code, stderr = run_in_process("agentic_grpo.py", "--model", "tiny", "--tiny_dir", chat_tools_dir,
                                  "--tool_parser", parser, "--output_dir", str(tmp_path), capsys=capsys)
    assert code == 2 and message in stderr, stderr


def write_messages_dataset(chat_tools_dir: str, folder) -> str:
    """The chat tool world's problems as a `messages` dataset (a user turn, an assistant's reference) with the
    answers in their own column, as parquet files."""
    for split in ("train", "test"):
        rows = [json.loads(line) for line in open(os.path.join(chat_tools_dir, "data", f"{split}.jsonl"))]
        datasets.Dataset.from_dict({
            "messages": [[dict(role="user", content=r["question"]), dict(role="assistant", content=r["answer"])]
                         for r in rows],
            "solution": [r["answer"] for r in rows]}).to_parquet(str(folder / f"{split}.parquet"))
    return str(folder)


@pytest.mark.parametrize("script", ["fully_async_grpo", "agentic_grpo"])
def test_a_messages_dataset_renders_in_the_chat_template(script, chat_tools_dir, tmp_path):
    """A `messages` dataset with --prompt_format chat: each prompt is the template's rendering of the user's turn
    (the reference answer left out), ending at the assistant header; the answers come from --answer_column."""
    module = __import__(script)
    data = write_messages_dataset(chat_tools_dir, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(chat_tools_dir, "sft"))
    args = module.Args(model="tiny", tiny_dir=chat_tools_dir, dataset=data, prompt_format="chat",
                       answer_column="solution", answer_format="####", output_dir=str(tmp_path / "out"))
    args = module.resolve_args(args)
    test = datasets.load_dataset(data, split="test")
    schemas = [tiny_world.CALCULATOR_SCHEMA] if script == "agentic_grpo" else None
    prompts = module.tokenize_prompts(tokenizer, test, *([schemas] if schemas else []), args)
    expected = tokenizer.apply_chat_template([test[0]["messages"][0]], tools=schemas, add_generation_prompt=True,
                                             tokenize=False)
    assert tokenizer.decode(prompts[0]) == expected and expected.endswith("<|im_start|>assistant\n")
    assert test[0]["solution"] not in tokenizer.decode(prompts[0])


@pytest.mark.slow
def test_a_forks_environment_end_to_end_in_the_models_format(chat_tools_dir, chat_tokenizer, tmp_path):
    """agentic_grpo.py forked by replacing one function, start_episode, with a stateful environment (it counts its
    episode's calls; its score, the reward, is 1 for an episode that called the calculator twice or more), on the
    chat tool world through real vLLM, k = 1, in-flight loads, a slow tool: the policy's calls are read by vLLM's
    hermes parser and answered by the template's tool turns (each the calculator's result for the call before it,
    encoded alone); the rewards are the environment's; the learner trains on exactly the sampled ids, the tools'
    masked; episodes span versions; the engine sampled while the tools ran."""
    source = open(os.path.join(REPO, "agentic_grpo.py")).read()
    start = source.index("def start_episode(")
    end = source.index("\n\n\ndef ", start)
    fork = source[:start] + '''def start_episode(problem: dict) -> dict:
    calls = []

    def calculator(expression: str) -> int:
        """Computes a sum or a difference of two whole numbers.

        Args:
            expression: the sum or difference, as "23 + 11" or "40 - 7"
        """
        calls.append(expression)
        return tiny_world.calculator(expression)

    return dict(tools=[calculator], score=lambda text: float(len(calls) >= 2))''' + source[end:]
    path = tmp_path / "agentic_fork.py"
    path.write_text(fork)
    out = tmp_path / "run"
    result = run_script("--model", "tiny", "--tiny_dir", chat_tools_dir, "--output_dir", str(out),
                        "--eval_every", "0", "--num_final_eval_prompts", "32", "--total_episodes", "128",
                        "--batch_size", "16", "--per_device_train_batch_size", "16", "--max_staleness", "1",
                        "--inflight_updates", "--record_rollouts", "--tool_latency", "0.02",
                        "--response_length", "256", "--eval_response_length", "256", script=str(path),
                        env={"PYTHONPATH": REPO})
    assert result.returncode == 0, result.stderr[-3000:]
    groups = [json.loads(line) for line in open(out / "rollouts.jsonl")]
    answered, unreadable, unread = 0, 0, {"trained": 0}
    for group in groups:
        for response, spans, score in zip(group["responses"], group["spans"], group["scores"]):
            turn_start, reached = 0, 0  # (reached: the calls the environment's calculator ran)
            for start, end in [(start, end) for version, start, end in spans if version == -1]:
                turn = chat_tokenizer.decode(response[turn_start:start])
                turn_start = end
                try:  # (the call as the policy wrote it: the calculator's result is the reply)
                    call = json.loads(turn.split("<tool_call>")[1].split("</tool_call>")[0])
                    reply = tiny_world.chat_reply(tiny_world.calculator(call["arguments"]["expression"])
                                                  if call["name"] == "calculator" else
                                                  f"error: no tool named {call['name']!r}")
                    answered, reached = answered + 1, reached + (call["name"] == "calculator")
                except (json.JSONDecodeError, KeyError, TypeError):  # (unreadable, or arguments that do not fit:
                    reply = chat_tokenizer.decode(response[start:end])  # an error the policy reads)
                    assert reply.startswith("\n<|im_start|>tool\nerror: "), reply
                    unreadable += 1
                    if "no call could be read" in reply:
                        unread[group["fate"]] = unread.get(group["fate"], 0) + 1
                expected = chat_tokenizer.encode(reply, add_special_tokens=False)
                assert response[start:end] == expected[: end - start] and (  # (cut only at the episode's end)
                    end == len(response) or end - start == len(expected))
            assert score == float(reached >= 2)  # (the environment's state: its calls)
    assert answered > 100 and unreadable <= 0.05 * answered, (answered, unreadable)
    trained = [g for g in groups if g["fate"] == "trained"]
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location("agentic_fork", path))
    module.__spec__.loader.exec_module(module)
    rollout = learner_rows(module, trained, chat_tokenizer)
    assert trains_on_the_sampled_ids(rollout, trained) == []
    assert rollout["rewards"].tolist() == [s for g in trained for s in g["scores"]]
    steps = read_metrics(str(out), step_metric="staleness/mean", eval_metric="eval/pass_at_1")[0]
    assert sum(r["tools/parse_failures"] for r in steps) == unread["trained"]  # (each counted, in its step)
    assert steps[-1]["tools/overlap_fraction"] > 0.3, steps[-1]
    assert max(r["staleness/within_episode_max"] for r in steps) >= 1


@pytest.mark.parametrize("script", ["fully_async_grpo", "agentic_grpo"])
def test_the_answer_is_read_where_answer_format_says(script):
    """`####` (the first, GSM8k's), the last \\boxed{} or the last number; the reference's after "####" if it has
    one, else its last number; compared as numbers."""
    module = __import__(script)
    text = "#### 1,200 then \\boxed{3.5} and \\boxed{-4} so 17"
    assert [module.extract_answer(text, f) for f in ("####", "boxed", "last_number")] == [1200.0, -4.0, 17.0]
    assert module.extract_answer("no answer", "boxed") is None
    with pytest.raises(ValueError, match="unknown --answer_format latex"):
        module.extract_answer(text, "latex")
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(tiny_world.SHIPPED["chains"], "sft"))
    args = module.Args(answer_format="boxed")
    responses = [tokenizer.encode(t, add_special_tokens=False) for t in ("so \\boxed{12}", "\\boxed{12.0}", "12")]
    assert module.correctness(tokenizer, responses, ["3 + 9 = 12\n#### 12", "12", "#### 12"], args).tolist() == [
        1.0, 1.0, 0.0]
