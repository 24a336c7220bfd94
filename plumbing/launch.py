"""Running a script: its flags parsed (`--model tiny` with its own defaults), the run started
(its name agreed by the learner processes, the metrics sink), and a clean exit on every path: what main()
puts on `cleanup` is undone, a failed generator (exit 1) or Ctrl-C (130) told in one line, SIGTERM
saving a checkpoint (--save_every)."""
import contextlib
import faulthandler
import functools
import gc
import os
import signal
import sys
from typing import Callable, Optional

import torch.distributed as dist
import transformers
import tyro
from tqdm import tqdm

from plumbing import checkpoint, core, metrics
from plumbing.generator_io import GeneratorError


def parse_args(args_class, tiny_defaults: dict, preset_defaults: Optional[dict] = None):
    """tyro's parse of Args; `--model tiny`, and a preset in `preset_defaults` ({name: defaults}),
    have their own defaults (flags override them). Given twice, the last --model names them, as it is
    the one tyro keeps (a benchmark's `--model tiny` followed by a user's `--model rho-1b`)."""
    metrics.startup_mark("imports")
    argv, presets = sys.argv[1:], {"tiny": tiny_defaults, **(preset_defaults or {})}
    models = [a.split("=", 1)[1] if "=" in a else argv[i + 1] if i + 1 < len(argv) else None
              for i, a in enumerate(argv) if a == "--model" or a.startswith("--model=")]
    model = models[-1] if models else None
    defaults = args_class(model=model, **presets[model]) if model in presets else args_class()
    return tyro.cli(args_class, default=defaults)


def run(main: Callable, args) -> None:
    """main(args, cleanup), with what main puts on `cleanup` undone on every path, and a failed
    generator (exit 1) or Ctrl-C (130) told in one line, not a traceback."""
    metrics.startup_mark("flags and world")
    import datasets  # (here: a spawned generator imports this module, and needs no datasets)

    transformers.utils.logging.disable_progress_bar()  # the console shows the run's own lines
    datasets.disable_progress_bars()
    signal.signal(signal.SIGTERM, functools.partial(on_sigterm, args.save_every))
    with contextlib.suppress(AttributeError, OSError, ValueError):  # (a stderr with no file: run in-process)
        # `kill -USR2 <pid>`: every thread's stack on stderr, for a run that hangs (it goes on running)
        faulthandler.register(signal.SIGUSR2, file=sys.__stderr__, all_threads=True)
    code, message = 0, ""
    try:
        with contextlib.ExitStack() as cleanup:
            try:
                main(args, cleanup)
            except GeneratorError as error:  # (every rank has it: Generator.collect shares it)
                message = f"error: {error}"
                if core.shares_gpu0():
                    message += ("\n(the learner shares GPU 0 with vLLM: lower "
                                "--vllm_gpu_memory_utilization)")
                if args.rank == 0 and not args.verbose:
                    message += f"\nvLLM's log: {args.output_dir}/generator.log"
                code = 1
            except KeyboardInterrupt:
                tqdm.write("interrupted: shutting down the generator", file=sys.stderr)
                code = 130
            except RuntimeError as error:  # a collective whose peer process exited (another node's rank stopped)
                if not (dist.is_initialized() and any(lost in str(error) for lost in PEER_LOST)):
                    raise
                message = (f"error: another learner process stopped (its own error is on its node's console), and "
                           f"this one lost its connection to it: {str(error).splitlines()[0][:300]}")
                code = 1
        if message:  # after the clean-up (the progress bar closed): the last lines the user reads
            print(message, file=sys.stderr, flush=True)
    finally:  # on every path, a flag's SystemExit and out-of-memory errors included
        if dist.is_initialized():  # once DDP/FSDP state is freed (else gloo may abort the exit)
            gc.collect()
            dist.destroy_process_group()
    gc.freeze()  # the run is over: the interpreter's exit need not scan every object for garbage (a second of
    # a CPU run's end: the models', torch's and transformers' objects; atexit still runs)
    if code:
        raise SystemExit(code)


# How gloo reports a collective whose peer process has exited (torch 2.x)
PEER_LOST = ("Connection closed by peer", "Connection reset by peer")


def on_sigterm(save_every: int, *_) -> None:
    """SIGTERM, a scheduler's notice: with --save_every, a flag (a checkpoint at the round's end, then
    exit: checkpoint.save); without, exit now."""
    if save_every:
        checkpoint.TERM.set()
    else:
        sys.exit(128 + signal.SIGTERM)


def start_run(args, cleanup: contextlib.ExitStack, may_differ: set):
    """The run's name and folder, rank 0's on every rank (their clocks may straddle a second), and its metrics
    sink (a resumed run's, once its checkpoint is found to be of this run: flags outside `may_differ` equal).
    Call it once the learner's process group is up (core.learner_device). Returns metrics.jsonl (rank 0; None
    elsewhere)."""
    metrics.startup_mark("data")
    if args.world_size > 1:
        box = [(args.run_name, args.output_dir)]
        dist.broadcast_object_list(box, src=0)
        args.run_name, args.output_dir = box[0]
    wandb_id = checkpoint.check_same_run(args, may_differ) if args.resume_from else None
    metrics_file = metrics.open_metrics(args, wandb_id)
    cleanup.callback(metrics.close_metrics, metrics_file, args.track)
    if args.rank == 0:  # (a streaming run, fully_async_grpo.py, has steps but no rounds)
        rounds = (f" in {args.num_rounds} rounds of {args.batch_size * args.num_mini_batches} prompts x "
                  f"{args.num_samples} samples" if hasattr(args, "num_rounds") else "")
        print(f"run {args.run_name}: {args.num_steps} optimizer steps{rounds}; metrics in "
              f"{args.output_dir}/metrics.jsonl", flush=True)
    if args.world_hash and args.rank == 0:  # (--model tiny) the world every figure of the run comes from
        print(f"world {args.tiny_dir} ({args.world_hash[:12]})", flush=True)
    if args.world_hash and not args.resume_from:  # (a resumed run's metrics begin with its world's: the same)
        metrics.log({"world": os.path.basename(os.path.normpath(args.tiny_dir)), "world_hash": args.world_hash},
                    metrics_file, track=False)
    return metrics_file
