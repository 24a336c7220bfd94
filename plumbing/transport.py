"""The streaming twins' transport (fully_async_grpo.py, agentic_grpo.py): G vLLM engines, a process each, on each
of the first --generator_nodes nodes, and what connects them to the learners. Starting, watching, checking and
stopping a node's engines; their messages (one results queue a node, each message shared with every rank); the store
that holds the admission record (torch.distributed's TCPStore: compare-and-set); the leaders' group that carries each
version to the other nodes' slots; the wait until every engine has adopted a version; closing admission at the end.
What the record holds and the rule it enforces (can_admit, claim and release), the versions and the slots, the
in-flight load are the lesson: they are in the scripts."""
import contextlib
import datetime
import json
import os
import tempfile
import threading
import time
from typing import Callable, Optional

import torch
import torch.multiprocessing as mp

from plumbing import core, generator_io


def check_engines_fit(args) -> None:
    """--num_generators and --generator_nodes against the job (torchrun's nodes), the stream's room and, on GPU,
    the node's GPUs (G engines and the node's learners, one GPU each; only one engine may share GPU 0)."""
    nodes, learners = int(os.getenv("GROUP_WORLD_SIZE", "1")), int(os.getenv("LOCAL_WORLD_SIZE", "1"))
    args.num_engines = args.num_generators * args.generator_nodes
    gpus = torch.cuda.device_count()
    for bad, message in [
        (args.num_generators < 1, f"--num_generators must be at least 1, got {args.num_generators}"),
        (not 1 <= args.generator_nodes <= nodes, f"--generator_nodes {args.generator_nodes}: the job has {nodes} "
         "node(s) (torchrun --nnodes), and node 0 hosts engines"),
        (args.num_engines > args.max_in_flight, f"--num_generators {args.num_generators}: {args.num_engines} "
         f"engines, but the stream holds at most --max_in_flight {args.max_in_flight} groups: an engine would never "
         "sample (fewer engines, or a larger --max_in_flight or --batch_size)"),
        (gpus and args.num_generators > 1 and args.num_generators + learners > gpus,
         f"--num_generators {args.num_generators}: a generator node has {gpus} GPUs, too few for "
         f"{args.num_generators} engines and {learners} learners (torchrun --nproc_per_node), one GPU each"),
    ]:
        if bad:
            core.fail(message)


def check_stream_flags(args) -> None:
    """The streaming twins' own flags (fully_async_grpo.py's and agentic_grpo.py's), checked before anything loads
    (--is_cap against its default, the script's Args')."""
    for bad, message in [
        (args.max_staleness < 0, f"--max_staleness must be 0 (synchronous) or more, got {args.max_staleness}"),
        (args.num_samples < 2, f"--num_samples must be at least 2 (a group needs two), got {args.num_samples}"),
        (args.num_samples > 0 and args.batch_size % args.num_samples,
         f"--batch_size {args.batch_size} (completions a step) must be a whole number of groups of "
         f"--num_samples {args.num_samples}"),
        (args.eval_temperature < 0, f"--eval_temperature must not be negative, got {args.eval_temperature}"),
        (args.cliprange < 0 or args.is_cap < 1, "--cliprange must not be negative, --is_cap not below 1"),
        (args.num_mini_batches < 1 or args.record_every < 1, "--num_mini_batches and --record_every must be positive"),
        (args.proximal == "behaviour" and (args.is_correction not in (None, "none")
                                           or args.is_cap != type(args).is_cap),
         "--is_correction and --is_cap act on w = pi_prox / mu, which is 1 under --proximal behaviour (the clip "
         "to the sampler is its correction): leave them out"),
        (args.proximal == "recompute" and args.is_correction == "none" and args.max_staleness > 0,
         f"--is_correction none with --proximal recompute and --max_staleness {args.max_staleness} trains on data "
         "up to k versions stale with no correction for the sampler at all: use tis, mis or icepop, or --proximal "
         "behaviour"),
        (args.kv_on_update == "keep" and not args.inflight_updates, "--kv_on_update keep needs --inflight_updates "
         "(draining before every load, no KV cache outlives its version)"),
        (args.lora_rank > 0 and args.inflight_updates, "--inflight_updates with --lora_rank: vLLM samples a running "
         "request with the adapter it was admitted under to its end (a new adapter reaches new requests only), so "
         "a load could not reach the running tokens; with LoRA the engine drains before each load"),
    ]:
        if bad:
            core.fail(message)


# --- The engines: started, watched, checked, stopped ---------------------------------------------------------------
def start_engines(generator_main: Callable, engine_kwargs: dict, weight_layout: list, stop_id: int,
                  cores: Optional[list], node: int, args) -> list:
    """Spawn this node's G engines, each running the script's `generator_main` (GPU: engine i on GPU i; CPU:
    --generator_cores of `cores` each), numbered node x G + i: requests one at a time, each its own; their results
    one queue, the node's."""
    run_tmp_dir = tempfile.mkdtemp(prefix="async-rlhf-")
    os.makedirs(args.output_dir, exist_ok=True)  # (another node's: the logs go there)
    logs = [None if args.verbose else os.path.join(args.output_dir, "generator.log" if e == 0 else f"generator{e}.log")
            for e in range(node * args.num_generators, (node + 1) * args.num_generators)]
    generator_io.quiet_resource_tracker(logs[0])  # (before the first queue: its semaphores start the tracker)
    ctx = mp.get_context("spawn")
    results, engines = ctx.Queue(), []  # (the admission bound keeps it within --max_in_flight)
    for i, log_path in enumerate(logs):
        engine = node * args.num_generators + i
        kwargs = dict(engine_kwargs, **({"device_ids": [i]} if torch.cuda.is_available() and i else {}))
        mine = cores[i * args.generator_cores: (i + 1) * args.generator_cores] or [cores[i % len(cores)]] \
            if cores else None
        requests = ctx.Queue()
        process = ctx.Process(target=generator_main, args=(
            kwargs, weight_layout, stop_id, requests, results, mine, run_tmp_dir, log_path))
        process.start()
        engines.append(generator_io.Generator(process, requests, results, run_tmp_dir, log_path, engine=engine))
    return engines


def watch_engines(engines: list, address: tuple) -> threading.Event:
    """A node's leader: a thread per engine that writes its death in the record, where rank 0 sees it while it
    waits on the record (for a load, or for the last groups) rather than on this node's messages. Set the event
    returned before stopping the engines."""
    stopping = threading.Event()

    def watch(engine: generator_io.Generator) -> None:
        engine.process.join()
        if not stopping.is_set():
            with contextlib.suppress(Exception):
                connect_record(*address).set("error", f"the generator process of engine {engine.engine} exited "
                                                      f"unexpectedly (exit code {engine.process.exitcode})")

    for engine in engines:
        threading.Thread(target=watch, args=(engine,), daemon=True).start()
    return stopping


def stop_engines(engines: list, stopping: threading.Event) -> None:
    stopping.set()
    for engine in engines:
        engine.stop()


def check_engines(record, engines: list) -> None:
    """Rank 0, waiting on the record: an engine's error (any node's, written there) or the death of one of its own
    ends the wait."""
    if record.check(["error"]):
        raise generator_io.GeneratorError(record.get("error").decode())
    if (death := generator_io.exited(engines)) is not None:
        raise death


# --- Messages: the learners' to a node's engines, the engines' to every rank ---------------------------------------
def submit(engines: list, request: dict) -> None:
    """Send each of this node's engines a message (a node's leader holds them; the other ranks have none), stamped
    with when it left (this node's clock: the engines measure from it); a dead engine found here is told at the
    next collect."""
    request = dict(request, sent=time.time())
    for engine in engines:
        generator_io.send(engine, request)


def collect(engines: list, args) -> dict:
    """The next message from the stream, the same on every rank. One generator node: rank 0 takes it from its
    engines and broadcasts it. Several: the ranks poll together, each node's leader saying whether it holds one,
    and the first that does broadcasts it (an engine's error, or death, likewise). A group carries how long it
    waited in its node's queue (`queued`, measured on that node: no clock of one node is compared with another's)."""
    if args.generator_nodes == 1:
        message = stamp_queued(generator_io.receive_any(engines)) if args.rank == 0 else None
        if args.world_size > 1:
            box = [message]
            torch.distributed.broadcast_object_list(box, src=0)
            message = box[0]
        return generator_io.raise_error(message, args.rank)
    while True:
        if engines and engines[0].held is None:  # (a node's leader: hold its next message until it is shared)
            engines[0].held = stamp_queued(generator_io.poll(engines))
        holds = [None] * args.world_size
        torch.distributed.all_gather_object(holds, bool(engines and engines[0].held is not None))
        if any(holds):
            source = holds.index(True)
            box = [engines[0].held if args.rank == source else None]
            torch.distributed.broadcast_object_list(box, src=source)
            if args.rank == source:
                engines[0].held = None
            return generator_io.raise_error(box[0], args.rank, source)
        time.sleep(0.005)


def stamp_queued(message):
    if isinstance(message, dict) and message.get("kind") == "group":
        message["queued"] = time.time() - message["finished"]  # (the engine's clock: the same node's)
    return message


# --- The admission record's store -----------------------------------------------------------------------------------
def open_record(args) -> tuple:
    """The store of the admission record, a key-value store of torch.distributed's that every engine and rank 0
    reach: under torchrun the job's own (MASTER_ADDR: every node reaches it), else one rank 0 hosts; the run's name
    its prefix. Returns rank 0's connection (None on the other ranks) and the address the engines connect to."""
    prefix = f"async-rlhf/{args.run_name}/"
    if "MASTER_ADDR" in os.environ:
        address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), prefix)
        return (connect_record(*address) if args.rank == 0 else None), address
    server = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=60))  # (one process: it hosts the store)
    return torch.distributed.PrefixStore(prefix, server), ("127.0.0.1", server.port, prefix)


def connect_record(host: str, port: int, prefix: str):
    """The admission record's store (TCPStore), under the run's prefix."""
    store = torch.distributed.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=60))
    return torch.distributed.PrefixStore(prefix, store)


def read_record(record) -> tuple[bytes, dict]:
    """The record as stored (for the compare-and-set) and as a dict."""
    raw = record.get("admission")
    return raw, json.loads(raw)


def write_record(record, raw: bytes, state: dict) -> bool:
    """Compare-and-set: write `state` if the record is still `raw`; False if another wrote it first."""
    desired = json.dumps(state).encode()
    return record.compare_set("admission", raw, desired) == desired


def close_admission(record, engines: list) -> dict:
    """Rank 0, after the last step: close admission in the record (the same compare-and-set as every claim: no
    claim read the record open and lands after this), then wait until no group runs. Returns the record."""
    while True:
        raw, state = read_record(record)
        if write_record(record, raw, dict(state, closed=True)):
            break
    while (state := read_record(record)[1])["running"]:
        check_engines(record, engines)
        time.sleep(0.05)
    return state


def engine_reports(record, args) -> dict:
    """Rank 0: each engine's loaded version and idle seconds, as it last wrote them in the record (every engine,
    sampling or idle, writes them every few tenths of a second): {engine: (version, idle seconds)}."""
    if record is None:
        return {}
    keys = [f"{what}/{e}" for e in range(args.num_engines) for what in ("loaded", "idle")]
    if not record.check(keys):  # (an engine that has not written yet: none reported)
        return {}
    values = record.multi_get(keys)
    return {e: (int(values[2 * e]), float(values[2 * e + 1])) for e in range(args.num_engines)}


# --- Versions to the other nodes, and their adoption ----------------------------------------------------------------
def leaders_group(hosts_engines: bool, args):
    """The process group of the generator nodes' leaders (rank 0 first), which each new version reaches their
    nodes' slots through (a broadcast: NCCL on GPU, gloo on CPU). Every rank calls it (new_group is collective);
    it returns the group on its members only, None elsewhere and with one generator node (torch returns a
    non-member a placeholder, GroupMember.NON_GROUP_MEMBER, which no collective accepts)."""
    if args.generator_nodes == 1:
        return None
    hosts = [None] * args.world_size
    torch.distributed.all_gather_object(hosts, hosts_engines)
    group = torch.distributed.new_group([rank for rank, yes in enumerate(hosts) if yes])
    return group if hosts_engines else None


def share_slots(slots: Optional[torch.Tensor], leaders, index: Optional[int] = None) -> None:
    """The slots (or slot `index`) from rank 0 to the other generator nodes' leaders (no-op on the other ranks,
    and with one generator node). On GPU the broadcast returns with NCCL's copy queued, not done (later work on
    the same stream waits for it; another process reading the slot by CUDA IPC does not): wait until the data has
    landed, so that no engine is told to load a slot before it holds the version (reviewed from torch's source
    only: no GPU has run it)."""
    if leaders is None:
        return
    shared = slots if index is None else slots[index]
    torch.distributed.broadcast(shared, src=0, group=leaders)
    if shared.is_cuda:
        torch.cuda.current_stream(shared.device).synchronize()


def wait_for_adoption(record, engines: list, held: int, args) -> float:
    """Rank 0 waits until every engine has loaded version `held` or a newer one, before its slot is rewritten (an
    engine reads only the newest version published, and never loads back): the seconds waited. A dead engine would
    never load it: its error, or its death, stops the wait."""
    start, keys = time.time(), [f"loaded/{engine}" for engine in range(args.num_engines)]
    while args.rank == 0 and held >= 0 and min(map(int, record.multi_get(keys))) < held:
        check_engines(record, engines)
        time.sleep(0.002)
    return time.time() - start


# --- A resumed run's admission order; an engine's idle clock, kept in the record -----------------------------------
def still_to_admit(ledger: dict) -> dict:
    """What the generator admits first (a resumed run's): the indices below the last one taken that were not taken
    (a long group still sampling at the checkpoint), then every index after it."""
    last = max(ledger["beyond"], default=ledger["below"] - 1)
    missing = [i for i in range(ledger["below"], last + 1) if i not in ledger["beyond"]]
    return dict(missing=missing, next_index=last + 1)


def group_index(go: dict, position: int) -> int:
    """The index (its prompt, its seed) of the group admitted at this position of the record's count. A fresh run:
    the position. A resumed one first admits the indices its checkpoint's run had admitted and not taken (`missing`),
    then those after the last it took."""
    after = position - go["first_group"]
    missing = go["missing"]
    return missing[after] if after < len(missing) else go["next_index"] + after - len(missing)


def mark_idle(stream, idle: bool) -> None:
    """The generator's idle clock (training under way and nothing to sample): started when it has nothing to do,
    stopped when it samples or evaluates. `stream`: the script's Stream (go, idle, idle_since, reported, record,
    engine)."""
    if stream.go is None:
        return
    if idle and stream.idle_since is None:
        stream.idle_since = time.time()
    elif not idle and stream.idle_since is not None:
        stream.idle, stream.idle_since = stream.idle + time.time() - stream.idle_since, None
    report_idle(stream)


def report_idle(stream) -> None:
    """This engine's idle seconds so far, the running stretch too, written in the record every 0.2 s at most, where
    the learner reads every engine's (an idle engine sends no group to report it by)."""
    if stream.go is not None and time.time() - stream.reported >= 0.2:
        stream.reported = time.time()
        idle = stream.idle + (stream.reported - stream.idle_since if stream.idle_since is not None else 0.0)
        stream.record.set(f"idle/{stream.engine}", str(idle))
