"""--dry-run of the command line's jobs besides training, --sample-from and --export-hf: the checks
each makes before its slow part (the model found and readable, the prompt, the export's folder),
without loading weights, sampling or writing."""

import os

from support.cli import UserError
from support.hf_interop import check_export_target
from support.model_files import model_config_of
from support.sampling import encode_prompt, note_if_samples_stop_early


def dry_run_job(sample_from, export_hf, enc, prompt, max_new_tokens):
    """--dry-run of --sample-from MODEL or --export-hf (CKPT, DIR) (the flags already checked): every
    check the job makes before its slow part, then a line saying so. No weights are loaded, nothing
    is sampled or written. enc: tiktoken's gpt2 (the prompt's; an export writes it beside the weights)."""
    if sample_from:
        config = model_config_of(sample_from)
        tokens = encode_prompt(enc, prompt, config["block_size"])
        note_if_samples_stop_early(len(tokens), max_new_tokens, config["block_size"])
        print(f"dry run: {sample_from}, the prompt and the sampling flags are fine; nothing was sampled")
        return 0
    ckpt_path, out_dir = export_hf
    model_config_of(ckpt_path)  # found and readable
    target = check_export_target(out_dir)
    # where the export writes, as write_dir_atomic does: into a mount point, else beside the folder,
    # in the nearest of its parents that exists
    folder = target if os.path.ismount(target) else os.path.dirname(target)
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    if not os.access(folder, os.W_OK):
        raise UserError(
            f"cannot write the export to {out_dir}: {folder} is not writable; choose a folder you can write to"
        )
    print(f"dry run: {ckpt_path} can be exported to {out_dir}; nothing was written")
    return 0
