"""The run's settings, section by section (TOML tables of the same names): every field is a
CLI flag of `meshtrain train` (underscores become dashes) whose help text is its `help`. The
layout's settings are `ParallelPlan`'s fields and the optimizer's `OptimizerSettings`' fields,
which say their own table (`section`); the model's are `TransformerConfig`'s fields that
declare their help (`ModelSettings`, made from them). `run_config.py` combines them into a
`RunConfig`, reads TOML files and checks everything."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from meshtrain.models import PRESETS, TransformerConfig
from meshtrain.parallel.layers.cp_balance import CP_BALANCES
from meshtrain.parallel.runtime.process_groups import DEVICE_KINDS


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


RUN_DEFAULTS = {"vocab_size": "the data's, 256 for text",
                "max_seq_len": "the larger of the preset's and the sequence length"}
"""What a [model] setting left unset means where it is not the preset's value
(`RunConfig.model_config`)."""

CONFIG_SETTINGS = tuple(f.name for f in dataclasses.fields(TransformerConfig)
                        if "help" in f.metadata)
"""The [model] settings that are model config fields: those declaring their help."""


def _model_settings() -> type:
    """[model]: the preset, each of `CONFIG_SETTINGS` with the field's help and choices (unset
    by default, so that the preset's value stands), and `model_arg` for any other field."""
    config, fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}, []
    for name in CONFIG_SETTINGS:
        f, default = config[name], RUN_DEFAULTS.get(name, "the preset's")
        fields.append((name, f.type.removesuffix(" | None") + " | None",
                       _f(None, f"{f.metadata['help']} (default: {default})",
                          choices=f.metadata["choices"])))
    model = _f(None, f"model preset: {', '.join(PRESETS)} (default: tiny)", flag="--model")
    model_arg = _f(None, "set any field of the model family's config, KEY=VALUE (repeatable;"
                         " e.g. rope_theta=1e6): a family's own settings need no flag of their"
                         " own")
    return dataclasses.make_dataclass(
        "ModelSettings", [("model", "str | None", model), *fields,
                          ("model_arg", "list[str] | None", model_arg)],
        namespace={"__module__": __name__, "__doc__": _model_settings.__doc__}, slots=True)


ModelSettings = _model_settings()


def model_arg_key(item: str) -> str:
    """The field a `model_arg` item (KEY=VALUE) sets."""
    return item.partition("=")[0].strip()


@dataclass(slots=True)
class ParallelSettings:
    nproc: int | None = _f(None, "local ranks to spawn (default tp x pp x cp x dp, degrees not"
                                 " given being 1); omit under torchrun")
    threads: int | None = _f(None, "CPU threads per rank (default: OMP_NUM_THREADS when set,"
                                   " else the cores idle at start shared by the local ranks,"
                                   " so a busy machine does not stall the run)")
    max_restarts: int = _f(0, "restart every rank up to N times after one fails (meshtrain's"
                              " launcher; needs --auto-resume); under torchrun use its own"
                              " --max-restarts")
    fault_tolerance: bool = _f(False, "train through failures with torchft (pip install"
                                      " 'meshtrain[ft]'): the replica groups keep stepping when"
                                      " one fails; its restart heals from a live group")
    replica_groups: int = _f(1, "with --fault-tolerance: replica groups, each a whole model copy"
                                " of nproc / N ranks with its own tp/pp/ZeRO layout")
    min_replica_groups: int = _f(1, "with --fault-tolerance: no step commits with fewer groups"
                                    " taking part")
    replica_group_id: int | None = _f(None, "under torchrun with --fault-tolerance: this job's"
                                            " group, 0 .. replica_groups - 1")
    lighthouse: str | None = _f(None, "under torchrun with --fault-tolerance: HOST:PORT of the"
                                      " torchft lighthouse every group joins")
    device: str = _f("auto", "auto (CUDA when available), cpu or cuda: one GPU per local rank",
                     choices=DEVICE_KINDS)
    collective_timeout: float = _f(600.0, "seconds a rank may wait in one collective before the"
                                          " run is declared hung: the ranks dump their last"
                                          " collectives to --out/hang and the run exits with"
                                          " code 4 naming what diverged (meshtrain doctor OUT)")
    straggler_window: int = _f(0, "every N steps compare each rank's compute time (its step"
                                  " time less its time blocked in collectives) with the"
                                  " median of the ranks of its pipeline stage, and name those"
                                  " over --straggler-threshold times it in the progress output"
                                  " and metrics.jsonl (`stragglers`); one all-gather of 3"
                                  " floats per rank per window (0: off)")
    straggler_threshold: float = _f(3.0, "with --straggler-window, a rank is a straggler when"
                                         " its compute over a window is more than this many"
                                         " times its stage's median")
    drop_stragglers: int = _f(0, "with --fault-tolerance and --straggler-window: restart this"
                                 " replica group when one of its ranks is named a straggler in"
                                 " N windows in a row; it rejoins at the next quorum and heals"
                                 " from a live group (0: off)")
    layout: str | None = _f(None, "let the planner choose the layout before the ranks start:"
                                  " auto searches every layout field, a spec such as"
                                  " tp=2,zero=1 (as for meshtrain plan) fixes the fields it"
                                  " names; layout flags given (--tp, --micro-batch, ...) stay"
                                  " fixed too; the choice and why are printed")
    hardware: str | None = _f(None, "hardware profile for --layout and the MFU in the metrics:"
                                    " a built-in name or a TOML file from meshtrain plan"
                                    " calibrate (default: this machine's CUDA device's profile,"
                                    " else the CPU one)")
    trace: str | None = _f(None, "with --pp > 1, write the second step's pipeline timeline to"
                                 " this directory: pipeline.json (Perfetto), pipeline.png and"
                                 " pipeline_idle.json (measured vs simulated idle per stage)")


@dataclass(slots=True)
class TrainSettings:
    steps: int = _f(300, "total optimizer steps (defines the learning-rate schedule)")
    stop_at: int | None = _f(None, "end after this step with a checkpoint, as an interrupted run"
                                   " would")
    global_batch: int = _f(16, "sequences per optimizer step, over all data-parallel ranks")
    seq_len: int = _f(128, "tokens per sequence")
    max_nonfinite_steps: int = _f(1, "stop (exit code 5, nothing saved) after this many"
                                     " consecutive steps whose loss or gradient norm is inf or"
                                     " NaN; above 1, such steps skip their update (fp16 also"
                                     " skips and rescales on gradient overflow, as always)")
    seed: int = _f(0, "seed for weights, data order and dropout")
    eval_every: int = _f(100, "evaluate the held-out loss every N steps (0 disables)")
    eval_batches: int = _f(4, "global batches per evaluation")
    log_every: int = _f(10, "write the buffered metrics.jsonl rows every N steps (and at each"
                            " checkpoint and the end); without a terminal, also a progress line")
    loss_scale_window: int = _f(1000, "fp16: double the loss scale after this many clean steps")


@dataclass(slots=True)
class DataSettings:
    data: str | None = _f(None, "text file (byte tokens) or .bin of uint16/uint32 tokens with a"
                                " .bin.json sidecar (as meshtrain prepare writes); default:"
                                " the Python standard library source")
    data_path: list[str] | None = _f(None, "blend token files by weight instead of --data, as"
                                           " Megatron-LM's --data-path: W1 FILE1 W2 FILE2 ..."
                                           " (weights normalized; one FILE alone is that file);"
                                           " after every step each file has given its weight's"
                                           " share of the sequences, within one; the files"
                                           " share vocab_size, tokenizer and eod_id",
                                     nargs="+", metavar="W FILE")
    val_fraction: float = _f(0.05, "fraction of the tokens held out for evaluation (unused when"
                                   " the data has a prepared held-out file)")
    document_mask: bool = _f(False, "attention stays within each document of a packed sequence"
                                    " (documents end with the token file's eod_id, as meshtrain"
                                    " prepare writes it)")
    reset_positions: bool = _f(False, "positions restart at each document's first token (with"
                                      " --document-mask; GPT's learned positions need it to see"
                                      " each document as it would alone)")
    eod_mask_loss: bool = _f(False, "no loss on predicting the end-of-document token")
    cp_balance: str = _f("work", "with --document-mask and cp > 1, which tokens each"
                                 " context-parallel rank holds: work (each micro-batch's chunks"
                                 " assigned by the attention its documents give them, so every"
                                 " rank computes the same) or head-tail (the fixed split, which"
                                 " balances only one long document)", choices=CP_BALANCES)


@dataclass(slots=True)
class CheckpointSettings:
    out: str | None = _f(None, "output directory (default runs/<date-time>)")
    resume: bool = _f(False, "continue from the latest checkpoint in --out")
    init_from: str | None = _f(None, "start a new run (step 0, fresh optimizer) from the model"
                                     " weights of this run or checkpoint directory (any layout,"
                                     " the output of meshtrain import-hf, or a DCP directory of"
                                     " torchtitan's Llama 3: meshtrain's DCP export or one"
                                     " torchtitan saved, with `num_heads` given); the model's"
                                     " family and shape are the checkpoint's")
    save_every: int = _f(0, "save a checkpoint every N steps (0: only at the end)")
    save_every_minutes: float = _f(0.0, "also save when this many minutes have passed since the"
                                        " run's start or last save (rank 0's clock decides, at a"
                                        " step's end; 0: off)")
    async_save: bool = _f(False, "write checkpoints in a background thread: a step blocks only"
                                 " to copy the weights and optimizer states to host memory; a"
                                 " checkpoint becomes `latest` at the next save or the run's end;"
                                 " a failed write is retried at the next save, 3 in a row stop"
                                 " the run")
    auto_resume: bool = _f(False, "continue from the newest complete checkpoint in --out when"
                                  " there is one, else start fresh (for restarts)")
    keep_last: int = _f(0, "after each save keep only the newest N checkpoints, deleting older"
                           " ones (0: keep all); the one the latest pointer names is never"
                           " deleted")


@dataclass(slots=True)
class LoggingSettings:
    run_name: str | None = _f(None, "the run's name in every logger: the W&B run's name and"
                                    " the TensorBoard folder --out/tensorboard/NAME (default:"
                                    " the --out folder's name)")
    wandb_project: str | None = _f(None, "also log metrics to this Weights & Biases project"
                                         " (needs pip install 'meshtrain[wandb]'; WANDB_MODE="
                                         "offline keeps them on this machine for wandb sync);"
                                         " a resumed run continues the same W&B run")
    profile_steps: str | None = _f(None, "record steps A to B (A:B, 1-based, inclusive) with"
                                         " torch.profiler: one trace per rank in"
                                         " --out/profile/rank<R>.json, readable in"
                                         " ui.perfetto.dev")
    peak_memory: bool = _f(False, "measure the second step's peak memory on every rank (the"
                                  " high-water mark of live tensor storages on CPU, which slows"
                                  " that step; max_memory_allocated on CUDA) into"
                                  " --out/memory.json")
