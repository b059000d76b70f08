"""`meshtrain train | export | sample | import-hf | prepare | tokenizer train | plan`.

Every setting is validated in the launching process before any rank starts, so a bad flag costs
one line and a non-zero exit, not a launcher traceback. With --nproc N (and not already under
torchrun) the command re-runs itself as N local ranks through torch's elastic launcher; across
machines, run the same command under torchrun.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import math
import os
import sys
from pathlib import Path

import torch

from meshtrain.checkpointing import resuming
from meshtrain.checkpointing.checkpoint import (
    CheckpointError,
    CheckpointWriteError,
    read_manifest,
    resolve_checkpoint,
)
from meshtrain.cli.flags import as_flags
from meshtrain.cli.parsers import parse_command_line
from meshtrain.config import resumed_settings
from meshtrain.config import run_config as config_mod
from meshtrain.config.settings import model_arg_key
from meshtrain.errors import Code, SettingError
from meshtrain.interop.checkpoint_formats import checkpoint_format, format_named
from meshtrain.machine_fit import check_states_fit
from meshtrain.mesh import resolve_degrees
from meshtrain.operations import command_signals, endings, replica_launch, run_lock, stopping
from meshtrain.operations.cpu_threads import threads_per_rank
from meshtrain.operations.failures import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_PEER_FAILED,
    EXIT_STOPPED,
    RunFailure,
)
from meshtrain.parallel.runtime.nvme_offload import STATE_BYTES, check_offload_dir
from meshtrain.parallel.runtime.plan import ParallelPlan
from meshtrain.parallel.runtime.process_groups import check_local_devices, resolve_device
from meshtrain.parallel.runtime.replica_groups import torchft_module
from meshtrain.planner.hardware import load_hardware


def _error(e: Exception) -> int:
    """A refused input (exit 2), or a write that failed (a full disk: exit 1, as a run's):
    one line (a message quoting a damaged file may hold line breaks)."""
    print(f"meshtrain: error: {' '.join(as_flags(str(e)).split())}", file=sys.stderr)
    return EXIT_FAILED if isinstance(e, CheckpointWriteError) else EXIT_BAD_INPUT


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _notice(message: str) -> None:
    """A line from the process that speaks for the run: the launching one, or global rank 0
    under torchrun (not again in the ranks meshtrain's launcher starts)."""
    if os.environ.get("RANK", "0") == "0" and not stopping.under_meshtrain_launcher():
        print(f"meshtrain: {as_flags(message)}", file=sys.stderr)


def _train_config(args: argparse.Namespace) -> config_mod.RunConfig:
    overrides: dict[str, dict] = {}
    for key, value in vars(args).items():
        if "." in key:
            section, name = key.split(".", 1)
            overrides.setdefault(section, {})[name] = value
    file_values = config_mod.load_toml(args.config) if getattr(args, "config", None) else {}
    cfg = config_mod.build_config(file_values, overrides)
    c = cfg.checkpoint
    saved = resuming.saved_settings(Path(c.out)) if c.resume or c.auto_resume else None
    if saved is None:
        return cfg
    settings = {(section, f.name) for section, f in config_mod.flag_fields()}
    layout = {f.name for f in dataclasses.fields(ParallelPlan)}
    given = _given_settings(args) | {("model", model_arg_key(item))
                                     for item in cfg.model.model_arg or []}
    carried = resumed_settings.carried_settings(saved, given, settings, layout)
    for section, values in file_values.items():  # the config file over the saved settings
        carried.setdefault(section, {}).update(values)
    return config_mod.build_config(carried, overrides)


def _given_settings(args: argparse.Namespace) -> set[tuple[str, str]]:
    """(section, setting) of every setting given as a flag or in the --config file."""
    given = {tuple(key.split(".", 1)) for key in vars(args) if "." in key}
    file_values = config_mod.load_toml(args.config) if getattr(args, "config", None) else {}
    return given | {(section, name) for section, values in file_values.items()
                    if isinstance(values, dict) for name in values}


def check_train(cfg: config_mod.RunConfig, world_size: int):
    """Everything that can be checked before a rank starts: settings, data, output, resume;
    returns the validated `ParallelPlan`."""
    from meshtrain.training.trainer import corpus_of

    plan = config_mod.validate(cfg, world_size)
    if cfg.parallel.hardware is not None:  # the peak of every run's MFU, not only `layout`'s
        load_hardware(cfg.parallel.hardware)
    corpus = corpus_of(cfg)
    config_mod.check_packing(cfg, corpus.eod_id)
    vocab = corpus.vocab_size
    model = cfg.model_config(vocab)
    if model.vocab_size < vocab and not cfg.checkpoint.init_from:  # a flag or `model_arg`
        raise SettingError(Code.VOCAB_SIZE, f"`vocab_size` {model.vocab_size} is smaller than the"
                           f" data's vocabulary {vocab}: raise it or omit it")
    if model.vocab_size < vocab:
        raise SettingError(Code.VOCAB_SIZE,
                           f"--init-from: the model's vocabulary {model.vocab_size} is smaller"
                           f" than the data's {vocab}: use data of its tokenizer",
                           settings=("init_from",))
    check_states_fit(model.num_parameters(), plan.precision, world=world_size,
                     ranks_here=config_mod.local_ranks(cfg, world_size),
                     device_type=resolve_device(cfg.parallel.device).type)
    t = cfg.train
    corpus.samplers(cfg.data.val_fraction, seq_len=t.seq_len, global_batch=t.global_batch,
                    micro_batch=plan.micro_batch, seed=t.seed)  # refuses a split too short
    out = _writable_out(Path(cfg.checkpoint.out))
    if plan.offload_optimizer == "nvme":  # every rank's files on this machine's disk
        check_offload_dir(Path(plan.offload_dir), STATE_BYTES * model.num_parameters(),
                          cfg.offload_run_folder)
    run_lock.check_free(out, run_lock.own_run_id())
    run_lock.check_offload_free(cfg.offload_run_folder, run_lock.own_run_id())
    has_run = (out / "metrics.jsonl").exists() or (out / "checkpoints").exists()
    if cfg.checkpoint.resume or cfg.checkpoint.auto_resume:
        if note := resuming.repair_latest(out / "checkpoints"):
            _notice(note)
    c = cfg.checkpoint  # (RunComplete when nothing is left)
    resumed = resuming.checkpoint_to_resume(Path(c.out), resume=c.resume, auto_resume=c.auto_resume,
                                            steps=t.steps, stop_at=t.stop_at)
    # Hash the files where a damaged checkpoint is one line before spawning; ranks that
    # meshtrain's launcher spawned after doing so check metadata only (their load hashes again).
    hashed = not stopping.under_meshtrain_launcher()
    if resumed is not None:
        path, step = resumed
        read_manifest(path, model, verify_files=hashed)
        _notice(f"resuming from {path} (step {step})")
        saved = resuming.saved_settings(out)
        if saved and (note := resumed_settings.changed_settings(
                saved, cfg.resolved(model, plan).to_dict())):
            _notice(note)
        for note in resumed_settings.changes(cfg, path, step):
            _notice(note)
    elif has_run and not cfg.checkpoint.auto_resume and cfg.parallel.replica_group_id is None:
        raise SettingError(Code.OUT_PATH,
                           f"--out {out} holds an earlier run: pass --resume to continue it or"
                           " choose another --out", settings=("out", "resume"))
    elif init_from := cfg.checkpoint.init_from:
        checkpoint_format(init_from).check(Path(init_from), model, hashed)
    return plan


def _writable_out(out: Path) -> Path:
    """`out`, refused now (rather than at the first metrics row or checkpoint) when it is a
    file or cannot be created or written; nothing is created here, so a refusal leaves no
    trace."""
    if out.exists() and not out.is_dir():
        raise SettingError(Code.OUT_PATH,
                           f"`out` {out} is a file, not a directory: choose another `out`")
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise SettingError(Code.OUT_PATH,
                           f"`out` {out} cannot be created ({existing} is a file): choose another"
                           " `out`")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SettingError(Code.OUT_PATH,
                           f"`out` {out} is not writable by this user ({existing}): choose"
                           " another `out`")
    return out


def _launch(nproc: int, argv: list[str], *, max_restarts: int = 0,
            run_id: str | None = None) -> int:
    """Run `python -m meshtrain <argv>` as `nproc` local ranks with torch's elastic launcher
    (standalone rendezvous under `run_id`, which the ranks see as TORCHELASTIC_RUN_ID). Stop
    signals are meshtrain's (`stopping.LauncherSignals`); torch's agent keeps SIGQUIT."""
    import uuid

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if "--debug" not in argv:  # the user sees meshtrain's one line, not the agent's records
        for name in list(logging.root.manager.loggerDict):  # each module's logger has its level
            if name.startswith("torch.distributed.elastic"):
                logging.getLogger(name).setLevel(logging.CRITICAL)
    launch_args = get_args_parser().parse_args(
        ["--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
         f"--rdzv-id={run_id or uuid.uuid4().hex}", f"--nproc-per-node={nproc}",
         f"--max-restarts={max_restarts}", f"--shutdown-timeout={stopping.shutdown_timeout()}",
         "--signals-to-handle=SIGQUIT", "-m", "meshtrain"])
    launch_args.training_script_args = argv  # kept from the launcher's own option parsing
    with stopping.LauncherSignals(nproc) as signals:
        if signals.in_start_up:
            return signals.outcome()
        try:
            run(launch_args)
        except SignalException:
            return signals.outcome()
        except ChildFailedError as failure:
            return signals.explain(endings.launch_failure(failure.failures))
        # Stopped ranks exit 0 to the agent (a stop is no failure to restart) and report 3.
        return EXIT_STOPPED if EXIT_STOPPED in signals.codes().values() else 0


def _in_rank(fn, debug: bool = False) -> int:
    """Run `fn` on this rank and turn how it ends into one line (at most) and an exit code: a
    bad input 2; a `RunFailure` its code, printed once; a peer's death `EXIT_PEER_FAILED` in
    silence (the launcher names the dead rank); anything else one line naming this rank."""
    from meshtrain.parallel.runtime.process_groups import destroy_parallel

    rank = int(os.environ.get("RANK", "0"))
    try:
        fn()
    except ValueError as e:
        return _error(e)
    except RunFailure as e:
        if (rank == 0 or not e.agreed) and str(e):  # (nothing: another process says it)
            print(f"meshtrain: {as_flags(str(e))}", file=sys.stderr)
        return e.exit_code
    except Exception as e:
        if endings.peer_failed(e) and not debug:
            if not stopping.under_meshtrain_launcher():  # (that one names the dead rank)
                endings.name_silent_peers()
            return EXIT_PEER_FAILED
        return endings.unexpected(e, debug, f"rank {rank}: ")
    finally:
        destroy_parallel()
    return 0


def cmd_train(args: argparse.Namespace, argv: list[str]) -> int:
    cfg = _train_config(args)
    env_world = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else None
    world = config_mod.world_size_of(cfg, env_world)
    p = cfg.parallel
    world = replica_launch.group_world(cfg, world, under_torchrun=env_world is not None)
    if cfg.parallel.layout:
        from meshtrain.cli.auto_layout import choose_layout

        _notice(choose_layout(cfg, world, _given_settings(args)))
    try:
        plan = check_train(cfg, world)
    except resuming.RunComplete as done:
        _notice(str(done))
        return 0
    if p.fault_tolerance:  # the settings checked, then what they need of this machine
        torchft_module()  # the extra, named when it is missing
    if p.fault_tolerance and p.lighthouse and env_world is None:  # (ranks: their launcher did)
        replica_launch.check_lighthouse(p.lighthouse)
    if cfg.parallel.trace and plan.pp == 1 and int(os.environ.get("RANK", "0")) == 0:
        print("meshtrain: --trace records pipeline timelines; with --pp 1 it writes nothing",
              file=sys.stderr)
    threads = threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", world)),
                               cfg.parallel.threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the ranks meshtrain launches inherit it
    torch.set_num_threads(threads)
    if env_world is not None:  # a rank: under torchrun rank 0 takes the lock for the world
        mine = None if stopping.under_meshtrain_launcher() else run_lock.RunLock(
            cfg.checkpoint.out, run_lock.own_run_id())
        return _train_in_rank(cfg, plan, mine, args.debug)
    if replica_launch.GROUPS_PARENT in os.environ:  # one group's launcher: its parent holds it
        return _launch(world, [*argv, "--out", cfg.checkpoint.out],
                       max_restarts=p.max_restarts, run_id=run_lock.own_run_id())
    with run_lock.RunLock(cfg.checkpoint.out) as held:  # this process launches: it holds it
        if p.fault_tolerance and p.replica_group_id is None:
            print(f"meshtrain: {p.replica_groups} replica groups of {world} ranks"
                  f" ({_layout_text(plan)}) and a torchft lighthouse, writing to"
                  f" {cfg.checkpoint.out}", file=sys.stderr)
            return replica_launch.run_groups(
                [*argv, "--out", cfg.checkpoint.out], groups=p.replica_groups, ranks=world,
                min_groups=p.min_replica_groups, run_id=held.run_id)
        if world > 1 or cfg.parallel.max_restarts or p.fault_tolerance:
            print(f"meshtrain: {world} ranks ({_layout_text(plan)}), writing to"
                  f" {cfg.checkpoint.out}", file=sys.stderr)
            return _launch(world, [*argv, "--out", cfg.checkpoint.out],
                           max_restarts=cfg.parallel.max_restarts, run_id=held.run_id)
        return _train_in_rank(cfg, plan, None, args.debug)


def _layout_text(plan: ParallelPlan) -> str:
    """The layout as a `--layout` spec: dp, and every setting that differs from a run's
    default (degrees above 1, the scheme, the schedule, ZeRO, precision, ...)."""
    defaults = dict(config_mod.RUN_PLAN.spec_items())
    return ", ".join(f"{key}={value}" for key, value in plan.spec_items(config_mod.RUN_PLAN)
                     if key == "dp" or value != defaults.get(key))


def _train_in_rank(cfg: config_mod.RunConfig, plan, lock: run_lock.RunLock | None,
                   debug: bool) -> int:
    """This rank's training with stop signals armed; its exit code goes to meshtrain's
    launcher too (when that started it)."""
    from meshtrain.training.trainer import run_training

    signals = stopping.StopSignals(rank=int(os.environ.get("RANK", "0")))
    signals.arm()
    try:
        code = _in_rank(lambda: run_training(cfg, plan, stop=signals, lock=lock), debug)
    finally:
        signals.disarm()
    stopping.report_exit(code)
    if code == EXIT_STOPPED and stopping.under_meshtrain_launcher():
        return 0  # torch's agent would restart a rank that exits non-zero (`_launch` says 3)
    return code


def cmd_export(args: argparse.Namespace) -> int:
    path = resolve_checkpoint(args.run)
    count = format_named(args.format).export(path, args.out)
    print(f"meshtrain: wrote {count} tensors of {path} to {args.out}")
    return 0


def cmd_import_hf(args: argparse.Namespace) -> int:
    from meshtrain.interop.hf_io import import_hf

    path = import_hf(args.hf_dir, args.out)
    print(f"meshtrain: wrote {path}; train from it with --init-from {args.out}")
    return 0


def cmd_sample(args: argparse.Namespace, argv: list[str]) -> int:
    if args.max_new_tokens < 1 or args.top_k < 0 or not 0 < args.temperature < math.inf:
        raise SettingError(Code.RANGE,
                           "--max-new-tokens must be positive, --top-k >= 0 and --temperature a"
                           " finite number > 0",
                           settings=("max_new_tokens", "top_k", "temperature"))
    if args.tp < 1 or args.nproc < 1:
        raise SettingError(Code.RANGE, "--tp and --nproc must be positive",
                           settings=("tp", "nproc"))
    resolve_degrees(int(os.environ.get("WORLD_SIZE", args.nproc)), tp=args.tp)
    path = resolve_checkpoint(args.run)
    manifest = read_manifest(path)
    from meshtrain.models import config_from_dict

    model = config_from_dict(manifest["family"], manifest["model"])
    model.validate_for_tp(args.tp)
    from meshtrain.data.tokenization import checkpoint_tokenizer

    tokenizer = checkpoint_tokenizer(path, model.vocab_size)
    check_local_devices(args.device, args.nproc)
    if not _under_torchrun() and args.nproc > 1:
        return _launch(args.nproc, argv)
    from meshtrain.inference.generate import sample_from_checkpoint

    def go():
        text = sample_from_checkpoint(path, tokenizer, prompt=args.prompt, tp=args.tp,
                                      max_new_tokens=args.max_new_tokens, top_k=args.top_k,
                                      temperature=args.temperature, seed=args.seed,
                                      device=args.device)
        if text is not None:
            print(text)

    return _in_rank(go, args.debug)


def cmd_doctor(args: argparse.Namespace) -> int:
    from meshtrain.operations.doctor import doctor

    code, lines = doctor(args.run)
    print("\n".join(lines), file=sys.stderr if code else sys.stdout)
    return code


def cmd_prepare(args: argparse.Namespace) -> int:
    from meshtrain.data.prepare import prepare

    report = prepare(args.inputs, out=args.out, tokenizer=args.tokenizer,
                     text_field=args.text_field, workers=args.workers,
                     val_fraction=args.val_fraction, val_docs=args.val_docs,
                     on_error=args.on_error, eod_token=args.eod_token)
    for written in filter(None, (report.train, report.held_out)):
        print(f"meshtrain: wrote {written.tokens} tokens of {written.documents} document(s) to"
              f" {written.path}")
    if report.skipped:
        print(f"meshtrain: {as_flags(report.skipped)}", file=sys.stderr)
    return 0


def cmd_tokenizer_train(args: argparse.Namespace) -> int:
    from meshtrain.data.tokenization import train_tokenizer_file

    size, skipped = train_tokenizer_file(args.inputs, vocab_size=args.vocab_size, out=args.out,
                                         text_field=args.text_field, on_error=args.on_error)
    print(f"meshtrain: wrote a tokenizer of {size} tokens to {args.out}")
    if skipped:
        print(f"meshtrain: {as_flags(skipped)}", file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from meshtrain.cli.plan_command import cmd_plan  # the planner loads only for `plan`

    return cmd_plan(args)


def _interrupted(args: argparse.Namespace, sig) -> int:
    """A command other than `train` stopped by a signal: it removed what it was writing."""
    out = getattr(args, "out", None)
    if os.environ.get("RANK", "0") == "0" and not stopping.under_meshtrain_launcher():
        left = f"nothing half-written in {out}" if out else "nothing half-written"
        print(f"meshtrain: {args.command} stopped by {sig.name}: {left}; run it again",
              file=sys.stderr)
    return EXIT_STOPPED


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_command_line(argv)
    commands = {"train": lambda: cmd_train(args, argv), "export": lambda: cmd_export(args),
                "import-hf": lambda: cmd_import_hf(args), "prepare": lambda: cmd_prepare(args),
                "doctor": lambda: cmd_doctor(args),
                "tokenizer": lambda: cmd_tokenizer_train(args), "plan": lambda: _plan(args),
                "sample": lambda: cmd_sample(args, argv)}
    # train: stop signals held until the run arms its own handling (see `stopping`); any other
    # command stops at the first, its temporaries removed on the way out
    held = stopping.signals_held() if args.command == "train" else command_signals.interruptible()
    try:
        with held:
            try:
                return commands[args.command]()
            finally:
                command_signals.command_ended()
    except command_signals.Interrupted as e:
        return _interrupted(args, e.signal)
    except (ValueError, CheckpointError) as e:
        return _error(e)
    except Exception as e:  # (under torchrun every rank may print it: each names itself)
        where = f"rank {os.environ['RANK']}: " if _under_torchrun() else ""
        return endings.unexpected(e, args.debug, where)


def run() -> None:
    """The `meshtrain` command: `main`, then exit without the interpreter's last garbage
    collections. Once torch is imported they walk every object it made (0.6-1.1 s per process,
    paid by the launcher and each rank); what must be released early (process groups, held in
    cycles) `destroy_parallel` has collected already, and files are closed by then."""
    code = main()
    command_signals.ignore_from_now()  # a signal now must not turn `code` into 128+N
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    run()
