"""Why does Online DPO tolerate stale data? async_dpo.py with its per-pair loss replaced by one of two variants, each
taking away one candidate reason, so that benchmarks/off_policy.py can set them beside DPO and Best-of-2 SFT:

  no_reference   -log sigmoid(beta * (log pi(y+) - log pi(y-))): the contrastive form and the sigmoid without the
                 reference anchor (nothing ties the policy to the SFT model)
  linear         -beta * ((log pi(y+) - log ref(y+)) - (log pi(y-) - log ref(y-))): the contrastive form and the
                 anchor without the sigmoid, so a pair's weight never saturates as its margin grows

Everything else (the schedule, the pairs, the ties left out, the evaluation) is async_dpo.py's own: the variant is a
fork of one function, the way a researcher would try an idea.

    python benchmarks/dpo_variants.py --variant linear --model tiny      # any async_dpo.py flags beside it
"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import async_dpo  # noqa: E402
from plumbing import launch  # noqa: E402


def no_reference_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float) -> torch.Tensor:
    """DPO's loss with the reference's log-probs left out."""
    return -F.logsigmoid(beta * (chosen_logps - rejected_logps))


def linear_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float) -> torch.Tensor:
    """DPO's margin without the sigmoid: its gradient is DPO's at a zero margin (times 2), at any margin."""
    return -beta * ((chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps))


VARIANTS = {"no_reference": no_reference_loss, "linear": linear_loss}


def pop_variant(argv: list[str]) -> str:
    """Take `--variant NAME` out of the command line (the rest is async_dpo.py's)."""
    if "--variant" not in argv or argv.index("--variant") + 1 >= len(argv):
        sys.exit(f"--variant is required: one of {', '.join(VARIANTS)}")
    at = argv.index("--variant")
    name = argv[at + 1]
    del argv[at: at + 2]
    if name not in VARIANTS:
        sys.exit(f"--variant {name}: unknown; one of {', '.join(VARIANTS)}")
    return name


if __name__ == "__main__":
    async_dpo.dpo_loss = VARIANTS[pop_variant(sys.argv)]  # (dpo_update looks the loss up at every step)
    args = launch.parse_args(async_dpo.Args, async_dpo.TINY_DEFAULTS, async_dpo.PRESET_DEFAULTS)
    if args.loss != "dpo":
        sys.exit(f"--loss {args.loss}: a DPO variant replaces DPO's loss; leave --loss at dpo")
    launch.run(async_dpo.main, async_dpo.resolve_args(args))
