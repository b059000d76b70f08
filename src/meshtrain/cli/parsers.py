"""The argument parsers of the `meshtrain` subcommands: every `train` flag comes from a setting in
`config/` or a `ParallelPlan` field (its help text and choices included), so `--help` explains
every flag and a new setting needs no parser code."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re

from meshtrain.config import run_config as config_mod
from meshtrain.config import settings
from meshtrain.data.documents import ON_ERROR
from meshtrain.interop.checkpoint_formats import FORMATS, NATIVE
from meshtrain.parallel.runtime.optim import OptimizerSettings
from meshtrain.parallel.runtime.process_groups import DEVICE_KINDS
from meshtrain.planner.hardware import BUILT_IN


class HelpFormatter(argparse.HelpFormatter):
    """States each option's default once: appended unless the help text already says it, or
    there is none to state (None, a switch that is off, a `train` setting left unset)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.default is None
                or action.default is False or action.default in ("", argparse.SUPPRESS)):
            return text
        return text + " (default: %(default)s)"


def _debug_parent() -> argparse.ArgumentParser:
    """`--debug` for every subcommand (ranks re-run the same argv, so they get it too)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--debug", action="store_true", default=False,
                        help="show the traceback of an unexpected error instead of one line")
    return parent


DEBUG = [_debug_parent()]
SAMPLE_TOP_K, SAMPLE_TEMPERATURE = 40, 0.8
"""`sample`'s defaults: readable text from a small model (greedy decoding loops)."""


def _version() -> str:
    """The installed package's version (a source tree not installed says so)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("meshtrain")
    except PackageNotFoundError:
        return "(not installed)"


def command(sub, name: str, **kw) -> argparse.ArgumentParser:
    """A subcommand's parser: `--debug`, and defaults stated by `HelpFormatter`. Choices are
    shown as metavars and checked by the library, whose refusal is one line."""
    return sub.add_parser(name, parents=DEBUG, formatter_class=HelpFormatter, **kw)


# `train --help` groups: each TOML table's settings, with these shown under a group of their own.
_TABLE_GROUPS = {"model": "model", "data": "data", "parallel": "parallel layout",
                 "train": "training", "checkpoint": "checkpoints", "logging": "logging"}
_MOVED = {"precision": ("precision", "grad_dtype", "fp8", "loss_scale_window"),
          "optimizer": tuple(f.name for f in dataclasses.fields(OptimizerSettings)),
          "logging": ("log_every", "trace"),
          "operations": ("nproc", "threads", "max_restarts", "device", "collective_timeout",
                         "max_nonfinite_steps", "fault_tolerance", "replica_groups",
                         "min_replica_groups", "replica_group_id", "lighthouse")}
_GROUP_ORDER = ("model", "data", "parallel layout", "precision", "training", "optimizer",
                "checkpoints", "logging", "operations")
_GROUP_NOTES = {"logging": "metrics.jsonl always; TensorBoard events in"
                           " --out/tensorboard/RUN_NAME when the tensorboard package is"
                           " installed (pip install 'meshtrain[tensorboard]')"}


def help_group(section: str, name: str) -> str:
    """The `train --help` group of setting `name` of TOML table `section`."""
    return next((group for group, names in _MOVED.items() if name in names),
                _TABLE_GROUPS[section])


def _train_parser(sub) -> argparse.ArgumentParser:
    p = command(sub, "train", help="train a model", argument_default=argparse.SUPPRESS,
                usage="%(prog)s [--config FILE.toml] [options]",
                description="Train a language model on a device mesh. Degrees not given are 1"
                            " and dp fills the world. Precedence: defaults < --config"
                            " FILE.toml < flags. Each group names the TOML tables its settings"
                            " take in --config.")
    p.add_argument("--config", metavar="FILE.toml",
                   help="TOML file with [model], [parallel], [train], [data], [checkpoint],"
                        " [logging] tables")
    fields = config_mod.flag_fields()
    groups = {}
    for group in _GROUP_ORDER:
        tables = {section for section, f in fields if help_group(section, f.name) == group}
        where = "TOML " + ", ".join(f"[{table}]" for table in sorted(tables))
        note = f"{_GROUP_NOTES[group]}; {where}" if group in _GROUP_NOTES else where
        groups[group] = p.add_argument_group(group, note)
    for section, f in fields:
        _add_setting_flag(groups[help_group(section, f.name)], section, f)
    return p


def _add_setting_flags(p, fields) -> None:
    for section, f in fields:
        _add_setting_flag(p, section, f)


def _add_setting_flag(p, section: str, f: dataclasses.Field) -> None:
    """The flag of setting `f` of TOML table `section` (dest: section.name), its help from the
    field and its default stated once."""
    flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
    default = f.metadata.get("run_default", f.default)
    text = f.metadata["help"]
    if not (default is None or default is False or default is dataclasses.MISSING
            or "default" in text):
        text += f" (default: {default})"
    dest = f"{section}.{f.name}"
    kind = f.type if isinstance(f.type, str) else str(f.type)
    choices = f.metadata.get("choices")
    if kind.startswith("bool"):
        p.add_argument(flag, dest=dest, action="store_true", help=text)
    elif kind.startswith("list") and "nargs" in f.metadata:  # all values after one flag
        p.add_argument(flag, dest=dest, nargs=f.metadata["nargs"], help=text,
                       metavar=f.metadata["metavar"])
    elif kind.startswith("list"):
        p.add_argument(flag, dest=dest, action="append", help=text, metavar="KEY=VALUE")
    else:
        convert = int if kind.startswith("int") else float if kind.startswith("float") else str
        metavar = "{" + ",".join(map(str, choices)) + "}" if choices else f.name.upper()
        p.add_argument(flag, dest=dest, type=convert, help=text, metavar=metavar)


def _plan_parser(sub) -> None:
    p = command(sub, "plan", argument_default=argparse.SUPPRESS,
                       help="choose a layout: rank the layouts of a model on N devices by"
                            " predicted step time, within their memory",
                       description="Predict and rank the layouts (tp, pp, dp, cp, ep, virtual"
                                   " stages, micro-batch, ZeRO, sp, recompute, schedule) of a"
                                   " model on --gpus devices of --hardware, with the command"
                                   " to train each. `plan calibrate` measures this machine;"
                                   " `plan validate` checks predictions against published"
                                   " runs.")
    _add_setting_flags(p, [(s, f) for s, f in config_mod.flag_fields() if s == "model"])
    train = {f.name: f for f in dataclasses.fields(settings.TrainSettings)}
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"{train['seq_len'].metadata['help']} (default: the model's"
                        " --max-seq-len, its preset's unless given)")
    p.add_argument("--global-batch", type=int, default=train["global_batch"].default,
                   help=train["global_batch"].metadata["help"])
    p.add_argument("--gpus", type=int, default=None, metavar="N",
                   help="devices to plan for (required)")
    p.add_argument("--hardware", default=None, metavar="NAME|FILE.toml",
                   help=f"a built-in profile ({', '.join(BUILT_IN)}) or a TOML file from"
                        " `plan calibrate` (default: this machine's: its CUDA device's"
                        " profile, else cpu-gloo; the header says which)")
    p.add_argument("--precision", default=None,
                   help="fp32, bf16 or fp16 (default: the hardware's), or fp8: bf16 with float8"
                        " matmuls (`fp8=tensorwise` in the layout unless it names a recipe)")
    p.add_argument("--layout", metavar="SPEC", default="",
                   help="fix fields, e.g. tp=8,pp=8,vp=3,mb=1,zero=1,sp=1,recompute=selective,"
                        "schedule=interleaved; the others are searched (2bw only when"
                        " fixed); a spec leaving one layout is evaluated even over budget")
    p.add_argument("--moe-imbalance", type=float, default=None, metavar="X",
                   help="max/mean rows per expert an MoE model's busiest expert-parallel rank"
                        " is priced at (its compute, all-to-alls and saved rows; a run's"
                        " metrics report it as moe_tokens_per_expert_max / _mean; default 1:"
                        " balanced)")
    p.add_argument("--top", type=int, default=5, metavar="K", help="layouts to show")
    p.add_argument("--json", action="store_true", default=False,
                   help="print one JSON object instead of the table")
    p.add_argument("--explain", action="store_true", default=False,
                   help="also list the rejected layouts by reason, with examples")
    tools = p.add_subparsers(dest="plan_command", metavar="{calibrate,validate}")
    c = command(tools, "calibrate",
                help="measure this machine (matmuls, collectives, a layer; its ranks busy at"
                     " once) into a hardware file, or fit a profile to finished runs")
    c.add_argument("--out", default=None, metavar="FILE.toml",
                   help="the profile to write (default: this machine's profile for --ranks"
                        " ranks, under $MESHTRAIN_HOME/hardware or ~/.cache/meshtrain/hardware,"
                        " which `plan` and train's automatic layout then use by themselves)")
    c.add_argument("--ranks", type=int, default=4,
                   help="ranks measured at once (on a CPU they share its cores)")
    c.add_argument("--from-run", nargs="+", default=None, metavar="RUN",
                   help="instead of measuring, fit the --hardware profile (default: this"
                        " machine's) to these finished `train` runs' step times: their"
                        " config.toml and metrics.jsonl")
    c.add_argument("--hardware", default=argparse.SUPPRESS, metavar="NAME|FILE.toml",
                   help="the profile --from-run starts from")
    command(tools, "validate",
            help="predicted vs published TFLOP/s of the published runs' layouts")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="meshtrain", description="Train transformer language models on a device mesh; see"
                                      " `meshtrain COMMAND --help` for each command.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    e = command(sub, "export",
                help="write a checkpoint's model as one consolidated"
                            " safetensors file, a Hugging Face model directory or a DCP"
                            " directory of torchtitan's Llama 3")
    e.add_argument("run", help="run directory (its latest checkpoint) or a checkpoint directory")
    e.add_argument("--out", required=True, help="output .safetensors file (--format meshtrain)"
                                                " or new directory (--format hf, dcp)")
    e.add_argument("--format", choices=tuple(f.name for f in FORMATS), default=NATIVE.name,
                   help="meshtrain: one safetensors file under meshtrain's names (default); hf:"
                        " config.json + model.safetensors (+ the run's tokenizer) for"
                        " transformers' from_pretrained; dcp: torch.distributed.checkpoint files"
                        " under torchtitan's Llama 3 names (a new training run starts from it)")
    i = command(sub, "import-hf",
                help="turn a Hugging Face GPT-2, Llama, Qwen2 or Mistral directory into a"
                     " meshtrain run directory (train --init-from it)")
    i.add_argument("hf_dir", metavar="HF_DIR", help="config.json + model.safetensors (or shards"
                                                     " with model.safetensors.index.json)")
    i.add_argument("--out", required=True, help="new run directory to write")
    s = command(sub, "sample", help="generate text from a checkpoint (any layout)")
    s.add_argument("run", help="run directory (its latest checkpoint) or a checkpoint directory")
    s.add_argument("--prompt", default="def ", help="text to continue (default: 'def ')")
    s.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate")
    s.add_argument("--top-k", type=int, default=SAMPLE_TOP_K,
                   help="sample from the k most likely tokens; 0: greedy decoding (the most"
                        " likely token each step, which a small model repeats in loops)")
    s.add_argument("--temperature", type=float, default=SAMPLE_TEMPERATURE,
                   help="softmax temperature for top-k: lower is more predictable")
    s.add_argument("--seed", type=int, default=0, help="seed for top-k sampling")
    s.add_argument("--nproc", type=int, default=1, help="local ranks to spawn")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    s.add_argument("--device", default="auto", metavar="{" + ",".join(DEVICE_KINDS) + "}",
                   help="auto (CUDA when available), cpu or cuda")
    d = command(sub, "doctor",
                help="say what diverged in a hung run, from its dumps")
    d.add_argument("run", metavar="RUN_DIR", help="the run's output directory (its hang/"
                                                   " dumps)")
    _prepare_parser(sub)
    _tokenizer_parser(sub)
    _plan_parser(sub)
    return parser



def _add_input_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text files (one document each), folders (their files, recursively, in"
                        " sorted order; the JSON metadata of a folder that datasets'"
                        " save_to_disk wrote is left out), .jsonl files and .json files in JSON"
                        " lines (one document per line), .parquet and .arrow files (one document"
                        " per row; they need pip install 'meshtrain[datasets]')")
    p.add_argument("--text-field", default="text",
                   help="the JSONL field or table column holding a document's text")
    p.add_argument("--on-error", default="fail", metavar="{" + ",".join(ON_ERROR) + "}",
                   help="bad input (unreadable file, invalid JSON line, missing field or column,"
                        " a null or non-string value, non-UTF-8 bytes): fail stops with one"
                        " line, skip counts it and goes on")


def _prepare_parser(sub) -> None:
    p = command(sub, "prepare",
                help="tokenize text, folders, JSONL, Parquet and Arrow (saved Hugging Face"
                     " datasets) into a token file",
                description="Tokenize documents into FILE.bin + FILE.bin.json, the token file"
                            " `meshtrain train` reads, an end-of-document token after each"
                            " document.")
    _add_input_arguments(p)
    p.add_argument("--out", required=True, metavar="FILE.bin", help="the token file to write")
    p.add_argument("--tokenizer", default="bytes",
                   help="bytes (ids 0..255, 256 ends a document) or a tokenizer.json")
    p.add_argument("--eod-token", help="the tokenizer.json's end-of-document token (default:"
                                       " its <|endoftext|>, <|end_of_text|>, </s> or <eos>)")
    p.add_argument("--workers", type=int, help="tokenizing processes (default: the CPU count,"
                                               " at most 16)")
    p.add_argument("--val-fraction", type=float, default=0.0,
                   help="hold out this fraction of the documents (evenly spaced) in FILE.val.bin"
                        " for evaluation (0: none)")
    p.add_argument("--val-docs", type=int, help="hold out this many documents instead")


def _tokenizer_parser(sub) -> None:
    t = command(sub, "tokenizer", help="tokenizer tools: train")
    train = command(t.add_subparsers(dest="tokenizer_command", required=True), "train",
        help="learn a byte-level BPE tokenizer.json from text",
        description="Learn a byte-level BPE tokenizer (the 256 bytes, <|endoftext|>, merges) from"
                    " documents; the same inputs give the same file, byte for byte.")
    _add_input_arguments(train)
    train.add_argument("--vocab-size", type=int, required=True,
                       help="token ids to learn, at least 257")
    train.add_argument("--out", required=True, metavar="tokenizer.json",
                       help="the tokenizer file to write")


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """The parsed command line; an unknown argument is refused with the usage of the
    subcommand it was given to (not the top-level usage argparse would print), and the flag
    it most resembles."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        inner = _command_parser(parser, args)
        flags = [flag for action in inner._actions for flag in action.option_strings
                 if flag.startswith("--")]
        hint = _did_you_mean(next((word.split("=")[0] for word in extras
                                   if word.startswith("--")), ""), flags)
        inner.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
    return args


def _did_you_mean(word: str, known: list[str]) -> str:
    """'; did you mean X?' for the known name closest to a mistyped one ('' if none is)."""
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6) if word else []
    return f"; did you mean {close[0]}?" if close else ""


class Parser(argparse.ArgumentParser):
    """argparse's parser, naming the closest choice to a mistyped one (a subcommand, or a
    value of a flag with choices): Python 3.14's `suggest_on_error`, for every version."""

    def error(self, message: str):
        if match := re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message):
            message += _did_you_mean(match.group(1), re.findall(r"'([^']*)'", match.group(2)))
        super().error(message)


def _command_parser(parser: argparse.ArgumentParser,
                    args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost (sub)command parser `args` came through."""
    while True:
        chosen = [action.choices.get(getattr(args, action.dest, None))
                  for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
        if not chosen or chosen[0] is None:
            return parser
        parser = chosen[0]
