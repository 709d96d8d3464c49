"""
Write our checkpoint as a transformers GPT-2 folder, loaded as `gpt2` is: GPT2LMHeadModel's weights (the
vocabulary's padding rows left out), GPT-2's tokenizer. State dict in, state dict out (support/hf_interop.py).

Usage:
    python export_hf.py log/ckpt_019073.pt gpt2_ours   # a checkpoint, or a run's folder (its newest)
    python export_hf.py log gpt2_ours --dry-run        # every check the export makes; nothing is written
"""

import os
import signal
import sys

if __name__ == "__main__":  # Ctrl-C while torch loads (seconds): one line, not a traceback from inside an import
    signal.signal(signal.SIGINT, lambda signum, frame: (print("interrupted", file=sys.stderr), os._exit(130)))


from support.cli import ArgumentParser, UserError, run_cli
from support.hf_interop import check_export_target, save_hf_gpt2
from support.model_files import find_model
from support.shards import GPT2_VOCAB


def main(argv=None):
    p = ArgumentParser(prog="export_hf.py", description=__doc__)
    p.add_argument("ckpt", metavar="CKPT", help="our checkpoint, or a run's folder (its newest checkpoint)")
    p.add_argument("out_dir", metavar="DIR", help="the folder to write: new, empty or an earlier export")
    p.add_argument("--dry-run", action="store_true", help="make the export's checks, then exit: nothing is written")
    args = p.parse_args(argv)
    kind, path, ckpt = find_model(args.ckpt)  # mapped: the weights are read once, the optimizer's state never
    if kind != "checkpoint":
        raise UserError(f"{args.ckpt} is a transformers model already: export_hf.py exports our checkpoints (*.pt)")
    if args.dry_run:
        check_export_target(args.out_dir)  # the export's own check: its folder is made where it writes, and removed
        print(f"dry run: {path} can be exported to {args.out_dir}; nothing was written")
        return 0
    earlier = os.path.isdir(args.out_dir) and os.listdir(args.out_dir)  # an earlier export: others are refused
    origin = dict(exported_from=os.path.abspath(path), exported_step=ckpt["step"])  # in its config.json
    save_hf_gpt2(ckpt["model_config"], ckpt["model"], args.out_dir, f"checkpoint {path}", **origin)
    padding = ckpt["model_config"]["vocab_size"] - GPT2_VOCAB
    rows = f"; its {padding} padding rows of the vocabulary left out" if padding else ""
    done = "replaced the earlier export in" if earlier else "wrote a transformers GPT-2 directory to"
    print(f"{done} {args.out_dir}: the model of {path} (step {ckpt['step']}) and GPT-2's tokenizer{rows}")
    return 0


if __name__ == "__main__":
    run_cli(main, interrupted="interrupted: nothing was exported; run the command again")
