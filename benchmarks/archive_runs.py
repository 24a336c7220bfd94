"""Pack a sweep's run folders into one small archive that the repository can keep, so that every figure a sweep
printed (and any computed after it) can be recomputed from the runs themselves, without running them again.

Each run keeps its metrics.jsonl, less the sample summaries each evaluation prints (`eval/samples`) but the final
evaluation's first SAMPLES_KEPT (so that what a run ended up writing can be read back), and with floats to 9
significant digits, the small files a sweep marks a finished run with (`regime.txt`, `done`), and a recorded run's
groups (`rollouts.jsonl`: their prompts' and completions' token ids, what the capacity model's fit reads); a sweep
script pointed at the unpacked folder reads every finished run back instead of running it:

    python benchmarks/archive_runs.py benchmarks/runs/off_policy docs/runs/off_policy.tar.xz
    mkdir -p benchmarks/runs && tar -xJf docs/runs/off_policy.tar.xz -C benchmarks/runs
    python benchmarks/off_policy.py --algorithms dpo ppo rloo   # reads the 81 runs back: the tables, the plots
"""
import io
import json
import os
import sys
import tarfile

MARKERS = ("regime.txt", "done", "drop_bias.json", "by_calls.json")  # what fully_async.py and capacity.py read to
# tell a finished run; drop_bias.py's and staleness_by_calls.py's figures of a run (from its groups and its saved
# policy, neither kept)
SAMPLES_KEPT = 2
ROLLOUT_KEYS = ("index", "prompt", "responses", "fate")  # of a --record_rollouts run: what capacity.py's fit reads


def short(value):
    """A float to 9 significant digits (the figures print 3 to 5; float64's 17 would triple the archive)."""
    return float(f"{value:.9g}") if isinstance(value, float) else value


def pack(runs_dir: str, archive: str) -> int:
    """Write `archive` (.tar.xz) with `<sweep>/<run>/metrics.jsonl` for every run folder under `runs_dir`; returns
    the number of runs."""
    sweep = os.path.basename(os.path.normpath(runs_dir))
    runs = sorted(name for name in os.listdir(runs_dir)
                  if os.path.exists(os.path.join(runs_dir, name, "metrics.jsonl")))
    if not runs:
        sys.exit(f"{runs_dir}: no run folder with a metrics.jsonl in it")
    os.makedirs(os.path.dirname(os.path.abspath(archive)), exist_ok=True)
    with tarfile.open(archive, "w:xz") as tar:
        for name in runs:
            records = [json.loads(line) for line in open(os.path.join(runs_dir, name, "metrics.jsonl"))]
            last = max((i for i, r in enumerate(records) if "eval/samples" in r), default=None)
            text = "".join(json.dumps({k: v[:SAMPLES_KEPT] if k == "eval/samples" else short(v) for k, v in r.items()
                                       if k != "eval/samples" or i == last}) + "\n" for i, r in enumerate(records))
            data = text.encode()
            files = {"metrics.jsonl": data, **{marker: open(os.path.join(runs_dir, name, marker), "rb").read()
                                                for marker in MARKERS if os.path.exists(os.path.join(runs_dir, name,
                                                                                                     marker))}}
            rollouts = os.path.join(runs_dir, name, "rollouts.jsonl")
            if os.path.exists(rollouts):  # (the groups' token ids, without their log-probs and spans)
                files["rollouts.jsonl"] = "".join(json.dumps({k: g[k] for k in ROLLOUT_KEYS}) + "\n" for g in map(
                    json.loads, open(rollouts))).encode()
            for filename, content in files.items():
                info = tarfile.TarInfo(f"{sweep}/{name}/{filename}")
                info.size, info.mtime = len(content), 0  # (the same runs give the same archive)
                tar.addfile(info, io.BytesIO(content))
    return len(runs)


if __name__ == "__main__":
    if len(sys.argv) != 3 or not sys.argv[2].endswith(".tar.xz"):
        sys.exit("usage: python benchmarks/archive_runs.py RUNS_DIR ARCHIVE.tar.xz")
    count = pack(sys.argv[1], sys.argv[2])
    print(f"{count} runs packed into {sys.argv[2]} ({os.path.getsize(sys.argv[2]) / 1e3:.0f} kB)")
