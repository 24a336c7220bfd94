"""Plumbing shared by the scripts: what is the same in each and a reader need not study to
understand asynchronous RLHF. The lesson (Args and its derived sizes, the generator loop, the
weight hand-off, the one-slot queues' schedule, token layout and log-probs, the reward, the loss,
evaluation and the training loop) stays in each script. The modules, each importing only those
above it:

    core           common flags and paths checked, models and data loaded, devices, learner processes,
                   models on the learner (moved, or sharded), collectives and a step's statistics over
                   them, prompt tokens
    chat           chat datasets (a `messages` column) formatted by the policy's chat template
    generator_io   the one-slot queues to the generator process, never hanging on it; shutdown
    reward_models  loading a reward model; scoring with a tokenizer of its own (re-tokenising)
    metrics        metrics.jsonl and wandb, the console's evaluations, timings; the streaming twins' stream,
                   in-flight and episode metrics
    checkpoint     --save_every and --resume_from
    lora           --lora_rank: the adapter added, the reference's wrapper, an adapter handed to vLLM
    launch         parsing the flags, starting the run, a clean exit on every path
    transport      the streaming twins' engines on several nodes: started, watched, stopped; their messages;
                   the admission record's store; the leaders' group that carries versions; adoption; a resumed
                   run's admission order; each engine's idle clock, kept in the record
    audit          the streaming twins' --record_rollouts: the groups trained on, and every version's weights
    tools          agentic_grpo.py's tools in the model's own format: JSON schemas, vLLM's tool parsers (the
                   calculator's syntax registered as one), calls in threads with a timeout, the replies as the
                   chat template's tool turns, and the checks at start (parser, prefix stability); the
                   warning when a policy calls no tool; a slow tool's seconds
"""
