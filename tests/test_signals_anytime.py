"""Stop signals at any moment of any command: while the command still loads torch, after a run's
stop checkpoint is saved, while `prepare`, `import-hf` or `export` write; and a rank that dies
under plain torchrun. Real processes and real signals; each waits for a sign of the moment it
targets (a handler installed, a file written) rather than a fixed time."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import transformers
from harness import run_torchrun, start_cli
from test_stopping import _finish, _flags, _meshtrain_lines, _rows, _wait_for_step

from meshtrain.cli.main import main
from meshtrain.data import prepare as prepare_mod
from meshtrain.operations import stopping


def _catches(pid: int, sig: int) -> bool:
    """`pid` has a Python handler for `sig` (its SigCgt mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line for line in status.splitlines()
                      if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught >> (sig - 1) & 1)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_while_the_command_loads_torch_is_one_line_and_exit_3(corpus, tmp_path, sig):
    """The first line of `import meshtrain` installs the handler (SIGHUP's is the last set);
    the signal lands at once, before torch is loaded: one line, exit 3, nothing written."""
    out = tmp_path / "run"
    proc = start_cli(*_flags(corpus, out, "--nproc", "2"))
    deadline = time.monotonic() + 60
    while not _catches(proc.pid, signal.SIGHUP):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        time.sleep(0.001)
    loading = "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()
    os.kill(proc.pid, sig)
    code, err = _finish(proc, timeout=30)
    assert loading, "torch was loaded already: the signal did not land during the imports"
    assert code == 3 and err.splitlines() == [
        f"meshtrain: stopped by {sig.name} during start-up, before the first step: nothing to"
        " save"], err[-3000:]
    assert not out.exists()


@pytest.mark.parametrize("nproc", ["1", pytest.param("2", marks=pytest.mark.extended)])
def test_signals_after_the_stop_checkpoint_keep_exit_3(corpus, tmp_path, nproc):
    """SIGTERM, then SIGTERM again every 20 ms (to the launcher and its ranks) from the moment
    the checkpoint is complete until the command is gone: the run saved, so it says so once and
    exits 3 (not 143)."""
    out = tmp_path / "run"
    proc = start_cli(*_flags(corpus, out, "--nproc", nproc))
    _wait_for_step(out, 2, proc)
    os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while not (out / "checkpoints" / "latest").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        time.sleep(0.005)
    sent = 0
    while proc.poll() is None:
        for pid in [proc.pid, *stopping.rank_processes(proc.pid).values()]:  # (live ones)
            try:
                os.kill(pid, signal.SIGTERM)
                sent += 1
            except ProcessLookupError:
                pass
        time.sleep(0.02)
    code, err = _finish(proc)
    step = max(r["step"] for r in _rows(out) if "loss" in r)
    assert code == 3 and _meshtrain_lines(err) == [
        f"meshtrain: stopped by SIGTERM after step {step}; checkpoint step_{step:08d} saved;"
        " continue with --resume (or --auto-resume)"], (sent, err[-3000:])


_SAVED_SCRIPT = textwrap.dedent("""
    import os, signal, time
    from meshtrain.operations import stopping
    stopping.DUPLICATE_WINDOW_S = 0.2
    stop = stopping.StopSignals(rank=0)
    stop.arm()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)
    stop.saved()  # the stop checkpoint is complete
    os.kill(os.getpid(), signal.SIGTERM)  # again, past the window
    time.sleep(0.5)
    print(stop.request(), flush=True)
""")


def test_a_repeat_after_the_checkpoint_is_saved_changes_nothing():
    """Past the duplicate window a repeat aborts a stop still saving (128+N); once the save is
    complete it is ignored: the rank ends as stopped, with its checkpoint."""
    run = subprocess.run([sys.executable, "-c", _SAVED_SCRIPT], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and run.stdout.split() == ["115.0"], run.stderr[-3000:]
    assert run.stderr == ""


def _signal_self_after(calls: int):
    """A wrapper that sends SIGTERM to this process on the `calls`-th call of what it wraps,
    while that command writes: the handler `main` installed must clean up."""
    count = [0]

    def wrap(fn):
        def wrapped(*args, **kwargs):
            count[0] += 1
            if count[0] == calls:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.5)  # the handler raises here
            return fn(*args, **kwargs)
        return wrapped
    return wrap


def _only_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("meshtrain:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _dead_pid() -> int:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True)
    return int(child.stdout)


def test_prepare_interrupted_leaves_nothing_and_the_next_run_succeeds(tmp_path, capsys,
                                                                      monkeypatch):
    """SIGTERM while the token file is written: exit 3, one line, no output and no temporary;
    the temporaries a killed run left (its pid gone) are removed by the next run."""
    text = tmp_path / "docs.txt"
    text.write_text("".join(f"document {i} " * 50 + "\n\n" for i in range(400)))
    out = tmp_path / "tokens" / "x.bin"
    argv = ["prepare", str(text), "--out", str(out), "--workers", "1"]
    monkeypatch.setattr(prepare_mod._TokenFile, "take",
                        _signal_self_after(1)(prepare_mod._TokenFile.take))
    assert main(argv) == 3
    assert _only_line(capsys) == (f"meshtrain: prepare stopped by SIGTERM: nothing half-written"
                                  f" in {out}; run it again")
    assert list(out.parent.iterdir()) == []
    monkeypatch.undo()
    stale = [out.with_name(f".{name}.tmp{_dead_pid()}") for name in ("x.bin", "x.bin.json")]
    for path in stale:
        path.write_bytes(b"left by a killed run")
    assert main(argv) == 0
    assert sorted(p.name for p in out.parent.iterdir()) == ["x.bin", "x.bin.json"]


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "llama"
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def test_import_hf_and_export_interrupted_leave_nothing_and_rerun(hf_llama, tmp_path, capsys,
                                                                  monkeypatch):
    """SIGTERM mid-write of `import-hf`, then of `export` (both formats): exit 3, one line, no
    --out and no temporary; a temporary a killed import left is removed by the next one, which
    succeeds (it was: `--out ... holds a run`)."""
    from meshtrain.checkpointing import safetensors_stream

    run = tmp_path / "run"
    write = safetensors_stream._write_tensors
    monkeypatch.setattr(safetensors_stream, "_write_tensors", _signal_self_after(1)(write))
    assert main(["import-hf", str(hf_llama), "--out", str(run)]) == 3
    assert _only_line(capsys) == (f"meshtrain: import-hf stopped by SIGTERM: nothing"
                                  f" half-written in {run}; run it again")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.undo()
    leftover = tmp_path / ".run.import-tmp" / "checkpoints" / ".tmp_step_00000000"
    leftover.mkdir(parents=True)  # as a SIGKILL mid-write leaves it
    assert main(["import-hf", str(hf_llama), "--out", str(run)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    capsys.readouterr()
    for fmt, name in (("meshtrain", "m.safetensors"), ("hf", "hf")):
        monkeypatch.setattr(safetensors_stream, "_write_tensors", _signal_self_after(1)(write))
        out = tmp_path / name
        assert main(["export", str(run), "--format", fmt, "--out", str(out)]) == 3
        assert _only_line(capsys) == (f"meshtrain: export stopped by SIGTERM: nothing"
                                      f" half-written in {out}; run it again")
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name[0] == "."]
        monkeypatch.undo()
        assert main(["export", str(run), "--format", fmt, "--out", str(out)]) == 0


@pytest.mark.extended  # 2 ranks under torchrun: 10-30 s
def test_a_rank_killed_under_plain_torchrun_is_named_by_a_peer(corpus, tmp_path):
    """No meshtrain launcher to name it: the surviving rank does, in one line (torch's agent
    prints its own report after it)."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "meshtrain", *_flags(corpus, out, "--steps", "100000")],
        env=dict(os.environ, OMP_NUM_THREADS="1"), text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE)
    _wait_for_step(out, 2, proc)
    ranks = stopping.rank_processes(proc.pid)
    os.kill(ranks[1], signal.SIGKILL)
    code, err = _finish(proc)
    named = [line for line in err.splitlines() if line.startswith("meshtrain: rank 1")]
    assert code != 0 and named == [
        "meshtrain: rank 1 ended without a word (killed by a signal: SIGKILL or an out-of-memory"
        " kill); the other ranks stopped, the last complete checkpoint is kept"], err[-3000:]


_RAISING_RANK = textwrap.dedent("""
    import os, sys
    from meshtrain.cli.main import main
    from meshtrain.training.trainer import Trainer
    step = Trainer.train_step
    def failing(self, n):
        if n == 2 and os.environ["RANK"] == "1":
            raise RuntimeError("injected at step 2")
        return step(self, n)
    Trainer.train_step = failing
    sys.exit(main(sys.argv[1:]))
""")


@pytest.mark.extended  # 2 ranks under torchrun: 10-30 s
def test_a_rank_raising_under_plain_torchrun_is_one_line_naming_it(corpus, tmp_path):
    """The failed rank names itself and the cause once; its peer, whose collective failed,
    says nothing (torch's agent prints its own report after)."""
    script = tmp_path / "raising.py"
    script.write_text(_RAISING_RANK)
    result = run_torchrun(str(script), *_flags(corpus, tmp_path / "run"))
    line = ("meshtrain: error: rank 1: RuntimeError: injected at step 2 (rerun with --debug for"
            " the traceback)")  # (rank 0's progress line may run into it: no newline between)
    assert result.returncode != 0 and line in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("meshtrain: ") == 1, result.stderr[-3000:]


def test_ctrl_c_to_prepare_and_its_workers_is_one_line(tmp_path):
    """Ctrl-C reaches the whole process group: the workers leave it to the command, which ends
    them and its temporaries (each worker printed a traceback and the command hung)."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(f'{{"text": "{" ".join(["w" + str(i % 97)] * 4000)}"}}\n'
                            for i in range(2000)))
    out = tmp_path / "tokens" / "x.bin"
    proc = subprocess.Popen([sys.executable, "-m", "meshtrain", "prepare", *[str(docs)] * 20,
                             "--out", str(out), "--workers", "2"], start_new_session=True,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not list(out.parent.glob(".x.bin.tmp*")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)
    code, err = _finish(proc, timeout=60)
    lines = [line for line in err.replace("\r", "\n").splitlines() if not line.startswith(
        "prepare")]
    assert code == 3 and lines == [f"meshtrain: prepare stopped by SIGINT: nothing half-written"
                                   f" in {out}; run it again"], err[-3000:]
    assert list(out.parent.iterdir()) == []
