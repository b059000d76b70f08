"""What diverged in a hung run, from the ranks' flight-recorder dumps (`OUT/hang/rank_N.json`).

The verdict rules, most specific first:
1. two ranks of an axis issued different collectives (op, or shape/dtype where every rank's must
   agree) under the same sequence number: a mismatch, named with both ranks, ops and the axis;
2. a rank waits in a collective that a peer of its axis never reached (the peer's last sequence
   number on that axis is lower, or the peer left no dump: stopped, dead or holding the
   interpreter); a peer that is itself waiting elsewhere is a consequence, not the cause;
3. point-to-point calls (pipeline sends, ring attention) are matched by peer, not by number.
Ranks are named by global rank (`rank N`). `meshtrain doctor RUN_DIR` prints the same verdict as
the run did, with a short table of each rank's last collectives, then the ranks that straggler
detection named (`stragglers.summary`).
"""

from __future__ import annotations

import datetime
import json
import math
from pathlib import Path

from meshtrain.operations.stragglers import summary
from meshtrain.parallel.communication.flight_recorder import P2P_OPS

SESSION_WINDOW_S = 60.0  # dumps of one hang are written within seconds of each other
# equal on every rank
_SHAPED_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce")


def _number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and \
        math.isfinite(value) and abs(value) < 1e11  # a time within this era


def _count(value, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _entry_problem(e) -> str | None:
    if not isinstance(e, dict):
        return "an entry is not an object"
    if not all(isinstance(e.get(k), str) for k in ("axis", "op", "dtype")) or \
            not _count(e.get("seq"), 1) or not isinstance(e.get("shape"), list):
        return "an entry lacks its axis, number, op, shape or dtype"
    if not (e.get("peer") is None or _count(e.get("peer"))) or not all(
            e.get(k) is None or _number(e.get(k)) for k in ("issued", "blocked", "ended")):
        return "an entry's peer or times are not numbers"
    return None


def dump_problem(dump) -> str | None:
    """What makes `dump` (parsed JSON) unlike a flight-recorder dump; None when it is one."""
    if not isinstance(dump, dict):
        return "not a JSON object"
    if not (_count(dump.get("rank")) and _count(dump.get("world_size"), 1)
            and dump["rank"] < dump["world_size"]):
        return "no rank below a world size"
    if not _number(dump.get("time")) or not isinstance(dump.get("run"), str):
        return "no time or run"
    axes, seq = dump.get("axes"), dump.get("seq")
    if not isinstance(axes, dict) or not all(
            isinstance(r, list) and all(_count(x) for x in r) for r in axes.values()):
        return "its axes are not lists of ranks"
    if not isinstance(seq, dict) or not all(_count(n) for n in seq.values()):
        return "its sequence numbers are not counts"
    entries, waiting = dump.get("entries"), dump.get("waiting")
    if not isinstance(entries, list):
        return "its entries are not a list"
    problems = [_entry_problem(e) for e in [*entries, *([waiting] if waiting else [])]]
    if waiting is not None and problems[-1] is None and (
            not _number(waiting.get("waited_s")) or
            waiting["axis"] not in axes and waiting["op"] not in P2P_OPS):
        return "its wait has no duration or is on an axis it does not list"
    return next((p for p in problems if p), None)


def read_dumps(hang_dir: Path, *, since: float | None = None, run: str | None = None,
               damaged: dict | None = None) -> dict[int, dict]:
    """The dumps of one hang by global rank: those written at or after `since` (and of `run`),
    else those of the newest dump's run written within `SESSION_WINDOW_S` of it. Unreadable or
    malformed files are left out (one being written, too), each named in `damaged` if given."""
    dumps = []
    for path in sorted(Path(hang_dir).glob("rank_*.json")):
        try:
            dump = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError) as err:
            problem = f"not readable JSON ({type(err).__name__})"
        else:
            if (problem := dump_problem(dump)) is None:
                dumps.append(dump)
                continue
        if damaged is not None:
            damaged[path.name] = problem
    if since is None and dumps:
        newest = max(dumps, key=lambda d: d["time"])
        since, run = newest["time"] - SESSION_WINDOW_S, newest["run"]
    return {d["rank"]: d for d in dumps
            if d["time"] >= (since or 0) and (run is None or d["run"] == run)}


def _what(entry: dict) -> str:
    return f"{entry['op']} #{entry['seq']}"


def _call(entry: dict) -> str:
    """The op with its shape and dtype (what must agree across ranks)."""
    if entry["dtype"] == "object":
        return entry["op"]
    return f"{entry['op']} {entry['shape']} {entry['dtype']}"


def _ago(dump: dict, t: float | None) -> str:
    return "" if t is None else f" {dump['time'] - t:.1f} s before its dump"


def _state(rank: int, dump: dict) -> str:
    """Where `rank` is: waiting in a call, or past its last completed one."""
    waiting = dump.get("waiting")
    if waiting:
        return (f"rank {rank} is waiting in {_what(waiting)} on axis {waiting['axis']}"
                f" ({waiting['waited_s']:.1f} s)")
    done = [e for e in dump["entries"] if e["ended"] is not None]
    if not done:
        return f"rank {rank} completed no collective"
    last = done[-1]
    return (f"it last completed {_what(last)} on axis {last['axis']}"
            f"{_ago(dump, last['ended'])}")


def _compare(rank: int, dump: dict, peer: int, dumps: dict[int, dict]) -> tuple | None:
    """A finding (priority, culprit, text) about `peer` for the call `rank` waits in, or
    None when the two agree."""
    w, other = dump["waiting"], dumps.get(peer)
    where = f"on axis {w['axis']}"
    if other is None:
        return (1, peer, f"rank {peer} never completed {_what(w)} {where} and left no dump"
                         f" (stopped, dead or holding the interpreter); rank {rank} waited"
                         f" {w['waited_s']:.1f} s for it")
    blocked = 3 if other.get("waiting") else 1  # a waiting peer is a consequence
    if w["op"] in P2P_OPS:
        theirs = other.get("waiting")
        if theirs and theirs["op"] in P2P_OPS and theirs["peer"] == rank:
            return (0, min(rank, peer), f"rank {rank} waits in {_what(w)} {where} for rank"
                                        f" {peer}, which waits in {_what(theirs)} on axis"
                                        f" {theirs['axis']} for rank {rank}")
        return (blocked, peer, f"rank {peer} never answered {_what(w)} {where} of rank {rank};"
                               f" {_state(peer, other)}")
    theirs = next((e for e in other["entries"]
                   if e["axis"] == w["axis"] and e["seq"] == w["seq"]), None)
    if theirs is None:
        if other["seq"].get(w["axis"], 0) >= w["seq"]:
            return None  # it went past; the ring no longer holds it
        return (blocked, peer, f"rank {peer} never reached {_what(w)} {where}; "
                               f"{_state(peer, other)}")
    shaped = w["op"] in _SHAPED_OPS
    if theirs["op"] != w["op"] or theirs["dtype"] != w["dtype"] or (
            shaped and theirs["shape"] != w["shape"]):
        first, second = sorted([(rank, w), (peer, theirs)], key=lambda pair: pair[0])
        return (0, first[0], f"rank {first[0]} issued {_call(first[1])} and rank {second[0]}"
                             f" issued {_call(second[1])} as collective #{w['seq']} {where}")
    return None


def verdict(dumps: dict[int, dict]) -> str:
    """One sentence naming what diverged (see the module docstring for the rules)."""
    findings = []
    for rank, dump in sorted(dumps.items()):
        w = dump.get("waiting")
        if not w:
            continue
        peers = [w["peer"]] if w["op"] in P2P_OPS else dump["axes"][w["axis"]]
        for peer in peers:
            found = _compare(rank, dump, peer, dumps) if peer != rank else None
            if found:
                priority, culprit, text = found
                findings.append((priority, culprit, w["blocked"], text))
    if findings:  # the most specific; the same culprit: the wait that began first
        return min(findings)[3]
    waiting = {rank: d["waiting"] for rank, d in sorted(dumps.items()) if d.get("waiting")}
    if waiting:
        rank, w = next(iter(waiting.items()))
        return (f"rank {rank} waits in {_what(w)} on axis {w['axis']} and every rank of the axis"
                " that dumped reached it with the same call: the wait is inside the backend"
                " (network or device)")
    return "no rank was waiting in a collective when the dumps were written"


def hang_line(dumps: dict[int, dict], out: Path) -> str:
    """The one line a hung run ends with."""
    return (f"meshtrain: hang: {verdict(dumps)}; dumps of ranks {_ranks(dumps)} in {out / 'hang'}"
            f" (meshtrain doctor {out})")


def _ranks(dumps: dict[int, dict]) -> str:
    return ", ".join(str(rank) for rank in sorted(dumps))


def table(dumps: dict[int, dict], last: int = 4) -> list[str]:
    """Each rank's last collectives, one line each: axis, number, op, shape, state."""
    lines = [f"{'rank':>4}  {'axis':<8} {'#':>5}  {'op':<17} {'shape':<16} {'dtype':<9} state"]
    for rank, dump in sorted(dumps.items()):
        for e in dump["entries"][-last:]:
            state = "done" if e["ended"] is not None else (
                f"waiting {dump['time'] - e['blocked']:.1f} s" if e["blocked"] else "in flight")
            lines.append(f"{rank:>4}  {e['axis']:<8} {e['seq']:>5}  {e['op']:<17}"
                         f" {str(e['shape']):<16} {e['dtype']:<9} {state}")
    return lines


def doctor(run_dir: str | Path) -> tuple[int, list[str]]:
    """(exit code, lines) of `meshtrain doctor RUN_DIR`: 0 with the verdict and the stragglers
    summary (`stragglers.summary`, from metrics.jsonl), 2 with neither to say."""
    run_dir = Path(run_dir)
    code, lines = _hang(run_dir)
    stragglers = summary(run_dir)
    if code and stragglers:  # no hang to diagnose: the stragglers alone
        return 0, stragglers
    return code, lines + stragglers


def _hang(run_dir: Path) -> tuple[int, list[str]]:
    """The hang's verdict and table (0), or the one line saying why there is none (2)."""
    damaged = {}
    dumps = read_dumps(run_dir / "hang", damaged=damaged)
    skipped = "; ".join(f"{name}: {problem}" for name, problem in damaged.items())
    if not dumps and damaged:
        return 2, [f"meshtrain: no readable hang dump in {run_dir / 'hang'} ({skipped}): the"
                   " files are damaged; rerun the hung run to dump again"]
    if not dumps:
        return 2, [f"meshtrain: no hang dumps in {run_dir / 'hang'}: the run did not hang (or"
                   " ran without a watchdog); nothing to diagnose"]
    when = datetime.datetime.fromtimestamp(max(d["time"] for d in dumps.values()))
    world = max(d["world_size"] for d in dumps.values())
    missing = sorted(set(range(world)) - set(dumps))
    head = [hang_line(dumps, run_dir),
            f"dumped at {when:%Y-%m-%d %H:%M:%S} by {len(dumps)} of {world} ranks"
            + (f"; no dump from rank {', '.join(map(str, missing))}" if missing else "")]
    skipped_line = [f"skipped damaged dumps: {skipped}"] if damaged else []
    return 0, head + skipped_line + table(dumps)
