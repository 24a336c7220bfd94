"""Plumbing shared by every script: code that is the same in each and that a reader does not need in order to
understand asynchronous RLHF. The lesson (Args, the generator loop, the weight hand-off, the schedule, the reward,
the loss, evaluation and the training loop) stays in each script."""
import contextlib
import os
import queue
import shutil
from typing import Optional


# ---------------------------------------------------------------------------------------------------------------
# Talking to the generator process without ever hanging on it
# ---------------------------------------------------------------------------------------------------------------
class GeneratorError(RuntimeError):
    pass


def check_generator(generator) -> None:
    if not generator.is_alive():
        raise GeneratorError(f"the generator process exited unexpectedly (exit code {generator.exitcode})")


def send(requests, request: dict, generator) -> None:
    """Put on the one-slot request queue, without hanging if the generator has died."""
    while True:
        try:
            return requests.put(request, timeout=0.5)
        except queue.Full:
            check_generator(generator)


def receive(results, generator) -> dict:
    """Take from the one-slot result queue, without hanging if the generator has died; re-raise its error."""
    while True:
        try:
            message = results.get(timeout=0.5)
        except queue.Empty:
            if generator.is_alive():
                continue
            try:  # it may have reported its error just before exiting
                message = results.get(timeout=1.0)
            except queue.Empty:
                check_generator(generator)
                continue
        if message["kind"] == "error":
            raise GeneratorError("the generator process failed:\n" + message["traceback"])
        return message


def quiet_resource_tracker(log_path: Optional[str]) -> None:
    """Start multiprocessing's resource tracker (a helper process that the spawned generator shares) with its
    stderr in the generator's log. vLLM's engine creates a multiprocessing Lock; when the generator is killed or
    stopped, the tracker unlinks it at exit and warns of a "leaked semaphore": the generator's business, which a
    user would read on the console as a second failure. Call it before any queue or lock is created."""
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


def stop_generator(generator, requests, results, run_tmp_dir: str) -> None:
    """Stop the generator (politely, then less so) and let this process exit whatever is still queued.
    A multiprocessing queue writes each item to its pipe from a feeder thread, which blocks while the pipe is full
    (64 KiB) and is joined when the process exits: a large evaluation request that the dead generator never read
    would hang the learner forever. `cancel_join_thread()` (the multiprocessing docs' way to exit "without waiting
    to flush enqueued data") drops it instead; nobody is left to read it."""
    with contextlib.suppress(queue.Full, ValueError, OSError):
        requests.put_nowait(None)  # a polite stop, seen if the generator is idle
    generator.join(timeout=2)
    for stop in (generator.terminate, generator.kill):
        if generator.is_alive():
            stop()
            generator.join(timeout=3)
    for pending in (requests, results):
        pending.cancel_join_thread()
        pending.close()
    shutil.rmtree(run_tmp_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------------------
def bos_prefix(tokenizer) -> list[int]:
    """[BOS] for a tokenizer that puts one in front of every text (Llama's, rho-1b's: their SFT models were trained
    with it), else [] (Pythia's). Prompts are tokenised without special tokens, so that no EOS is appended."""
    bos = tokenizer.bos_token_id
    with_special, without = tokenizer("x")["input_ids"], tokenizer("x", add_special_tokens=False)["input_ids"]
    return [bos] if bos is not None and with_special[:1] == [bos] and without[:1] != [bos] else []
