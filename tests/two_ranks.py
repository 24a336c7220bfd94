"""Programs that two torchrun learner ranks run, for tests of what the ranks must agree on (test_failures.py,
test_resume.py): `python -m torch.distributed.run --standalone --nproc_per_node 2 tests/two_ranks.py PROGRAM DIR`.
Each prints what each rank did; the tests read it."""
import contextlib
import gc
import os
import sys
import tempfile
import time
from dataclasses import dataclass

STARTING_ENVIRONMENT = dict(os.environ)  # as torchrun made it, before an import adds its own (COLUMNS, LINES)
gc.disable()  # while the imports below run (~1 s less a process on one core: their objects are no garbage)
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from async_dpo import collect, submit  # noqa: E402
from plumbing import checkpoint, core, launch  # noqa: E402
from plumbing.generator_io import Generator  # noqa: E402

gc.enable()


def sigterm_during_a_save(folder: str) -> None:
    """SIGTERM reached rank 0 alone, during a checkpoint: after the save, both ranks stop (one decision)."""
    from async_dpo import Args

    core.init_learner_group(use_cuda=False)
    rank = int(os.environ["RANK"])
    args = Args(output_dir=folder, save_every=1, rank=rank, world_size=2)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    metrics = open(os.path.join(folder, "metrics.jsonl"), "a") if rank == 0 else None
    if rank == 0:
        checkpoint.TERM.set()  # (as the scripts' SIGTERM handler does)
    loop = (1, 1, 0, 0, [])  # round, version, buffer version, last evaluation, pending evaluations
    try:
        checkpoint.save(args, loop, None, model, optimizer, scheduler, torch.zeros(3), metrics)
        print(f"rank {rank} went on after the save", flush=True)
    except SystemExit as stop:
        print(f"rank {rank} stopped with exit code {stop.code}", flush=True)
    torch.distributed.destroy_process_group()


def exits_at_once() -> None:
    """A stand-in for a generator process that has died."""


@dataclass
class RunArgs:
    model: str = "tiny"
    save_every: int = 0
    verbose: bool = True
    output_dir: str = ""
    rank: int = 0
    world_size: int = 1


def generator_dies_during_a_request(folder: str) -> None:
    """Rank 0 notices the dead generator while it sends a request (the one-slot queue is full), while rank 1 goes on
    to the training step's collectives: both must stop with the generator's error, through launch.run."""

    def main(args: RunArgs, cleanup) -> None:
        core.init_learner_group(use_cuda=False)
        generator = Generator()
        if args.rank == 0:
            ctx = mp.get_context("spawn")
            process = ctx.Process(target=exits_at_once)
            process.start()
            process.join()
            requests, results = ctx.Queue(maxsize=1), ctx.Queue(maxsize=1)
            requests.put({"kind": "train"})  # a request nobody will take: the slot stays full
            generator = Generator(process, requests, results, tempfile.mkdtemp())
            cleanup.callback(generator.stop)
        submit(generator, {"kind": "eval"})  # rank 0 notices the death here; rank 1 has nothing to send
        print(f"rank {args.rank} sent its request", flush=True)
        core.reduce_sums({"loss": 1.0}, args.world_size)  # a training step's reduction, on every rank
        collect(generator, args)
        print(f"rank {args.rank} went on without the generator", flush=True)

    start = time.time()
    try:
        launch.run(main, RunArgs(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])))
    finally:
        print(f"rank {os.environ['RANK']} exited after {time.time() - start:.1f} s", flush=True)


def one_run_name(folder: str) -> None:
    """Each rank resolves the flags on its own clock, rank 1 a second after rank 0 (ranks that straddle a second),
    then starts the run: both must log to rank 0's folder, where a checkpoint's shards meet. Each rank writes the
    folder it resolved and the one it logs to in rank{RANK}.txt (the ranks' console lines can interleave)."""
    from async_dpo import MAY_DIFFER_ON_RESUME, Args, resolve_args

    os.chdir(folder)  # the default --output_dir is runs/{run_name}, relative
    if os.environ["RANK"] == "1":
        time.sleep(1.1)
    args = resolve_args(Args(model="pythia-410m"))  # (a preset: resolving it downloads nothing)
    resolved = args.output_dir
    core.init_learner_group(use_cuda=False)
    with contextlib.ExitStack() as cleanup:
        launch.start_run(args, cleanup, MAY_DIFFER_ON_RESUME)
    with open(f"rank{args.rank}.txt", "w") as report:
        report.write(f"{resolved}\n{args.output_dir}\n")
    torch.distributed.destroy_process_group()


def report_environment(folder: str, reports) -> None:
    """A stand-in for a generator process: its set-up (become_generator), then its environment."""
    from plumbing import generator_io

    generator_io.become_generator(None, folder, None)
    reports.put(dict(os.environ))


def generator_environment(folder: str) -> None:
    """Rank 0 starts a generator process as the scripts do (spawned, set up by become_generator); each rank writes
    its own environment and rank 0 the generator's to env{RANK}.json and generator.json."""
    import json

    rank = os.environ["RANK"]
    with open(os.path.join(folder, f"env{rank}.json"), "w") as f:
        json.dump(STARTING_ENVIRONMENT, f)
    if rank == "0":
        ctx = mp.get_context("spawn")
        reports = ctx.Queue()
        process = ctx.Process(target=report_environment, args=(tempfile.mkdtemp(dir=folder), reports))
        process.start()
        with open(os.path.join(folder, "generator.json"), "w") as f:
            json.dump(reports.get(timeout=120), f)
        process.join()


def stops_on(error: BaseException):
    """A main() for launch.run that sets up the learners' process group, then stops with `error`."""

    def main(args: RunArgs, cleanup) -> None:
        core.init_learner_group(use_cuda=False)
        backend = torch.distributed.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        print(f"rank {args.rank} group timeout {backend.options._timeout}", flush=True)
        raise error

    return main


def teardown_on_every_exit(folder: str) -> None:
    """Rank 0 stops with a flag's SystemExit, rank 1 with an out-of-memory error, after the process group is up:
    launch.run must tear the group down on both paths."""
    rank = int(os.environ["RANK"])
    error = SystemExit(2) if rank == 0 else torch.OutOfMemoryError("out of memory (the test's)")
    try:
        launch.run(stops_on(error), RunArgs(rank=rank, world_size=int(os.environ["WORLD_SIZE"])))
    except BaseException as stop:
        print(f"rank {rank} stopped with {type(stop).__name__}", flush=True)
    print(f"rank {rank} process group left up: {torch.distributed.is_initialized()}", flush=True)


if __name__ == "__main__":
    program, folder = sys.argv[1], sys.argv[2]
    sys.argv = sys.argv[:1]
    {"sigterm_during_a_save": sigterm_during_a_save,
     "generator_dies_during_a_request": generator_dies_during_a_request, "one_run_name": one_run_name,
     "generator_environment": generator_environment, "teardown_on_every_exit": teardown_on_every_exit}[program](folder)
