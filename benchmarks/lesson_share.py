"""How much of each script is the lesson: its own non-blank, non-comment lines (docstrings count: they teach) in the
functions and classes a reader must read to explain the method, over all of the script's. What is not lesson is
listed here, per script, with the reason; everything else in a script is. docs/how_it_works.md quotes the table.

    python benchmarks/lesson_share.py
"""
import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Not lesson in every script: resolve_args (flag checks, presets and paths; the schedule's sizes it derives are a few
# lines of it, which `Args`' docstrings state) and the evaluation set's assembly
EVERY = ("resolve_args", "evaluation_set")
# The paper's scripts: the evaluation record's fields and the generator process's start
PAPER = EVERY + ("eval_record", "start_generator")
# The streaming twins: the audit's drain at the end, the data's tokenisation, the entropy metric (their stream
# metrics, the --record_rollouts audit, a resumed run's admission order and the idle clock live in plumbing/)
STREAM = EVERY + ("take_leftovers", "tokenize_prompts", "token_entropy")
NOT_LESSON = {
    "async_dpo.py": PAPER, "sync_baseline.py": PAPER, "async_ppo.py": PAPER + ("token_entropy",),
    "async_rloo.py": PAPER, "gsm8k_async_dpo.py": PAPER,
    "fully_async_grpo.py": STREAM,
    # and the tools' start-up checks and the experiment's arm (docs/agentic.md): the first-turn mu (versions_of,
    # first_turn_logprobs, keep_version); the warning when a policy calls no tool and the slow tool are in
    # plumbing/tools.py
    "agentic_grpo.py": STREAM + ("tool_settings", "versions_of", "first_turn_logprobs", "keep_version"),
}


def code_lines(lines: list) -> int:
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def share(script: str) -> dict:
    source = open(os.path.join(REPO, script)).read()
    lines = source.splitlines()
    definitions = [node for node in ast.parse(source).body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    names = {node.name for node in definitions}
    unknown = set(NOT_LESSON[script]) - names
    if unknown:  # (a renamed function would silently count as lesson)
        raise SystemExit(f"{script}: NOT_LESSON names what it does not define: {sorted(unknown)}")
    lesson = sum(code_lines(lines[min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1: node.end_lineno])
                 for node in definitions if node.name not in NOT_LESSON[script])
    return dict(lines=len(lines), code=code_lines(lines), lesson=lesson)


def main() -> None:
    print("| script | lines | code lines | lesson lines | lesson share |\n|---|---|---|---|---|")
    for script in NOT_LESSON:
        s = share(script)
        print(f"| `{script}` | {s['lines']} | {s['code']} | {s['lesson']} | {s['lesson'] / s['code']:.0%} |")
    print("\nnot lesson (everything else in a script is):")
    for script, names in NOT_LESSON.items():
        print(f"  {script}: {', '.join(names)}")


if __name__ == "__main__":
    main()
