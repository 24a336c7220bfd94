"""sync_baseline.py with transformers' generate in place of vLLM: the paper's "why vLLM" comparison
(`benchmarks/async_vs_sync.py` runs it as `sync-hf`). The same flags, schedule, metrics and output as
sync_baseline.py; under torchrun too:

    python benchmarks/sync_hf.py --model tiny

Only the generator process differs: it builds a transformers model where sync_baseline.py builds a vLLM engine,
loads each new version from the same weight buffer, and samples with `generate` at the temperature alone (no top-k
or top-p, as the learner's log-probs assume), seeded by the request, returning each token's log-prob at that
temperature (as vLLM's generator does). On a GPU it runs where vLLM would (GPU 0); on a CPU it is not given cores
of its own: generation and training take turns, so each gets every core (`--generator_cores 0`).
"""
import os
import sys
import time
import traceback
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sync_baseline  # noqa: E402
from plumbing import generator_io, launch  # noqa: E402


def hf_generator_main(engine_kwargs: dict, weight_layout: list, stop_id: int, requests, results,
                      cores: Optional[list], run_tmp_dir: str, log_path: Optional[str]) -> None:
    """sync_baseline.generator_main's loop (the same messages, the same weight buffer) around transformers."""
    try:
        generator_io.become_generator(cores, run_tmp_dir, log_path)
        from transformers import AutoModelForCausalLM

        generator_io.imports_done()
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        dtype = getattr(torch, engine_kwargs["dtype"])
        model = AutoModelForCausalLM.from_pretrained(engine_kwargs["model"], dtype=dtype).to(device).eval()
        parameters = dict(model.named_parameters())
        results.put(dict(kind="ready"))
        weight_buffer = requests.get()["weight_buffer"]
        loaded_version = 0  # the SFT checkpoint: the learner's version 0
        while (request := requests.get()) is not None:
            load_start = time.time()
            if request["weights_version"] != loaded_version:
                with torch.no_grad():
                    for name, weights in sync_baseline.weights_from_buffer(weight_buffer, weight_layout):
                        parameters[name].copy_(weights)
                loaded_version = request["weights_version"]
            generation_start = time.time()
            responses, logprobs = sample(model, request, stop_id, device)
            results.put(dict({k: v for k, v in request.items() if k != "prompts"},
                             generation_version=loaded_version, responses=responses, logprobs=logprobs,
                             weight_load_start=load_start, generation_start=generation_start,
                             generation_end=time.time()))
    except BaseException:
        results.put(dict(kind="error", traceback=traceback.format_exc()))
        raise SystemExit(1)


@torch.no_grad()
def sample(model, request: dict, stop_id: int, device: torch.device, chunk: int = 16) -> tuple[list, list]:
    """n completions per prompt (prompt-major, as vLLM returns them), each cut after its first stop token, and its
    tokens' log-probs at the temperature (log_softmax(logits / T), as vLLM's processed log-probs)."""
    torch.manual_seed(request["seed"])  # a request's own seed, as vLLM's (a resumed run samples it again)
    responses, logprobs, prompts = [], [], request["prompts"]
    for start in range(0, len(prompts), chunk):
        part = prompts[start: start + chunk]
        width = max(map(len, part))
        ids = torch.tensor([[stop_id] * (width - len(p)) + p for p in part], device=device)  # left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in part], device=device)
        out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=request["temperature"], top_k=0,
                             top_p=1.0, num_return_sequences=request["n"], max_new_tokens=request["max_tokens"],
                             eos_token_id=stop_id, pad_token_id=stop_id, output_scores=True,
                             return_dict_in_generate=True)
        token_logprobs = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        for tokens, scores in zip(out.sequences[:, width:].tolist(), token_logprobs.float().tolist()):
            length = tokens.index(stop_id) + 1 if stop_id in tokens else len(tokens)
            responses.append(tokens[:length])
            logprobs.append(scores[:length])
    return responses, logprobs


if __name__ == "__main__":
    sync_baseline.generator_main = hf_generator_main  # the one change: the generator process's body
    args = launch.parse_args(sync_baseline.Args, sync_baseline.TINY_DEFAULTS, sync_baseline.PRESET_DEFAULTS)
    args.exp_name = "sync_hf" if args.exp_name == "sync_baseline" else args.exp_name
    args = sync_baseline.resolve_args(args)
    args.generator_cores = 0  # (CPU) generation and training take turns on every core
    launch.run(sync_baseline.main, args)
