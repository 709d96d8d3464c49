"""The presets of configs/: a run's flags kept in a file, one flag (and its value) a line, named on
the command line as `@configs/laptop.txt` and read into the same flags; the flags the command line
gives itself win, before or after the file."""

import difflib
import os
import shlex
from pathlib import Path

from support.cli import UserError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def parse_with_presets(argv, parser):
    """argv parsed by parser (add_flags': no defaults), each `@file` replaced by the file's flags, every
    file's flags first: the flags typed on the command line come after them and so win (argparse keeps a
    flag's last value), whatever their order. Only an `@file` where a flag may stand is a preset: a flag's
    value is never one (`--prompt @alice`). A file that is not there, or a line that is not one of parser's
    flags with a value it takes, is a UserError naming the file, the line and the fix. Returns ({dest:
    value} of the flags given, {dest: "" typed, or "FILE, line N" of the preset that set it})."""
    nargs = {s: action.nargs for action in parser._actions for s in action.option_strings}
    from_files, typed, values, set_at = [], [], 0, {}  # values: how many of the next arguments are a flag's values
    for arg in argv:
        if arg.startswith("@") and not values:
            from_files += checked_flags(arg[1:], parser, set_at)
            continue
        typed.append(arg)
        if values:
            values -= 1
        else:  # a flag (or a mistake argparse reports): nargs None takes one value, "?" and switches none
            values = int(nargs.get(arg, 0) is None)
    typed_only = vars(parser.parse_args(typed))  # the typed flags alone: those a preset set that they leave out
    given = vars(parser.parse_args(from_files + typed))
    return given, {dest: "" if dest in typed_only else set_at[dest] for dest in given}


def preset_lines(path):
    """[(line number, the line's words)] of a preset file: `--flag value` or `--flag` a line, quoted
    as in a shell, in UTF-8 (with or without the BOM Notepad writes); blank lines and `#` comments left out."""
    if not os.path.isfile(path):
        shipped = ", ".join(f"@configs/{p.name}" for p in sorted(CONFIGS.glob("*.txt")))
        raise UserError(f"@{path}: no such preset file; the presets in this repository: {shipped}")
    try:
        text = Path(path).read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:  # e.object: the bytes after the BOM
        lineno = e.object.count(b"\n", 0, e.start) + 1
        raise UserError(
            f"{path}, line {lineno}: byte 0x{e.object[e.start]:02x} is not UTF-8: save it as UTF-8"
        ) from None
    lines = []
    for lineno, line in enumerate(text.splitlines(), 1):
        try:
            words = shlex.split(line, comments=True)
        except ValueError as e:  # an unclosed quote, or a `\` ending the line (a shell's continuation)
            fix = "ends in \\: one flag a line, no continuation" if line.endswith("\\") else f"{e}: close the quote"
            raise UserError(f"{path}, line {lineno}: {fix}") from None
        if words:
            lines.append((lineno, words))
    return lines


def checked_flags(path, parser, set_at):
    """The flags of one preset file, each line checked by parser alone ({dest: "FILE, line N"} into
    set_at); looked up where typed, then beside train_gpt2.py: `@configs/laptop.txt` from any folder."""
    beside = CONFIGS.parent / path
    path = str(beside) if not os.path.isfile(path) and beside.is_file() else path
    flags = [s for action in parser._actions for s in action.option_strings]
    out = []
    for lineno, words in preset_lines(path):
        where = f"{path}, line {lineno}"
        name = words[0].split("=", 1)[0]
        if name not in flags:
            close = difflib.get_close_matches(name, flags, n=1)
            fix = f"did you mean {close[0]}?" if close else f"see python {parser.prog} --help for the flags"
            raise UserError(f"{where}: {words[0]} is not a flag of {parser.prog}: {fix}")
        try:
            parser.parse_args(words)  # the value's type and count, as on the command line
        except UserError as e:
            raise UserError(f"{where}: {e}") from None
        out += words
        set_at[parser._option_string_actions[name].dest] = where
    return out
