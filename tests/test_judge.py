"""benchmarks/judge.py against a small real HTTP server in the test, which answers what each test needs, and counts
what it was asked: the openai client's retries (a body cut short, a 500, a 429: asked --max_retries more times, then
counted as failed; a 503 once: the verdict); what it does not retry (a 400; a reply sent whole that the judge cannot
read: no choices, no text, not JSON), counted as failed at once, never a crash; the key (none needed by a local server,
a clear error without one for the OpenAI API); and under --limit, verdicts an earlier run wrote for later prompts are
not counted."""
import http.server
import json
import os
import threading

import pytest
from conftest import run_script

VERDICT = json.dumps({"choices": [{"message": {"content": "Output (a)"}}]}).encode()
KEY_ENV = "JUDGE_TEST_KEY"  # (the judge reads the key from it: the tests' runs never send a real OPENAI_API_KEY)


def whole(payload: bytes, status: int = 200) -> tuple:
    """A reply sent in full: its status, its body and its true length."""
    return status, payload, len(payload)


@pytest.fixture
def endpoint():
    """Start a server on a free port: endpoint(answer) -> (port, the requests it got: their Authorization header and
    body), where answer(user text) gives the reply's status, body and the Content-Length to declare (a larger one,
    then a close: a body cut short)."""
    servers = []

    def start(answer):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                assert self.path == "/v1/chat/completions", self.path
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                asked.append((self.headers["Authorization"], body))
                status, payload, length = answer(body["messages"][-1]["content"])
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(length))
                self.end_headers()
                self.wfile.write(payload)
                self.close_connection = True

            def log_message(self, *_):  # quiet
                pass

        asked = []
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, kwargs=dict(poll_interval=0.05), daemon=True).start()
        servers.append(server)
        return server.server_address[1], asked

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def write_completions(folder, n: int) -> None:
    """n prompts (the first plain, the others chats), each with the policy's and the reference's answer."""
    with open(folder / "final_completions.jsonl", "w") as f:
        for i in range(n):
            prompt = [dict(role="user", content=f"Prompt {i}.")] if i else "Prompt 0."
            f.write(json.dumps(dict(prompt=prompt, response=f" answer {i}", reference=f" reference {i}",
                                    response_tokens=3, reference_tokens=4)) + "\n")


def judge(folder, port: int, *flags: str, env: dict | None = None):
    return run_script(str(folder), "--base_url", f"http://127.0.0.1:{port}/v1", "--model", "m", "--api_key_env",
                      KEY_ENV, *flags, script=os.path.join("benchmarks", "judge.py"), timeout=120,
                      env={KEY_ENV: "", **(env or {})})


def read_judgements(folder) -> list:
    path = folder / "judgements.jsonl"
    return [json.loads(line) for line in open(path)] if path.exists() else []


def times_asked(asked: list, prompt: str) -> int:
    return sum(prompt in body["messages"][-1]["content"] for _, body in asked)


def check_prompt_1_failed(result, tmp_path, error: str) -> None:
    """Prompt 0 got its verdicts, prompt 1's two orders failed: reported (with the first failure's error), left out
    of judgements.jsonl for the next run to ask, and the run finishes with prompt 0's win rate."""
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "verdicts: 2 of 4 (2 failed this run: run again to ask them)" in result.stdout, result.stdout
    assert f"the first failure: {error}" in result.stdout, result.stdout
    assert sorted((v["index"], v["policy_first"]) for v in read_judgements(tmp_path)) == [(0, False), (0, True)]
    assert "win rate against the references: 0.500 ± 0.000 over 1 prompts" in result.stdout, result.stdout


@pytest.mark.parametrize("bad, error", [
    ((200, b'{"choices": [{"message"', 1000), "APIConnectionError"),  # closed before the whole body
    (whole(b'{"error": {"message": "overloaded"}}', 500), "InternalServerError: Error code: 500"),
    (whole(b'{"error": {"message": "slow down"}}', 429), "RateLimitError: Error code: 429"),
], ids=["body_cut_short", "server_error", "rate_limited"])
def test_a_transient_failure_is_retried_by_the_client_then_counted(endpoint, tmp_path, bad, error):
    """Prompt 1 always gets a reply a second try may fix: the client asks each of its orders 1 + --max_retries
    times, then the order is counted as failed."""
    write_completions(tmp_path, 2)
    port, asked = endpoint(lambda text: bad if "Prompt 1." in text else whole(VERDICT))
    result = judge(tmp_path, port, "--max_retries", "1")  # (not the client's default, 2)
    check_prompt_1_failed(result, tmp_path, error)
    assert times_asked(asked, "Prompt 1.") == 2 * 2 and times_asked(asked, "Prompt 0.") == 2


@pytest.mark.parametrize("bad, error", [
    (whole(b'{"error": {"message": "too long"}}', 400), "BadRequestError: Error code: 400 - too long"),
    (whole(b'{"choices": []}'), "ValueError: a reply of another shape (IndexError"),
    (whole(b'{"choices": null}'), "ValueError: a reply of another shape (TypeError"),
    (whole(b'{"choices": [{"message": "Output (a)"}]}'), "ValueError: a reply of another shape (AttributeError"),
    (whole(b'{"choices": [{"message": {"content": 5}}]}'), "ValueError: the reply's content is 5, not text"),
    (whole(b'{"choices": [{"message": {"content": null}, "finish_reason": "length"}]}'),
     "ValueError: the reply's content is None, not text (finish_reason 'length')"),
    (whole(b'{"choices": "\xff"}'), "UnicodeDecodeError"),
    (whole(b"Output (a)"), "JSONDecodeError"),
], ids=["refused", "empty_choices", "null_choices", "message_not_an_object", "content_not_text", "content_null",
        "not_utf8", "not_json"])
def test_a_failure_a_retry_cannot_fix_is_counted_at_once(endpoint, tmp_path, bad, error):
    """Prompt 1 gets a refusal (400: the request is wrong) or a 200 the judge cannot read: each order is asked once,
    despite --max_retries 2, and counted as failed, never a crash. (Before the openai client, a 200 it could not
    read was asked again by our own loop; now it is not: the server answered, at temperature 0 the same request
    gets the same reply, and the next run asks the order again anyway.)"""
    write_completions(tmp_path, 2)
    port, asked = endpoint(lambda text: bad if "Prompt 1." in text else whole(VERDICT))
    result = judge(tmp_path, port, "--max_retries", "2")
    check_prompt_1_failed(result, tmp_path, error)
    assert times_asked(asked, "Prompt 1.") == 2


def test_a_retried_request_gets_its_verdict_with_the_key(endpoint, tmp_path):
    """Each order's first try gets a 503, its second the verdict: every verdict is written, each order asked
    twice, every request with the key from --api_key_env (the same body each time)."""
    write_completions(tmp_path, 2)
    tries = {}

    def answer(text: str) -> tuple:
        tries[text] = tries.get(text, 0) + 1  # (one order's tries come one after another: no race)
        return whole(b'{"error": {"message": "busy"}}', 503) if tries[text] == 1 else whole(VERDICT)

    port, asked = endpoint(answer)
    result = judge(tmp_path, port, "--max_retries", "1", env={KEY_ENV: "sk-test"})
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "verdicts: 4 of 4 (0 failed this run" in result.stdout and "the first failure" not in result.stdout
    assert sorted(tries.values()) == [2, 2, 2, 2] and len(read_judgements(tmp_path)) == 4
    assert {key for key, _ in asked} == {"Bearer sk-test"}
    assert "win rate against the references: 0.500 ± 0.000 over 2 prompts" in result.stdout, result.stdout


def test_a_local_server_needs_no_key_but_the_openai_api_does(endpoint, tmp_path):
    """With --api_key_env unset, a local server is sent a placeholder; the OpenAI API ends the run before asking
    anything, with a one-line error naming the variable, not a traceback."""
    write_completions(tmp_path, 1)
    port, asked = endpoint(lambda text: whole(VERDICT))
    result = judge(tmp_path, port)
    assert result.returncode == 0 and "verdicts: 2 of 2 (0 failed" in result.stdout, result.stderr[-3000:]
    assert {key for key, _ in asked} == {"Bearer EMPTY"}

    result = run_script(str(tmp_path), "--base_url", "https://api.openai.com/v1", "--api_key_env", KEY_ENV,
                        "--judgements", str(tmp_path / "other.jsonl"), script=os.path.join("benchmarks", "judge.py"),
                        timeout=120, env={KEY_ENV: ""})
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"--base_url https://api.openai.com/v1 needs an API key: set {KEY_ENV} (or name another variable with "
        "--api_key_env)"], result.stderr
    assert not (tmp_path / "other.jsonl").exists()


def test_limit_counts_only_the_judged_prompts_verdicts(endpoint, tmp_path):
    """An earlier run judged 3 prompts; --limit 1 counts prompt 0's two verdicts only (the verdicts line, the
    unparsed count, the win rates by position), asks nothing, and leaves the others in the file."""
    write_completions(tmp_path, 3)
    winners = {(0, True): "policy", (0, False): "reference", (1, True): "reference", (1, False): None,
               (2, True): None, (2, False): "policy"}
    with open(tmp_path / "judgements.jsonl", "w") as f:
        for (i, order), winner in winners.items():
            f.write(json.dumps(dict(reply="Output (a)" if winner else "?", winner=winner, index=i,
                                    policy_first=order)) + "\n")
    port, asked = endpoint(lambda text: whole(VERDICT))
    result = judge(tmp_path, port, "--max_retries", "0", "--limit", "1")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "1 prompts, both orders: 2 verdicts already in" in result.stdout, result.stdout
    assert "verdicts: 2 of 2 (0 failed this run" in result.stdout, result.stdout
    assert "0 unparsed (the reply named neither output)" in result.stdout, result.stdout
    assert ("win rate against the references: 0.500 ± 0.000 over 1 prompts (policy shown first: 1.000, second: "
            "0.000)") in result.stdout, result.stdout
    assert asked == [] and len(read_judgements(tmp_path)) == 6
