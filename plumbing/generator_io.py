"""The learner's side of the one-slot queues to the generator process (rank 0's), which never hang on
a dead generator, the generator process's own set-up, and shutdown with anything queued. What is
requested when, and the broadcast of each result to the other ranks, are in the scripts."""
import contextlib
import gc
import os
import queue
import shutil
import signal
import time
from dataclasses import dataclass
from typing import Optional

import torch

from plumbing import metrics


class GeneratorError(RuntimeError):
    pass


@dataclass
class Generator:
    """The generator process and the one-slot queues to and from it, held by learner rank 0 (the other
    ranks hold an empty one: rank 0 broadcasts to them what it receives, in each script's `collect`)."""
    process: object = None
    requests: object = None
    results: object = None
    tmp_dir: Optional[str] = None  # the generator's temporary files, removed at the end
    log_path: Optional[str] = None  # vLLM's log (None: --verbose, the console)
    error: Optional[GeneratorError] = None  # its death, noticed while sending (told at the next receive)
    engine: Optional[int] = None  # fully_async_grpo.py: its engine's number, when several share one results queue
    held: Optional[dict] = None  # fully_async_grpo.py, several nodes: a message taken, not yet shared with all ranks

    def stop(self) -> None:
        """Stop the generator, and exit whatever is queued: a queue's feeder thread blocks while the
        pipe is full (64 KiB) and is joined at exit; `cancel_join_thread()` (the documented way to
        exit "without waiting to flush enqueued data") drops a request nobody will read. The generator
        is killed: it holds nothing to save (its log is written line by line), and its own exit, the
        interpreter tearing vLLM and torch down, takes seconds (3 s on a CPU) that nobody waits for."""
        if self.process is None:
            return
        quiet_resource_tracker(self.log_path)  # (relaunched there if it died with the generator)
        if self.process.is_alive():  # (it ignores SIGTERM)
            self.process.kill()
        self.process.join(timeout=3)
        for pending in (self.requests, self.results):
            pending.cancel_join_thread()
            pending.close()
        shutil.rmtree(self.tmp_dir, ignore_errors=True)


def send(generator: Generator, request: dict) -> None:
    """Rank 0 puts a request on the one-slot queue, never hanging on a dead generator. A death noticed
    here is kept for the next `receive`, which every rank passes (only rank 0 is here)."""
    if generator.error is None:
        try:
            put(generator.requests, request, generator.process)
        except GeneratorError as error:
            generator.error = error


def receive(generator: Generator):
    """Rank 0 takes the generator's next message, never hanging on a dead generator; its error (or
    death) comes back as a GeneratorError, for the caller to share with the other ranks first."""
    try:
        return generator.error or get(generator.results, generator.process)
    except GeneratorError as error:
        return error


def raise_error(message, rank: int, source: int = 0) -> dict:
    """The message, unless it is the generator's error: that is raised (on the other ranks, saying
    that rank `source`, which received it, stopped). It is noted for the start-up's breakdown."""
    if isinstance(message, BaseException):
        raise message if rank == source else GeneratorError(f"rank {source} stopped: {message}")
    metrics.startup_message(message)
    return message


def receive_any(generators: list):
    """`receive` for several generators sharing one results queue (fully_async_grpo.py's engines): the
    next message any of them sent; the death of any is an error naming its engine."""
    sending_error = next((g.error for g in generators if g.error), None)
    while sending_error is None and (message := poll(generators, timeout=0.5)) is None:
        continue
    return sending_error or message


def poll(generators: list, timeout: float = 0.0):
    """The next message of generators sharing one results queue, waiting up to `timeout` seconds: None when
    nothing has come and every generator lives; an error sent, or the death of one (naming its engine), as
    a GeneratorError. Every call looks for a death first: the others' messages may keep the queue full long
    after one engine died (with G >= 2 and k >= 1, for up to k + 1 steps)."""
    results = generators[0].results
    if (death := exited(generators)) is None:
        try:
            message = results.get(timeout=timeout) if timeout else results.get_nowait()
        except queue.Empty:
            if (death := exited(generators)) is None:
                return None
        else:
            return GeneratorError("the generator process failed:\n" + message["traceback"]) \
                if message["kind"] == "error" else message
    deadline = time.time() + 1.0  # it may have reported its error just before exiting: that says more
    while (left := deadline - time.time()) > 0:
        try:
            message = results.get(timeout=left)
        except queue.Empty:
            break
        if message["kind"] == "error":
            return GeneratorError("the generator process failed:\n" + message["traceback"])
    return death


def exited(generators: list) -> Optional[GeneratorError]:
    """An error naming the first generator that has exited (None: all live)."""
    for g in generators:
        if not g.process.is_alive():
            return GeneratorError(f"the generator process{'' if g.engine is None else f' of engine {g.engine}'} "
                                  f"exited unexpectedly (exit code {g.process.exitcode})")
    return None


def put(requests, request: dict, process) -> None:
    """Put on the one-slot request queue, without hanging if the generator has died."""
    while True:
        try:
            return requests.put(request, timeout=0.5)
        except queue.Full:
            if not process.is_alive():
                raise GeneratorError(f"the generator process exited unexpectedly "
                                     f"(exit code {process.exitcode})")


def get(results, process) -> dict:
    """Take from the result queue, without hanging on a dead generator; re-raise its error."""
    while True:
        try:
            message = results.get(timeout=0.5)
        except queue.Empty:
            if process.is_alive():
                continue
            try:  # it may have reported its error just before exiting
                message = results.get(timeout=1.0)
            except queue.Empty:
                raise GeneratorError(f"the generator process exited unexpectedly (exit code "
                                     f"{process.exitcode})") from None
        if message["kind"] == "error":
            raise GeneratorError("the generator process failed:\n" + message["traceback"])
        return message


def become_generator(cores: Optional[list], run_tmp_dir: str, log_path: Optional[str]) -> None:
    """The generator process: Ctrl-C and SIGTERM go to the learner, death with it (PDEATHSIG),
    vLLM's log to a file, no torchrun variables (they describe the learners), temporary files where
    the learner removes them, and on CPU its own cores (set before vLLM, which ignores changes) and
    no torch.compile."""
    import ctypes
    import tempfile

    # A scheduler signals the process group: the learner decides (it may need an evaluation first)
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
    if log_path:
        log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        for stream in (1, 2):
            os.dup2(log_fd, stream)
    for var in [name for name in os.environ if is_torchrun_variable(name)]:
        os.environ.pop(var)
    os.environ["TMPDIR"] = tempfile.tempdir = run_tmp_dir
    if cores:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
    if not torch.cuda.is_available():  # On a CPU vLLM runs eagerly (enforce_eager) but for one helper of its sampler
        torch._dynamo.config.disable = True  # (the ranks of the sampled tokens' log-probs, an exact count), which
        # torch.compile would build as C++ at the first request, seconds in every new process; eager: the same counts
    # vLLM's import comes next: ~280,000 objects, each 700 of which start a GC pass (on a CPU a third of the
    # import's time); none is garbage, so the collector waits until imports_done
    gc.disable()
    BECAME[0] = time.time()


BECAME = [0.0]  # when this process became the generator: its start-up (`startup_seconds`)


def imports_done() -> float:
    """Once the generator has imported vLLM: every object so far (the modules: they live as long as the process)
    moves to the garbage collector's permanent generation, out of its scans, and the collector, paused for the
    import (become_generator), runs again. vLLM's engine build collects garbage several times, each a scan of every
    object: on a CPU, about half of the tiny world's engine build (the same freeze vLLM applies once the engine is
    built). Returns the time, for the start-up's breakdown."""
    gc.freeze()
    gc.enable()
    return time.time()


def startup_seconds(vllm_imported: float) -> dict:
    """The generator's start-up, for the learner's breakdown (metrics.startup_line): the spawned
    process's start and its imports of the script, vLLM's import, the engine's build."""
    return {"imports": BECAME[0] - metrics.process_started(), "vLLM's import": vllm_imported - BECAME[0],
            "engine": time.time() - vllm_imported}


# What torchrun's agent sets in each learner's environment to describe the learners' job (torch's
# LocalElasticAgent._start_workers): vLLM's own one-process group must see none of it, or it joins the
# learners' rendezvous (TORCHELASTIC_USE_AGENT_STORE: wait on a store server that is not there).
# Left alone: OMP_NUM_THREADS and TORCH_NCCL_ASYNC_ERROR_HANDLING, settings a user may have made
# (torchrun passes theirs on), not facts about the learners.
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def is_torchrun_variable(name: str) -> bool:
    return name in TORCHRUN_VARIABLES or name.startswith("TORCHELASTIC_")


def check_untruncated(sampling) -> None:
    """Refuse sampling parameters (one, or a list) that truncate the distribution: top-p below 1, a top-k, a min-p.
    The sampler's log-probs (mu) would be of the truncated distribution and the learner's of the whole one, so the
    importance ratio pi / mu would compare different supports. No flag sets them: this catches a fork that does."""
    for params in sampling if isinstance(sampling, list) else [sampling]:
        if params.top_p < 1 or params.top_k not in (0, -1) or params.min_p > 0:
            raise ValueError(
                f"sampling truncated (top_p {params.top_p}, top_k {params.top_k}, min_p {params.min_p}): the "
                "sampler's log-probs would be of the truncated distribution, the learner's of the whole one, and "
                "the importance ratio between them would compare different supports. Sample untruncated (adjust "
                "--temperature instead), or truncate the learner's distribution the same way in the loss")


def reset_prefix_cache(engine, preempt_running: bool = False) -> None:
    """Empty vLLM's prefix cache after a weight load, so that no request reuses KV that older weights
    computed. vLLM empties it only when no KV block is in use, and returns False when it did not
    (`preempt_running`: running requests are preempted first, to re-read their prefixes under the
    new weights). A block can outlive its request by a step (a free vLLM defers): with nothing left
    unfinished, step the idle engine once and try again; still held, an error, never stale KV."""
    for _ in range(2):
        if engine.reset_prefix_cache(reset_running_requests=preempt_running):
            return
        if engine.has_unfinished_requests():
            break
        engine.step()
    raise RuntimeError("vLLM did not empty its prefix cache after a weight update (KV blocks still in use"
                       f"{', requests running' if engine.has_unfinished_requests() else ''}): a later request "
                       "would reuse KV cache computed by older weights")


def quiet_resource_tracker(log_path: Optional[str]) -> None:
    """Start multiprocessing's resource tracker with its stderr in the generator's log: it warns of
    vLLM's "leaked semaphore" when the generator is killed, which would read as a second failure. If
    it was killed too (`pkill -f multiprocessing`), it is relaunched here, where its warnings and
    the KeyErrors of the queues' semaphores it never saw registered go to the log as well."""
    if log_path is None:  # --verbose: vLLM's log is on the console, and so is this
        return
    from multiprocessing import resource_tracker

    console, log_fd = os.dup(2), os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.dup2(log_fd, 2)
        resource_tracker.ensure_running()  # it inherits stderr from us now
    finally:
        os.dup2(console, 2)
        os.close(console)
        os.close(log_fd)
