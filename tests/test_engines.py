"""fully_async_grpo.py with several vLLM engines (--num_generators) and engines on two nodes (--generator_nodes):
the shared admission record's compare-and-set under racing processes, the staleness bound and the group accounting
with two real engines (pace and head, draining and in flight), the weights reaching the second node's engine exactly,
and the faults: an engine killed on either node, Ctrl-C, a G that cannot be served."""
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import REPO, run_script
from test_failures import STOPS_WITHIN, assert_all_gone, wait_for_training
from test_fully_async import start_stream, stopped, stream_flags, stream_metrics

import fully_async_grpo as fa
from benchmarks import token_versions
from plumbing import transport

FOUR_STEPS = ("--total_episodes", "256")  # 4 steps of 16 groups of 4


def claim_and_release(address: tuple, engine: int, loaded: int, rounds: int, out) -> None:
    """One fake engine: `rounds` times, claim a group under version `loaded` and release it; report the indices and
    places it got."""
    go = dict(max_staleness=1000, groups_per_step=4, stale_policy="pace", max_in_flight=10**6, inflight_updates=False,
              engine_room=10**6, first_group=0, missing=[], next_index=0)
    stream = fa.Stream(None, [], None, engine, transport.connect_record(*address), go=go, loaded=loaded)
    got = []
    for _ in range(rounds):
        group = fa.claim_group(stream)
        got.append((group, fa.release_group(stream, group, loaded)))
    out.put(got)


@pytest.mark.slow
def test_the_record_never_gives_a_group_twice_under_racing_engines():
    """Three processes claim and release 200 groups each on one real store as fast as they can: every index from 0 to
    599 is claimed exactly once, every finishing place once, and the record ends with nothing running."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    address = ("127.0.0.1", server.port, "race/")
    record = dist.PrefixStore("race/", server)
    fa.open_admission(record, 0, fa.Args(rank=0))
    ctx = multiprocessing.get_context("fork")  # (processes of this test alone: a copy of this one starts at once)
    out = ctx.Queue()
    workers = [ctx.Process(target=claim_and_release, args=(address, engine, engine, 200, out)) for engine in range(3)]
    for worker in workers:
        worker.start()
    got = [pair for _ in workers for pair in out.get(timeout=120)]
    for worker in workers:
        worker.join(timeout=30)
    assert sorted(group for group, _ in got) == list(range(600))
    assert sorted(place for _, place in got) == list(range(600))
    state = json.loads(record.get("admission"))
    assert state["next"] == 600 and state["finished"] == 600 and state["running"] == {}


def test_a_claim_that_read_admission_open_fails_once_it_is_closed():
    """Admission is closed in the record itself, by the same compare-and-set as every claim: an engine that read the
    record open and claims after rank 0 closed it and counted the groups left fails and admits nothing (with
    `closed` beside the record, such a late claim landed after the end-of-run audit and escaped it)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    record = dist.PrefixStore("late/", server)
    fa.open_admission(record, 0, fa.Args(rank=0))
    go = dict(max_staleness=2, groups_per_step=4, stale_policy="pace", max_in_flight=12, inflight_updates=False,
              engine_room=12, first_group=0, missing=[], next_index=0)
    stream = fa.Stream(None, [], None, 0, record, go=go)
    raw, state = transport.read_record(record)  # the engine reads the record: open
    assert fa.bound_allows(stream, state)
    assert transport.close_admission(record, [])["next"] == 0  # rank 0 closes it: no group was admitted
    state.update(next=1, running={"0": 1})
    assert not transport.write_record(record, raw, state)  # the engine's claim, on what it read: refused
    assert fa.claim_group(stream) is None and transport.read_record(record)[1]["next"] == 0


def share_a_slot(port: int, rank: int, out) -> None:
    """One of four gloo ranks, two a node, each node's first a leader: the leaders' group and one slot shared."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    args = SimpleNamespace(generator_nodes=2, world_size=4, rank=rank)
    leads = rank in (0, 2)
    leaders = transport.leaders_group(leads, args)
    slots = torch.full((3, 4), float(rank)) if leads else None
    transport.share_slots(slots, leaders, 1)
    out.put((rank, leaders is None, None if slots is None else slots[:, 0].tolist()))
    dist.destroy_process_group()


def test_the_leaders_group_on_four_ranks_two_nodes():
    """Four ranks on two generator nodes, two learners a node: the leaders (ranks 0 and 2) share rank 0's slot, the
    other ranks take no part (torch hands a rank outside a new group a placeholder no collective accepts, which
    every node with two learners passed to the broadcast: a crash at start)."""
    ctx = multiprocessing.get_context("fork")  # (as above: no import of this file in each rank)
    out, port = ctx.Queue(), free_port()
    ranks = [ctx.Process(target=share_a_slot, args=(port, rank, out)) for rank in range(4)]
    for rank in ranks:
        rank.start()
    got = sorted(out.get(timeout=120) for _ in ranks)
    for rank in ranks:
        rank.join(timeout=30)
    assert got == [(0, False, [0.0, 0.0, 0.0]), (1, True, None), (2, False, [2.0, 0.0, 2.0]), (3, True, None)]


def audit(out) -> list:
    """Every group admitted (rollouts.jsonl: trained on, discarded, or in flight at the end) once: the indices
    0 .. n - 1 each once, none lost, none twice; as many trained on and discarded as the steps counted."""
    groups = [json.loads(line) for line in open(out / "rollouts.jsonl")]
    assert sorted(g["index"] for g in groups) == list(range(len(groups))), "a group lost or taken twice"
    steps, _ = stream_metrics(out)
    taken = [g for g in groups if g["fate"] != "in flight at the end"]
    assert len(taken) == sum(r["rollouts/accepted"] + r["rollouts/discarded"] for r in steps)
    return taken


@pytest.mark.parametrize("policy, inflight", [("pace", True), ("head", True), ("drop", False)])
@pytest.mark.slow
def test_two_engines_keep_the_bound_and_account_for_every_group(chains_dir, tmp_path, policy, inflight):
    """G = 2, k = 2 (64 groups at B = 16 a step draining, 32 at B = 4 in flight): both engines sample; every group
    index is sampled once and either trained on or discarded once (none lost, none twice); under `pace` no group trains
    more than 2 versions after its oldest token was sampled, in flight too; under `head` only each engine's lead over
    the learner is bounded (with one engine, draining, `head` is `pace`; with two, a group admitted by the engine with
    the older version may arrive staler); `drop`, with room for 4 batches, discards what arrives staler and trains
    on nothing staler. (`pace` draining with two engines is the two-node test's run below.)"""
    # (in flight: B = 4 groups a step, 8 steps, so that the learner's steps are short and versions arrive while
    # completions sample, as in test_fully_async.py; draining: B = 16, 4 steps)
    flags = ["--inflight_updates", "--batch_size", "16", "--per_device_train_batch_size", "16", "--total_episodes",
             "128"] if inflight else [*FOUR_STEPS, *(["--max_in_flight", "64"] if policy == "drop" else [])]
    result = run_script(*stream_flags(chains_dir, tmp_path, "--num_generators", "2", "--record_rollouts",
                                      "--stale_policy", policy, *flags), script="fully_async_grpo.py")
    assert result.returncode == 0, result.stderr[-3000:]
    groups, total = audit(tmp_path), 32 if inflight else 64
    trained = [g for g in groups if g["fate"] == "trained"]
    assert len(trained) == total and (policy == "drop" or len(groups) == total)
    assert {g["engine"] for g in groups} == {0, 1}
    steps, _ = stream_metrics(tmp_path)
    assert all(r["staleness/max"] <= 2 for r in steps) or policy == "head"
    assert {"engine0/groups", "engine1/groups", "engine1/idle_fraction"} <= set(steps[-1])
    assert steps[-1]["engine0/groups"] + steps[-1]["engine1/groups"] == len(groups)
    assert policy != "drop" or steps[-1]["rollouts/discarded_total"] > 0
    if inflight:  # (versions loaded mid-completion: the bound counts from each group's oldest token)
        assert max(r["inflight/multi_version_fraction"] for r in steps) > 0


def test_k_zero_with_two_engines_is_on_policy_and_one_killed_stops_the_run(chains_dir, tmp_path):
    """G = 2, k = 0: every group trains on the version being trained (staleness exactly 0), as with one engine, and
    each engine's idle time counts the learner's training. Then one of the two engines is killed: the learner stops
    within seconds with its error, and nothing is left."""
    process = start_stream(chains_dir, tmp_path, "--max_staleness", "0", "--num_generators", "2",
                           "--total_episodes", "100000")
    children = wait_for_training(process, str(tmp_path), steps=3, step_metric="staleness/mean")
    engines = [c for c in children if "multiprocessing.spawn" in " ".join(c.cmdline())]
    assert len(engines) == 2
    engines[1].kill()
    stderr = stopped(process, 1, children)
    assert "exited unexpectedly (exit code -9)" in stderr and "of engine" in stderr, stderr[-3000:]
    steps, _ = stream_metrics(tmp_path)
    assert all(r["staleness/max"] == 0 for r in steps)
    assert all(abs(r["is/weight_mean"] - 1) < 1e-5 and abs(r["policy/ratio_mean"] - 1) < 1e-5 for r in steps)
    assert all(r["lag/kl"] < 1e-8 and r["lag/kl_token"] < 1e-8 for r in steps)  # (the lag, per completion and token)
    # (k = 0: each engine waits while the learner trains, and its idle time counts that wait, the step just trained
    # too: every engine writes its idle seconds in the record, the stretch under way included, every 0.2 s at most;
    # taken from its last group, it missed the last step's training)
    for r in steps[1:]:
        trained = sum(q["time/training"] for q in steps if q["step"] <= r["step"])
        for e in (0, 1):
            assert r[f"engine{e}/idle_fraction"] * r["time/elapsed"] > trained - 0.5, (e, r, trained)


@pytest.mark.slow
def test_an_engine_killed_at_k_two_stops_the_run_within_a_step(chains_dir, tmp_path):
    """G = 2, k = 2: one engine is killed while the other's groups keep the shared results queue busy; the learner
    notices at its next message, within the step under way (it looked only once the queue had been empty 0.5 s:
    with room for k + 1 steps of groups, up to three steps later)."""
    process = start_stream(chains_dir, tmp_path, "--max_staleness", "2", "--num_generators", "2",
                           "--total_episodes", "100000")
    children = wait_for_training(process, str(tmp_path), steps=2, step_metric="staleness/mean")
    engines = [c for c in children if "multiprocessing.spawn" in " ".join(c.cmdline())]
    logged = len(stream_metrics(tmp_path)[0])
    engines[1].kill()
    stderr = stopped(process, 1, children)
    assert "of engine 1 exited unexpectedly (exit code -9)" in stderr, stderr[-3000:]
    assert len(stream_metrics(tmp_path)[0]) - logged <= 1


@pytest.mark.slow
def test_ctrl_c_stops_two_engines(chains_dir, tmp_path):
    process = start_stream(chains_dir, tmp_path, "--max_staleness", "2", "--num_generators", "2",
                           "--total_episodes", "100000")
    children = wait_for_training(process, str(tmp_path), step_metric="staleness/mean")
    os.kill(process.pid, signal.SIGUSR2)  # where a hung run is: every thread's stack on stderr, and it runs on
    time.sleep(1)
    os.killpg(process.pid, signal.SIGINT)  # what a terminal does: SIGINT to the whole foreground group
    stderr = stopped(process, 130, children)
    assert "interrupted" in stderr and "most recent call first" in stderr and "in main" in stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_two_nodes(chains_dir: str, out, learners: int, *flags: str) -> list:
    """Two torchrun launches on this machine, --nnodes 2, `learners` learners each, each node hosting one engine: a
    job of two nodes as a cluster runs it (their own process groups: a test signals each)."""
    port, nodes = free_port(), []
    for node in (0, 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", str(learners),
                   "--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port),
                   os.path.join(REPO, "fully_async_grpo.py"),
                   *stream_flags(chains_dir, out, "--generator_nodes", "2", "--per_device_train_batch_size",
                                 str(64 // (2 * learners)), *flags)]
        nodes.append(subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True))
    return nodes


@pytest.mark.slow
def test_two_nodes_weights_reach_the_second_nodes_engine_exactly(chains_dir, tmp_path):
    """Two nodes, two learners and one engine each, k = 2, pace: each new version reaches node 1's slots over
    torch.distributed (gloo here, between the nodes' leaders only) bit for bit: every token either engine sampled
    has its own version's log-prob (the audit of benchmarks/token_versions.py), mislabelled by one version it does
    not; the bound holds across nodes, and every group is accounted for."""
    nodes = start_two_nodes(chains_dir, tmp_path, 2, *FOUR_STEPS, "--record_rollouts")
    outputs = [node.communicate(timeout=900) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    groups = audit(tmp_path)
    assert {g["engine"] for g in groups} == {0, 1} and len(groups) == 64
    steps, _ = stream_metrics(tmp_path)
    assert all(r["staleness/max"] <= 2 for r in steps)
    recorded = [json.loads(line) for line in open(tmp_path / "rollouts.jsonl")]  # (those in flight at the end too)
    assert max(s[0][0] for g in recorded if g["engine"] == 1 for s in g["spans"]) >= 1  # (node 1 loaded a version)
    gaps = token_versions.token_gaps(str(tmp_path))
    assert len(gaps["engine1"]) > 100 and gaps["engine1"].max() < token_versions.TOLERANCE
    assert gaps["engine0"].max() < token_versions.TOLERANCE
    mislabelled = token_versions.token_gaps(str(tmp_path), mislabel=1)
    assert (mislabelled["engine1"] > token_versions.TOLERANCE).float().mean() > 0.2


@pytest.mark.slow
def test_an_engine_killed_on_the_second_node_stops_both(chains_dir, tmp_path):
    """Node 1's engine dies: both nodes exit within seconds, one of them with the engine's error and the other with
    one line (never a traceback from inside torch), and nothing either started is left."""
    import psutil

    nodes = start_two_nodes(chains_dir, tmp_path, 1, "--total_episodes", "100000")
    deadline = time.time() + 600
    while open(tmp_path / "metrics.jsonl").read().count('"staleness/mean"') < 2 if (
            tmp_path / "metrics.jsonl").exists() else True:
        assert time.time() < deadline and all(node.poll() is None for node in nodes)
        time.sleep(0.5)
    trees = [psutil.Process(node.pid).children(recursive=True) for node in nodes]
    engine = next(c for c in trees[1] if "multiprocessing.spawn" in " ".join(c.cmdline()))
    engine.kill()
    killed_at = time.time()
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert time.time() - killed_at < STOPS_WITHIN
    assert all(node.returncode != 0 for node in nodes)
    stderr = outputs[0][1] + outputs[1][1]
    assert "of engine 1 exited unexpectedly (exit code -9)" in stderr, stderr[-3000:]
    assert "[rank0]: Traceback" not in stderr and "[rank1]: Traceback" not in stderr, stderr[-3000:]
    assert_all_gone([p for tree in trees for p in tree])
