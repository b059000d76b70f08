"""Checkpoints are trusted only once verified whole: each damage to a copy of one small run's
checkpoint is refused by export (both formats), sample, --resume and --init-from with one line
naming the file and the problem. Also: old checkpoints without a record, leftovers of killed
saves, --keep-last retention, a full disk during a save, and export --out checks."""

import hashlib
import json
import re
import shutil
import tomllib
from pathlib import Path

import pytest
from harness import run_on_ranks, worker_mesh
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from meshtrain import ParallelMesh, preset
from meshtrain.checkpointing import checkpoint as ckpt
from meshtrain.checkpointing.checkpoint import CheckpointError, latest_checkpoint, read_manifest
from meshtrain.checkpointing.model_files import write_model_checkpoint
from meshtrain.checkpointing.retention import keep_newest
from meshtrain.cli.main import main
from meshtrain.config.run_config import build_config
from meshtrain.operations.failures import EXIT_FAILED, RunFailure
from meshtrain.parallelize import build_model
from meshtrain.training.trainer import Trainer

TRAIN = ["--device", "cpu", "--seq-len", "16", "--global-batch", "2", "--micro-batch", "2",
         "--steps", "4", "--save-every", "1", "--eval-every", "0"]
EMBEDDING = "model/embedding.word.weight"


@pytest.fixture(scope="module")
def made_run(corpus, tmp_path_factory) -> Path:
    """A 1-rank run stopped after step 2: checkpoints step_00000001 and step_00000002."""
    run = tmp_path_factory.mktemp("made") / "run"
    assert main(["train", *TRAIN, "--stop-at", "2", "--data", corpus, "--out", str(run)]) == 0
    return run


@pytest.fixture()
def run(made_run, tmp_path) -> Path:
    """A copy of the run to damage."""
    return Path(shutil.copytree(made_run, tmp_path / "run", symlinks=True))


def _latest(run: Path) -> Path:
    return run / "checkpoints" / "step_00000002"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _recommit(ck: Path, name: str) -> None:
    """Record `name`'s new digest in digests.json, as an editor covering its tracks would."""
    record = json.loads((ck / "digests.json").read_text())
    record["files"][name] = _sha(ck / name)
    (ck / "digests.json").write_text(json.dumps(record))


def _edit_manifest(ck: Path, edit) -> None:
    manifest = json.loads((ck / "manifest.json").read_text())
    edit(manifest)
    (ck / "manifest.json").write_text(json.dumps(manifest))
    _recommit(ck, "manifest.json")


def _edit_pieces(ck: Path, edit) -> None:
    _edit_manifest(ck, lambda m: edit(m["tensors"][EMBEDDING]))


def _rows(ck: Path) -> int:
    return json.loads((ck / "manifest.json").read_text())["tensors"][EMBEDDING]["shape"][0]


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _rewrite(ck: Path, name: str, text: str) -> None:
    (ck / name).write_text(text)
    _recommit(ck, name)


def _link_outside(ck: Path) -> None:
    """The rank file replaced by a link to an identical file elsewhere (its digest matches)."""
    outside = ck.parent.parent.parent / "outside.safetensors"
    shutil.move(ck / "rank_00000.safetensors", outside)
    (ck / "rank_00000.safetensors").symlink_to(outside)


def _latest_elsewhere(ck: Path) -> None:
    run = ck.parent.parent
    shutil.copytree(run, run.parent / "other")
    (run / "checkpoints" / "latest").write_text("../../other/checkpoints/step_00000002")


def _rng_of_another_rank(ck: Path) -> None:
    """Rank 0's RNG states filed under rank 1, every digest recommitted."""
    tensors = load_file(str(ck / RANK))
    save_file({k.replace("rng/0/", "rng/1/"): v for k, v in tensors.items()}, str(ck / RANK))
    _edit_manifest(ck, lambda m: m["files"].update({RANK: _sha(ck / RANK)}))
    _recommit(ck, RANK)


def _rng_of_another_size(ck: Path) -> None:
    """A rank file whose first RNG state lost its last byte, every digest recommitted (as a
    writer with a bug would commit it)."""
    tensors = load_file(str(ck / RANK))
    key = min(k for k in tensors if k.startswith("rng/"))
    save_file({**tensors, key: tensors[key][:-1].clone()}, str(ck / RANK))
    _edit_manifest(ck, lambda m: m["files"].update({RANK: _sha(ck / RANK)}))
    _recommit(ck, RANK)


def _named_another_step(ck: Path) -> None:
    """step_00000002 renamed step_00000003, and `latest` naming it."""
    ck.rename(ck.with_name("step_00000003"))
    (ck.parent / "latest").write_text("step_00000003")


RANK = "rank_00000.safetensors"
DAMAGE = {  # case: (damage to the latest checkpoint, file named, problem named), as patterns
    "manifest-digest": (lambda ck: (ck / "manifest.json").write_text(
        (ck / "manifest.json").read_text() + " "), "manifest.json", "corrupt or truncated"),
    "train-state-digest": (lambda ck: (ck / "train_state.json").write_text('{"step": 9}'),
                           "train_state.json", "corrupt or truncated"),
    "config-digest": (lambda ck: (ck / "config.toml").write_text("[train]\nsteps = 9\n"),
                      "config.toml", "corrupt or truncated"),
    "rank-file-digest": (lambda ck: _flip(ck / RANK), RANK, "corrupt or truncated"),
    "rng-of-another-rank": (_rng_of_another_rank, RANK, "rng/1/.* is not rank 0's RNG state"),
    "rng-of-another-size": (_rng_of_another_size, RANK, r"rng/0/.* holds 5055 bytes, not the"
                                                        " 5056 of a generator's state on cpu"),
    "named-another-step": (_named_another_step, "manifest.json", "records step 2, but the"
                                                                 " directory is named"
                                                                 " step_00000003"),
    "missing-file": (lambda ck: (ck / RANK).unlink(), RANK, "missing"),
    "truncated-file": (lambda ck: (ck / RANK).write_bytes((ck / RANK).read_bytes()[:5000]),
                       RANK, "corrupt or truncated"),
    "missing-record": (lambda ck: (ck / "digests.json").unlink(), "digests.json", "missing"),
    "record-invalid-json": (lambda ck: (ck / "digests.json").write_text("{oops"),
                            "digests.json", "not valid JSON"),
    "manifest-invalid-json": (lambda ck: _rewrite(ck, "manifest.json", "{oops"),
                              "manifest.json", "not valid JSON"),
    "train-state-invalid-json": (lambda ck: _rewrite(ck, "train_state.json", "{oops"),
                                 "train_state.json", "not valid JSON"),
    "files-dotdot": (lambda ck: _edit_manifest(ck, lambda m: m["files"].update(
        {"../step_00000001/" + RANK: "0" * 64})), "manifest.json", "not a plain file name"),
    "files-absolute": (lambda ck: _edit_manifest(ck, lambda m: m["files"].update(
        {"/etc/passwd": "0" * 64})), "manifest.json", "not a plain file name"),
    "files-separator": (lambda ck: _edit_manifest(ck, lambda m: m["files"].update(
        {"sub/" + RANK: "0" * 64})), "manifest.json", "not a plain file name"),
    "record-dotdot": (lambda ck: _edit_record_name(ck, "../../x"), "digests.json",
                      "not a plain file name"),
    "piece-dotdot": (lambda ck: _edit_pieces(ck, lambda e: e["pieces"][0].update(
        file="../step_00000001/" + RANK)), "manifest.json", "not a plain file name"),
    "piece-absolute": (lambda ck: _edit_pieces(ck, lambda e: e["pieces"][0].update(
        file="/etc/passwd")), "manifest.json", "not a plain file name"),
    "link-leaving": (_link_outside, RANK, "a link leaving the checkpoint directory"),
    "overlapping-pieces": (lambda ck: _edit_pieces(ck, lambda e: e["pieces"].append(
        {**e["pieces"][0], "key": "other", "offset": 8, "length": 8})), "manifest.json",
        f"pieces of {EMBEDDING} overlap at rows 8..16"),
    "gap": (lambda ck: _edit_pieces(ck, lambda e: e["pieces"][0].update(
        length=e["shape"][0] - 3)), "manifest.json", f"rows 253..256 of {EMBEDDING} are in no"
                                                     r" piece \(a gap\)"),
    "piece-out-of-range": (lambda ck: _edit_pieces(ck, lambda e: e["pieces"][0].update(
        length=e["shape"][0] + 5)), "manifest.json", "spans rows 0..261, out of range"),
    "dtype-edit": (lambda ck: _edit_pieces(ck, lambda e: e.update(dtype="float16")), RANK,
                   "is F32 there, but manifest.json records float16"),
    "unknown-dtype": (lambda ck: _edit_pieces(ck, lambda e: e.update(dtype="float128")),
                      "manifest.json", "has dtype 'float128', not one of"),
    # (--init-from reads the metadata alone first: the parameter count refuses it there)
    "shape-edit": (lambda ck: _edit_pieces(ck, lambda e: e.update(shape=[e["shape"][0], 65])),
                   f"{RANK}|manifest.json", r"has shape \[256, 64\] there, but manifest.json's"
                   r" .* needs \[256, 65\]|model settings make 232832 parameters, its model"
                   " tensors hold 233088"),
    "missing-key": (lambda ck: _edit_pieces(ck, lambda e: e["pieces"][0].update(key="nope")),
                    RANK, "has no tensor nope"),
    "model-settings-edit": (lambda ck: _edit_manifest(ck, lambda m: m["model"].update(
        hidden_size=4096)), "manifest.json", "its model settings make .* parameters, its model"
                                            " tensors hold 232832"),
    "model-settings-type": (lambda ck: _edit_manifest(ck, lambda m: m["model"].update(
        hidden_size="64")), "manifest.json", "its model settings do not load \\(hidden_size is"
                                             " '64', not int\\); the checkpoint is damaged"),
    "model-settings-layers": (lambda ck: _edit_manifest(ck, lambda m: m["model"].update(
        num_layers=3)), "manifest.json", r"do not load \(num_layers 3, but tensors of \d+\);"),
}


def _edit_record_name(ck: Path, name: str) -> None:
    record = json.loads((ck / "digests.json").read_text())
    record["files"][name] = "0" * 64
    (ck / "digests.json").write_text(json.dumps(record))


def _refusals(run: Path, corpus: str, capsys) -> list[str]:
    """The one line each of export (both formats), sample, --resume and --init-from prints for
    `run`; nothing is written."""
    out = run.parent
    commands = [["export", str(run), "--out", str(out / "m.safetensors")],
                ["export", str(run), "--format", "hf", "--out", str(out / "hf")],
                ["sample", str(run), "--device", "cpu"],
                ["train", *TRAIN, "--data", corpus, "--out", str(run), "--resume"],
                ["train", *TRAIN, "--data", corpus, "--out", str(out / "new"),
                 "--init-from", str(run)]]
    lines = []
    for argv in commands:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("meshtrain: error: "), err
        lines.append(err)
    written = {"m.safetensors", ".m.safetensors.tmp", "hf", ".hf.tmp"}
    assert not written & {p.name for p in out.iterdir()}
    return lines


@pytest.mark.parametrize("case", DAMAGE)
def test_damage_is_refused_in_one_line(case, run, corpus, capsys):
    damage, file, problem = DAMAGE[case]
    damage(_latest(run))
    for line in _refusals(run, corpus, capsys):
        assert re.search(file, line) and re.search(problem, line), line


@pytest.mark.parametrize("pointer", ["missing", "elsewhere", "newest-damaged"])
def test_resume_takes_the_newest_complete_checkpoint_when_latest_is_lost(pointer, run, corpus,
                                                                          capsys):
    latest = run / "checkpoints" / "latest"
    if pointer == "missing":
        latest.unlink()
    elif pointer == "elsewhere":
        _latest_elsewhere(_latest(run))
        assert main(["export", str(run), "--out", str(run.parent / "m.safetensors")]) == 2
        assert "not a step_NNNNNNNN directory" in capsys.readouterr().err  # export: refused
    else:
        latest.write_text("garbage")
        _flip(_latest(run) / RANK)
    rows = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(rows + [json.dumps({"step": 3, "loss": 9.0})]))
    assert main(["train", *TRAIN, "--data", corpus, "--out", str(run), "--resume"]) == 0
    resumed = "step_00000001" if pointer == "newest-damaged" else "step_00000002"
    why = "missing" if pointer == "missing" else "damaged"
    assert (f"meshtrain: {latest} was {why}: resuming from {resumed}, the newest complete"
            " checkpoint (the latest pointer now names it)") in capsys.readouterr().err
    step = int(resumed[5:])
    aside = run / f"metrics.after_step_{step}.jsonl"
    assert [json.loads(line)["step"] for line in aside.read_text().splitlines()] == \
        [*range(step + 1, 3), 3]  # the interrupted run's later rows, kept
    assert latest.read_text() == "step_00000004"


def test_a_finished_run_names_its_settings_and_is_not_trained_over(made_run, corpus, capsys):
    saved = tomllib.loads((made_run / "config.toml").read_text())
    assert (saved["model"]["model"], saved["model"]["vocab_size"], saved["parallel"]["dp"],
            saved["train"]["steps"]) == ("tiny", 256, 1, 4)  # what the run decided, too
    capsys.readouterr()  # an earlier run in --out without --resume: refused, nothing written
    assert main(["train", *TRAIN, "--data", corpus, "--out", str(made_run)]) == 2
    refused = capsys.readouterr().err
    assert "holds an earlier run" in refused and len(refused.strip().splitlines()) == 1


def test_a_resumed_run_carries_its_saved_settings(run, corpus, capsys):
    """`--resume` alone continues the run as it was set up (its steps, schedule, data,
    precision, model shape): only what a flag gives changes, and that is announced."""
    saved = tomllib.loads((run / "config.toml").read_text())
    assert (saved["model"]["num_layers"], saved["model"]["hidden_size"]) == (4, 64)  # resolved
    assert main(["train", "--out", str(run), "--resume", "--lr", "0.001"]) == 0
    said = capsys.readouterr().err
    resumed = tomllib.loads((run / "config.toml").read_text())
    kept = {k: v for k, v in saved["train"].items() if k != "stop_at"}  # this command's own
    assert resumed["train"] | {"lr": 0.003} == kept  # steps, batch, seq_len, ...: carried
    assert (resumed["data"], resumed["model"]) == (saved["data"], saved["model"])
    assert "--lr changed from 0.003 to 0.001 on resume" in said
    assert "changed from the checkpoint's settings" not in said  # lr has its own line
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 4


def _train_config_of(*flags: str):
    from meshtrain.cli.main import _train_config
    from meshtrain.cli.parsers import build_parser

    return _train_config(build_parser().parse_args(["train", *flags]))


def test_the_saved_layout_is_carried_unless_a_degree_or_nproc_is_given(run, corpus):
    config = run / "checkpoints" / "step_00000002" / "config.toml"
    text = config.read_text().replace("tp = 1\n", "tp = 2\n").replace("zero = 0\n", "zero = 1\n")
    config.write_text(text.replace('precision = "fp32"', 'precision = "bf16"'))
    out = ["--out", str(run)]
    carried = _train_config_of(*out, "--auto-resume")
    assert (carried.plan.tp, carried.plan.zero, carried.plan.precision) == (2, 1, "bf16")
    assert carried.train.steps == 4 and carried.data.data == corpus
    for flag in (["--nproc", "2"], ["--dp", "2"], ["--pp", "1"]):
        resharded = _train_config_of(*out, "--resume", *flag)
        assert (resharded.plan.tp, resharded.plan.zero) == (1, 0), flag  # layout: defaults
        assert resharded.plan.precision == "bf16" and resharded.train.steps == 4  # the rest
    flagged = _train_config_of(*out, "--resume", "--steps", "9", "--precision", "fp32")
    assert (flagged.train.steps, flagged.plan.precision, flagged.plan.tp) == (9, "fp32", 2)
    fresh = _train_config_of("--out", str(run))  # no resume: nothing carried
    assert (fresh.plan.tp, fresh.train.steps) == (1, 300)


def _old_format(ck: Path) -> None:
    """What a checkpoint written before the record looked like: no digests.json, and a
    manifest without `record`."""
    (ck / "digests.json").unlink()
    manifest = json.loads((ck / "manifest.json").read_text())
    del manifest["record"]
    (ck / "manifest.json").write_text(json.dumps(manifest, indent=1))


def test_checkpoint_without_record_still_loads(run, made_run, capsys):
    ck = _latest(run)
    _old_format(ck)
    cfg = read_manifest(_latest(made_run))  # the same model, verified by its record
    assert read_manifest(ck)["tensors"] == cfg["tensors"]
    assert main(["export", str(run), "--out", str(run.parent / "old.safetensors")]) == 0
    assert main(["export", str(made_run), "--out", str(run.parent / "new.safetensors")]) == 0
    assert (run.parent / "old.safetensors").read_bytes() == \
        (run.parent / "new.safetensors").read_bytes()
    _flip(ck / RANK)  # its rank files are still checked against the manifest's digests
    with pytest.raises(CheckpointError, match=f"{RANK}: corrupt or truncated .checksum mismatch"
                                              " with manifest.json"):
        read_manifest(ck)
    capsys.readouterr()


def test_leftovers_go_and_keep_last_keeps_the_newest(run, corpus):
    """A resumed run saving steps 3 and 4 with --keep-last 2: what killed saves left is removed
    by the first save; older checkpoints go, other files stay."""
    root = run / "checkpoints"
    (root / ".tmp_step_00000003").mkdir()
    (root / ".tmp_step_00000003" / RANK).write_bytes(b"half a file")
    (root / ".latest.tmp").write_text("step_00000003")
    (root / "notes.txt").write_text("mine")
    (root / "step_0000000x").mkdir()
    assert main(["train", *TRAIN, "--data", corpus, "--out", str(run), "--resume",
                 "--keep-last", "2"]) == 0
    assert sorted(p.name for p in root.iterdir()) == [
        "latest", "notes.txt", "step_00000003", "step_00000004", "step_0000000x"]
    assert latest_checkpoint(root).name == "step_00000004"
    read_manifest(root / "step_00000003")


def test_keep_newest_never_deletes_latest_or_other_files(tmp_path):
    for name in ("step_00000001", "step_00000002", "step_00000002.1", "step_00000003"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")
    (tmp_path / "step_00000009").mkdir()  # no manifest: not a complete checkpoint
    (tmp_path / "step_00000000").write_text("a file")
    (tmp_path / "latest").write_text("step_00000001")
    assert keep_newest(tmp_path, 0) == []
    assert keep_newest(tmp_path, 2) == ["step_00000002"]  # step_N.1 is newer than step_N
    assert keep_newest(tmp_path, 1) == ["step_00000002.1"]  # never the one `latest` names
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest", "step_00000000", "step_00000001", "step_00000003", "step_00000009"]


def test_import_writes_the_record_and_removes_leftovers(tmp_path):
    root = tmp_path / "checkpoints"
    (root / ".tmp_step_00000000").mkdir(parents=True)
    (root / ".latest.tmp").write_text("x")
    cfg = preset("tiny", num_layers=1, hidden_size=8, num_heads=2, vocab_size=4, max_seq_len=4)
    model = build_model(cfg, ParallelMesh.local(), seed=0)
    planned = [(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]
    path = write_model_checkpoint(root, family="gpt", cfg=cfg, planned=planned,
                                  tensors=((n, p.detach()) for n, p in model.named_parameters()),
                                  config_toml="# imported\n")
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000000"]
    record = json.loads((path / "digests.json").read_text())["files"]
    assert sorted(record) == sorted(p.name for p in path.iterdir() if p.name != "digests.json")
    assert read_manifest(path, cfg)["step"] == 0


def test_keep_last_must_not_be_negative(corpus, tmp_path, capsys):
    assert main(["train", *TRAIN, "--data", corpus, "--out", str(tmp_path / "r"),
                 "--keep-last", "-1"]) == 2
    assert "--keep-last must be >= 0" in capsys.readouterr().err


def _save_on_a_full_disk(corpus: str, out: str) -> str:
    """Rank 1's rank file meets a full disk (safetensors raises its own error type, as it
    does for ENOSPC); then a save that works removes the failed save's leftovers."""
    cfg = build_config({}, {"train": {"global_batch": 4, "micro_batch": 2, "seq_len": 16},
                            "parallel": {"device": "cpu"}, "data": {"data": corpus},
                            "checkpoint": {"out": out}})
    mesh = worker_mesh(dp=2)
    trainer = Trainer.build(cfg, mesh)
    real = ckpt.save_file

    def full_disk(tensors, path):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind:'
                              ' StorageFull, message: "No space left on device" })')

    ckpt.save_file = full_disk if mesh.rank == 1 else real
    try:
        with pytest.raises(RunFailure) as failed:
            trainer.save(Path(out), 1)
    finally:
        ckpt.save_file = real
    left = sorted(p.name for p in (Path(out) / "checkpoints").iterdir())
    trainer.save(Path(out), 1)
    return str(failed.value), failed.value.exit_code, failed.value.agreed, left


def test_full_disk_during_a_save_is_one_agreed_line(corpus, tmp_path):
    """Simulated (safetensors' own error type); test_full_disk.py fills a real filesystem.
    A failed write is exit 1 on every rank, agreed (rank 0 alone prints it), and with no
    checkpoint saved before it the line names none."""
    results = run_on_ranks(2, _save_on_a_full_disk, corpus, str(tmp_path), timeout=90)
    (line, code, agreed, left), (_, peer_code, peer_agreed, _) = results
    assert (code, agreed) == (peer_code, peer_agreed) == (EXIT_FAILED, True)
    assert len(line.splitlines()) == 1
    assert "failed on rank 1 (writing rank_00001.safetensors: Error while serializing" in line
    assert "No space left on device" in line and "no checkpoint of this run was saved" in line
    assert left == [".tmp_step_00000001"]
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001"]
    read_manifest(root / "step_00000001")


def _export(capsys, *argv: str, code: int = 2) -> str:
    assert main(["export", *argv]) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_export_out_is_checked(made_run, tmp_path, capsys, monkeypatch):
    run = str(made_run)
    (tmp_path / "dir").mkdir()
    assert "--out " + str(tmp_path / "dir") + " is a directory" in \
        _export(capsys, run, "--out", str(tmp_path / "dir"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    assert "exists and is not empty" in \
        _export(capsys, run, "--format", "hf", "--out", str(tmp_path / "full"))
    (tmp_path / "file").write_text("mine")
    assert "is a file" in _export(capsys, run, "--format", "hf", "--out", str(tmp_path / "file"))
    for fmt in ("meshtrain", "hf"):  # (tests run as root: a read-only directory would not do)
        assert "cannot write there" in \
            _export(capsys, run, "--format", fmt, "--out", str(tmp_path / "file" / "sub"))
    assert (tmp_path / "file").read_text() == "mine"

    def disk_full_midway(path, manifest, **options):
        yield from list(real(path, manifest, **options))[:3]
        raise OSError(28, "No space left on device")

    from meshtrain.checkpointing import model_files
    from meshtrain.interop import hf_io

    real = model_files.model_tensors
    monkeypatch.setattr(model_files, "model_tensors", disk_full_midway)
    monkeypatch.setattr(hf_io, "model_tensors", disk_full_midway)
    for fmt, name in (("meshtrain", "m.safetensors"), ("hf", "hf")):  # a failed write: 1
        assert "No space left on device" in \
            _export(capsys, run, "--format", fmt, "--out", str(tmp_path / name), code=EXIT_FAILED)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file", "full"]
    assert list((tmp_path / "dir").iterdir()) == [] and \
        [p.name for p in (tmp_path / "full").iterdir()] == ["x"]


def _leaves(node, path=()):
    """Every (path, value) of a JSON document's scalars and empty containers."""
    items = node.items() if isinstance(node, dict) else enumerate(node) \
        if isinstance(node, list) else None
    if not items:
        yield path, node
        return
    for key, child in items:
        yield from _leaves(child, (*path, key))


def test_random_manifest_edits_with_the_record_rewritten_are_never_a_traceback(run, capsys):
    """A seeded fuzz (it was 900 ad-hoc trials): one leaf of manifest.json set to another kind
    of value, digests.json rewritten to match; `export` verifies it: exit 0 when the edit
    changes nothing it reads, else exit 2 and one line naming the problem, never an unexpected
    error (`rerun with --debug`)."""
    import random

    rng = random.Random(56)
    ck = _latest(run)
    original = (ck / "manifest.json").read_text()
    leaves = list(_leaves(json.loads(original)))
    odd = [None, -1, 0, 2**70, 1.5, float("nan"), "", "x", "../x", [], {}, True, [1, "a"]]
    refused = 0
    for trial in range(40):
        where, _ = rng.choice(leaves)
        value = rng.choice(odd)

        def edit(manifest, where=where, value=value):
            node = manifest
            for key in where[:-1]:
                node = node[key]
            if where:
                node[where[-1]] = value

        (ck / "manifest.json").write_text(original)
        _edit_manifest(ck, edit)
        capsys.readouterr()
        out = run.parent / f"m{trial}.safetensors"
        code = main(["export", str(run), "--out", str(out)])
        err = capsys.readouterr().err
        assert code in (0, 2) and "--debug" not in err, (where, value, err)
        assert code == 0 or len(err.strip().splitlines()) == 1, (where, value, err)
        refused += code == 2
    assert refused >= 20  # most edits are damage the verification names
