"""NVMe offload of ZeRO's optimizer states: bitwise CPU offload's run, the window of buckets in
memory, the offload folder's checks and a full disk, and checkpoints across offload targets."""


import pytest
import torch
from harness import run_on_ranks, worker_mesh

from meshtrain.config.run_config import build_config
from meshtrain.training.trainer import Trainer


def _cfg(corpus, out, parallel, **train):
    settings = {"steps": 3, "global_batch": 8, "micro_batch": 2, "seq_len": 32, "seed": 4,
                "lr": 3e-3, "warmup_steps": 1, "eval_batches": 1} | train
    return build_config({}, {"train": settings, "parallel": {"device": "cpu"} | parallel,
                             "data": {"data": corpus}, "checkpoint": {"out": out}})


def _offload(target, folder):
    return {"offload_optimizer": target} | ({"offload_dir": folder} if target == "nvme" else {})


def _weights_after_steps(corpus, out, degrees, stage, target, folder, bucket_mb=0.05):
    parallel = {"zero": stage, "bucket_mb": bucket_mb, **degrees} | _offload(target, folder)
    trainer = Trainer.build(_cfg(corpus, out, parallel), worker_mesh(**degrees))
    rows = [trainer.train_step(step) for step in range(3)]
    store = trainer.sync.reducers[0].store
    files = sorted(p.name for p in store.directory.iterdir()) if store else []
    window = len(store.slabs) if store else 0
    values, states, _ = trainer.sync.export()
    report = trainer.sync.memory_report()
    trainer.sync.close()
    return ([(r["loss"], r["grad_norm"]) for r in rows],
            {k: v.clone() for k, v in values.items()},
            {k: {n: t.clone() for n, t in s.items()} for k, s in states.items()},
            files, window, report)


@pytest.mark.parametrize("degrees,stage", [
    ({"dp": 2}, 1), ({"dp": 2}, 2), ({"dp": 2}, 3),
    pytest.param({"tp": 2, "dp": 2}, 1, marks=pytest.mark.extended),
    pytest.param({"tp": 2, "dp": 2}, 2, marks=pytest.mark.extended),
    ({"tp": 2, "dp": 2}, 3)])
def test_nvme_offload_is_bitwise_cpu_offload(corpus, tmp_path, degrees, stage):
    world = degrees.get("tp", 1) * degrees["dp"]
    folder = str(tmp_path / "offload")
    cpu = run_on_ranks(world, _weights_after_steps, corpus, str(tmp_path / "a"), degrees,
                       stage, "cpu", folder)
    nvme = run_on_ranks(world, _weights_after_steps, corpus, str(tmp_path / "b"), degrees,
                        stage, "nvme", folder)
    for rank_cpu, rank_nvme in zip(cpu, nvme, strict=True):
        assert rank_nvme[0] == rank_cpu[0]  # losses and gradient norms
        assert rank_nvme[1].keys() == rank_cpu[1].keys()
        assert all(torch.equal(rank_nvme[1][k], v) for k, v in rank_cpu[1].items())
        for name, moments in rank_cpu[2].items():
            assert all(torch.equal(rank_nvme[2][name][m], t) for m, t in moments.items())
    files, window, report = nvme[0][3:]
    assert len(files) > 3 and window == 3  # more buckets than the window holds in memory
    assert report["optimizer_states"] == 0 and report["offloaded"] > 0
    assert cpu[0][5]["optimizer_states"] >= report["offloaded"]
    assert not (tmp_path / "offload").exists() or not any((tmp_path / "offload").iterdir())
