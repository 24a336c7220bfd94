"""benchmarks/judge.py against a small real HTTP server in the test, which answers what each test needs: a reply the
judge cannot read (no choices, an unexpected shape, a body cut short) is a failed attempt, retried and then reported
as failed, never a crash; and under --limit, verdicts an earlier run wrote for later prompts are not counted."""
import http.server
import json
import os
import threading

import pytest
from conftest import run_script

VERDICT = json.dumps({"choices": [{"message": {"content": "Output (a)"}}]}).encode()


def whole(payload: bytes) -> tuple:
    """A reply sent in full: its body and its true length."""
    return payload, len(payload)


@pytest.fixture
def endpoint():
    """Start a server on a free port: endpoint(answer) -> (port, the bodies it was asked), where answer(user text)
    gives the reply's body and the Content-Length to declare (a larger one, then a close: a body cut short)."""
    servers = []

    def start(answer):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                assert self.path == "/v1/chat/completions", self.path
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                asked.append(body)
                payload, length = answer(body["messages"][-1]["content"])
                self.send_response(200)
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


def judge(folder, port: int, *flags: str):
    return run_script(str(folder), "--base_url", f"http://127.0.0.1:{port}/v1", "--model", "m", *flags,
                      script=os.path.join("benchmarks", "judge.py"), timeout=120)


def read_judgements(folder) -> list:
    path = folder / "judgements.jsonl"
    return [json.loads(line) for line in open(path)] if path.exists() else []


@pytest.mark.parametrize("bad", [
    whole(b'{"choices": []}'),  # no choice: an IndexError escaped
    whole(b'{"choices": null}'),  # a TypeError escaped
    whole(b'{"choices": [{"message": {"content": 5}}]}'),  # not text: a TypeError escaped at parsing it
    whole(b'{"choices": "\xff"}'),  # not UTF-8: a UnicodeDecodeError escaped
    (b'{"choices": [{"message"', 1000),  # closed before the whole body: an http.client.IncompleteRead escaped
], ids=["empty_choices", "null_choices", "content_not_text", "not_utf8", "body_cut_short"])
def test_an_unreadable_reply_is_a_failed_attempt(endpoint, tmp_path, bad):
    """Prompt 0 gets a verdict and prompt 1 a reply the judge cannot read: each of prompt 1's orders is asked again
    (--max_retries 1) and then reported as failed and left out of judgements.jsonl, for the next run to ask; the
    run finishes and reports prompt 0's verdicts."""
    write_completions(tmp_path, 2)
    port, asked = endpoint(lambda text: bad if "Prompt 1." in text else whole(VERDICT))
    result = judge(tmp_path, port, "--max_retries", "1")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "verdicts: 2 of 4 (2 failed after retries this run" in result.stdout, result.stdout
    assert "the first failure: " in result.stdout  # (what went wrong, for a wrong --base_url or key)
    assert sum("Prompt 1." in body["messages"][-1]["content"] for body in asked) == 4  # 2 orders, 2 attempts each
    assert sorted((v["index"], v["policy_first"]) for v in read_judgements(tmp_path)) == [(0, False), (0, True)]
    assert "win rate against the references: 0.500 ± 0.000 over 1 prompts" in result.stdout, result.stdout


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
    assert "verdicts: 2 of 2 (0 failed after retries this run" in result.stdout, result.stdout
    assert "0 unparsed (the reply named neither output)" in result.stdout, result.stdout
    assert ("win rate against the references: 0.500 ± 0.000 over 1 prompts (policy shown first: 1.000, second: "
            "0.000)") in result.stdout, result.stdout
    assert asked == [] and len(read_judgements(tmp_path)) == 6
