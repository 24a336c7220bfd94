"""Every script logs when each phase of a round starts and ends (`timeline/*`), and benchmarks/timeline.py draws
them: the generator's and the learner's lanes, an asynchronous and a synchronous run on one time axis."""
import json
import os

from conftest import run_script

GENERATOR, LEARNER = ("weight_load", "generation"), ("learner_wait", "weight_sync", "training")


def test_timelines_are_ordered_and_drawn(tmp_path):
    plot = tmp_path / "timeline.png"
    result = run_script("--run", "--runs_dir", str(tmp_path), "--output", str(plot),
                        script=os.path.join("benchmarks", "timeline.py"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert plot.stat().st_size > 10000
    for script, asynchronous in (("async_dpo.py", True), ("sync_baseline.py", False)):
        records = [json.loads(line) for line in open(tmp_path / script / "metrics.jsonl")]
        rounds = [r for r in records if "timeline/training_start" in r]
        assert [r["step"] for r in rounds] == list(range(1, 11))
        for r in rounds:
            span = {phase: (r[f"timeline/{phase}_start"], r[f"timeline/{phase}_end"]) for phase in GENERATOR + LEARNER}
            assert all(0 <= start <= end for start, end in span.values()), span
            assert span["weight_load"][1] <= span["generation"][0]  # the generator loads, then samples
            assert span["weight_sync"][1] <= span["training"][0] and span["learner_wait"][1] <= span["training"][0]
            # the async learner takes the batch, then hands over its weights; the sync one hands them over first
            assert (span["learner_wait"][1] <= span["weight_sync"][0]) == asynchronous
        for previous, current in zip(rounds, rounds[1:]):
            # The next batch's generation starts while this one trains (async), or only after it (sync)
            overlaps = current["timeline/generation_start"] < previous["timeline/training_end"]
            assert overlaps == asynchronous, (script, previous["step"])
        evaluation = [r for r in records if "timeline/evaluation_start" in r]
        assert evaluation and all(r["timeline/eval_generation_start"] <= r["timeline/eval_generation_end"] <=
                                  r["timeline/evaluation_start"] <= r["timeline/evaluation_end"] for r in evaluation)
