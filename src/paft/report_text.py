"""What a run's records say, in words: the text summary ``paft report`` prints and
puts in ``report.md`` (:func:`summary_text`), and the phrases the plots
(:mod:`paft.report`) take from it. The reading of the records it shares with the plots
(where the replicas split, the syncs, the guard's incidents) is
:mod:`paft.run_reading`'s."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from paft.records import UNTIMED_STEPS, is_leg_end, max_or_nan
from paft.replicas import outside_majority
from paft.resync import averages_at
from paft.run_reading import (
    Split,
    first_period,
    first_split,
    guard_incidents,
    is_steps,
    seen_from,
    series,
    split_syncs,
    sync_events,
)
from paft.rundata import RunData, is_number, number

__all__ = ["ranks_phrase", "run_settings", "summary_text"]


def ranks_phrase(ranks: Sequence[int]) -> str:
    """``rank 1`` / ``ranks 1, 3``."""
    return f"rank{_plural(ranks)} {', '.join(str(r) for r in ranks) if ranks else '?'}"


def _last_state_check(run: RunData) -> str:
    """What the last record with state fingerprints says (else the last gradient check):
    the state's split shows only at a fingerprint step, and outlives the steps between."""
    checked = [r for r in run.consistency if "replicas/state_distinct" in r]
    if checked:
        rec = checked[-1]
        ranks = rec.get("replicas/state_minority_ranks") or []
        differ = f"; minority: {ranks_phrase(ranks)}" if ranks else ""
        n = rec["replicas/state_distinct"]
        # A sync or repair that no fingerprint has seen yet (a run that stopped without its
        # summary, a library run) synchronized the replicas after the check: what it found
        # is the check's, what holds now the sync's, until split aggregated gradients.
        unseen = [e for e in sync_events(run) if seen_from(e) > rec["step"]]
        synced, after = "", rec["step"]
        if unseen:
            e = unseen[-1]
            synced = f"; synchronized since, by the {e['event']} at step {e['step']}"
            # Its first update from synchronized replicas: the step after a blocking sync's,
            # the step an overlapped one landed in (recorded at the step it started after),
            # the recompute of a repaired step.
            after = max(after, min(seen_from(e), int(e["step"]) + 1))
        # An aggregated gradient that differed after the check split the replicas since:
        # the check's own step's too, whose update follows the fingerprints of the state
        # it starts from.
        later = [r["step"] for r in run.consistency
                 if r["step"] >= after and number(r.get("replicas/grad_distinct", 1)) > 1]
        since = f"; aggregated gradients differed after it, first at step {later[0]}" if later else ""
        return f"replicas distinct at the last state check (step {rec['step']}): {n}{differ}{synced}{since}"
    rec = run.consistency[-1]
    return (f"distinct aggregated gradients at the last recorded step ({rec['step']}): "
            f"{rec.get('replicas/grad_distinct', '?')} (no state fingerprint recorded)")


def _extreme(run: RunData, key: str, pick_max: bool) -> str:
    steps, values = series(run.consistency, key)
    if not steps:
        return "not recorded"
    bad = [(s, v) for s, v in zip(steps, values) if not math.isfinite(v)]
    if bad:
        return f"{bad[0][1]} at step {bad[0][0]} (non-finite at {len(bad)} step{_plural(bad)})"
    # The first step holding the extreme, for a max as for a min.
    value, step = max(zip(values, steps), key=lambda p: (p[0], -p[1])) if pick_max else min(zip(values, steps))
    return f"{value:.4g} at step {step}"


def _counts(records: list[dict[str, Any]], key: str, prefix: str = "") -> str:
    counts = Counter(r.get(key, "?") for r in records)
    # Ranks in their order (rank 2 before rank 10), other values by their text.
    order = sorted(counts, key=lambda k: (not isinstance(k, int), k if isinstance(k, int) else 0, str(k)))
    return ", ".join(f"{prefix}{k} ({counts[k]})" for k in order)


def summary_text(run: RunData, files: Sequence[Path] = ()) -> str:
    """The plain-text summary of a run (what ``paft report`` prints); ``files``: what the
    report writes, listed on its last line."""
    split = first_split(run)  # two lines read it, and finding it goes through every record
    lines = [f"paft report: {run.path}", *_notes(run), *_header(run), *_losses(run), _speed(run),
             *_replicas(run), *_unfingerprinted(run), *_faults(run), _first_split_line(run, split),
             *_differing_tensors(run, split), _counters(run), *_repairs(run), *_detections(run),
             *_metric_extremes(run),
             _alerts(run)]
    if files:
        folder = Path(files[0]).parent
        lines.append(f"report in {folder}: {', '.join(Path(f).name for f in files)}")
    return "\n".join(lines) + "\n"


def _notes(run: RunData) -> list[str]:
    """Why the run ended early, or why its summary is missing or behind its records."""
    cfg, last = run.config, run.last_step + 1
    ends = _leg_ends(run)
    lines = _leg_end_notes(run, ends)
    if run.stale_summary is not None:
        went = "go on to" if last > run.stale_summary else "stop at"  # stop: resumed from an earlier checkpoint
        lines.append(f"note: summary.json ends at step {run.stale_summary} but the records {went} step "
                     f"{last} (a resume still running or interrupted): reported from the jsonl files "
                     f"({_of_steps(cfg, last)} steps recorded)")
    # A leg's end past the records (a guard's stop, a failure, a signal) says why there is
    # none; one a resume went on past does not (a library run has no summary.json).
    elif run.summary is None and not run.library and not any(e.get("step", 0) > run.last_step for e in ends):
        lines.append(f"note: no summary.json: the run is still running, crashed or was interrupted; reported "
                     f"from the jsonl files ({_of_steps(cfg, last)} steps recorded)")
    if (cfg.get("monitor") or {}).get("enabled") is False and run.consistency:
        # config.json is the last leg's: a resume with --no-monitor left the plots and
        # extremes of the earlier legs' records, which say nothing of the steps after them.
        end = max(int(r["step"]) for r in run.consistency)
        lines.append(f"note: monitoring is off (--no-monitor, as the last leg ran); consistency.jsonl holds "
                     f"an earlier leg's records, up to step {end}")
    missing = [r for r in range(run.world_size) if r not in run.metrics]
    if missing:
        files = ", ".join(f"metrics/rank{r}.jsonl" for r in missing)
        lines.append(f"note: no complete record in {files} (missing or empty): the loss plot lacks "
                     f"{ranks_phrase(missing)}, and its global loss is the mean over the ranks recorded")
    return lines


def _is_stop(event: dict[str, Any]) -> bool:
    """Whether a leg's end (:func:`_leg_ends`) is the guard's stop."""
    return event.get("event") in ("stop", "guard")


def _leg_ends(run: RunData) -> list[dict[str, Any]]:
    """The records of why a leg of the run ended (:func:`paft.records.is_leg_end`), in the
    file's order (the order the legs ended). paft train records a guard stop twice, the
    guard's verdict and the trainer's "stop" event with its reason; a library user's run
    has the verdict only. One of them either way."""
    trainer_stops = bool(run.events_of("stop"))
    return [e for e in run.events if is_leg_end(e) and not (trainer_stops and e.get("event") == "guard")]


def _leg_end_notes(run: RunData, ends: list[dict[str, Any]]) -> list[str]:
    """A note per distinct end: a resume that ended again where its leg did, and as it did
    (the guard's stop at the same step), is said once, with how often."""
    said: dict[str, list[dict[str, Any]]] = {}
    for end in ends:
        said.setdefault(_leg_end(run, end), []).append(end)
    lines = []
    for line, alike in said.items():
        end, step = alike[0], alike[0].get("step", 0)
        if len(alike) > 1:
            resumes = "a resume" if len(alike) == 2 else f"{len(alike) - 1} resumes"
            verb = {"failed": "failed", "interrupted": "was interrupted"}.get(str(end.get("event")), "stopped")
            line += f"; {resumes} {verb} there again"
        # The step it ended at is not recorded: a record of it is the run gone on (a resume
        # re-did it, or a library user caught the guard's stop and stepped on).
        if run.last_step >= step:
            line += (f"; the run went on after it, to step {run.last_step}" if _is_stop(end)
                     else f"; resumed, the run went on to step {run.last_step}")
        lines.append(line)
    return lines


def _leg_end(run: RunData, end: dict[str, Any]) -> str:
    """The note of one leg's end, without what came after it."""
    step = end.get("step")
    if end.get("event") == "failed":  # paft train's launcher's; under torchrun each failed rank's
        where = " (its traceback is in events.jsonl)" if end.get("traceback") else ""  # none from a killed rank
        return f"note: the run failed at step {step}: rank {end.get('rank')} {end.get('cause')}{where}"
    if end.get("event") == "interrupted":  # paft train's launcher's
        sig = end.get("signal")
        what = "Ctrl-C" if sig == "SIGINT" else sig or "a signal"
        return f"note: the run was interrupted at step {step} ({what})"
    reason = end.get("reason") or f"a persistent fault on {ranks_phrase(end.get('ranks') or [])}"
    reason = reason.removeprefix(f"step {step}: ")  # said once, before it
    # The policy as its user set it (a library user, GuardConfig's field), unless the trainer's reason says it.
    named = "on_persistent='stop'" if run.library else "--on-persistent stop"
    policy = "" if named in reason else f" ({named})"
    return f"note: the guard stopped the run at step {step}{policy}: {reason}"


def _of_steps(cfg: dict[str, Any], steps: int) -> str:
    """``steps`` of the run's ``--steps``; alone past it: an interrupted resume with more
    ``--steps`` leaves config.json as its last checkpoint's, with the fewer."""
    planned = cfg.get("steps")
    if planned is None:
        return f"{steps} of ?"
    return f"{steps} of {planned}" if planned >= steps else str(steps)


def _header(run: RunData) -> list[str]:
    if run.library:  # no config.json: its settings are not recorded, and no guess is made
        monitored = len(run.metrics[0])  # each record holds every rank's loss
        return ["library run (paft.protect's RunRecorder, no config.json): drawn from consistency.jsonl, the loss "
                "at monitored steps only; the run's settings are not recorded",
                f"world size: {run.world_size}   monitored steps: {monitored}, the last at step {run.last_step}"]
    said = run_settings(run)
    return ["   ".join(f"{name}: {said[name]}" for name in names)
            for names in (("workload", "world size", "steps", "optimizer"), ("protection", "guard", "injected"))]


def run_settings(run: RunData) -> dict[str, str]:
    """A ``paft train`` run's settings as the report states them (name -> value)."""
    s, cfg = run.summary or {}, run.config
    return {
        "workload": str(s.get("workload", cfg.get("workload", "?"))),
        "world size": str(run.world_size),
        "steps": _of_steps(cfg, s.get("steps", run.last_step + 1)),
        "optimizer": str(cfg.get("optimizer", "?")),
        "protection": str(s.get("protect", (cfg.get("protect") or {}).get("mode", "none"))),
        "guard": "on" if s.get("guard", (cfg.get("guard") or {}).get("enabled", False)) else "off",
        "injected": "; ".join(cfg.get("inject") or []) or "none",
    }


def _losses(run: RunData) -> list[str]:
    """First and last evaluation (the worst rank's loss where it differs visibly)."""
    s = run.summary or {}
    first, final = (run.evals[0], run.evals[-1]) if run.evals else ({}, {})
    lines = []
    for key, name in (("val_loss", "val loss"), ("val_acc", "val acc")):
        a, b = s.get(f"initial_{key}", first.get(key)), s.get(f"final_{key}", final.get(key))
        if a is not None and b is not None:
            per_rank = [number(v) for v in final.get(f"{key}_per_rank", [])]
            worst = max_or_nan(per_rank) if per_rank else number(b)
            shown = f"{worst:.4f}" != f"{number(b):.4f}"  # a difference the line can show
            spread = f", worst rank {worst:.4f}" if key == "val_loss" and shown else ""
            start, end = first.get("step", 0), final.get("step", run.last_step + 1)
            if start == end:  # one evaluation so far (a run stopped before its second)
                lines.append(f"{name}: {number(b):.4f} (step {end}{spread}, the only evaluation)")
            else:
                lines.append(f"{name}: {number(a):.4f} (step {start}) -> {number(b):.4f} (step {end}{spread})")
    return lines


def _speed(run: RunData) -> str:
    s = run.summary or {}
    if "steps_per_s" in s:
        return f"speed: {s['steps_per_s']:.2f} steps/s ({number(s.get('wall_s')):.2f} s in training steps)"
    if run.library:
        return "speed: not recorded (a library run's records hold no step times)"
    # As the trainer times it (Trainer.step_rate): over the timed steps, which leave out
    # the first few of every leg (much slower), else over every step; the records say
    # which (those written before they did: the first leg's rule).
    rank, records = next(iter(run.metrics.items()))
    times = [(number(r.get("step_time")), r.get("timed", r["step"] >= UNTIMED_STEPS)) for r in records]
    wall = sum(t for t, _ in times if math.isfinite(t))
    timed = [t for t, on in times if on is True and math.isfinite(t)]
    steps, seconds = (len(timed), sum(timed)) if timed else (len(times), wall)
    return (f"speed: {steps / seconds:.2f} steps/s ({wall:.2f} s in training steps; rank {rank}'s step times)"
            if seconds > 0 else "speed: ?")


def _replicas(run: RunData) -> list[str]:
    """How many distinct replicas the run ended with, and whether they are finite: the
    divergence measured at an evaluation is inf exactly when a replica's parameters hold
    NaN/Inf (see DivergenceReport), which bitwise identical replicas can share."""
    s = run.summary or {}
    if "replicas_distinct" in s:
        diff = number(s.get("max_replica_rel_diff"))
        # One group, yet infinitely apart: every replica holds the same NaN/Inf.
        bad = ": identical but non-finite, every replica holds NaN/Inf in its parameters" if (
            s["replicas_distinct"] == 1 and math.isinf(diff)) else ""
        return [f"replicas distinct at the end: {s['replicas_distinct']} (groups {s.get('replica_groups', '?')}, "
                f"largest relative L2 distance to their mean {diff:.3g}){bad}"]
    last = run.evals[-1] if run.evals else {}
    bad = (f"; the last evaluation (step {last['step']}) found NaN/Inf in a replica's parameters"
           if math.isinf(number(last.get("replica_rel_diff"))) else "")
    return [_last_state_check(run) + bad] if run.consistency else []


def _unfingerprinted(run: RunData, shown: int = 5) -> list[str]:
    """With --fingerprint-every 0 no state fingerprint says whether the replicas' state
    split: what the syncs and repairs found of it (they compare it whole), where any ran."""
    if (run.config.get("monitor") or {}).get("fingerprint_every") != 0 or not _checksums_kept(run):
        return []
    checked = [r["step"] for r in run.consistency if "replicas/state_distinct" in r]
    only = f", but at the guard's state checks (step{_plural(checked)} {_listed(checked, shown)})" if checked else ""
    apart = split_syncs(run)
    same = [int(e["step"]) for e in sync_events(run) if e not in apart]
    found = []
    if same:
        found.append(f"identical at step{_plural(same)} {_listed(same, shown)}")
    if apart:
        found.append("apart at " + _listed([f"step {e['step']} (groups {e['groups']})" for e in apart], shown))
    said = (f"the syncs found it {' and '.join(found)}" if found else
            "no sync compared it: a split shows only through the aggregated-gradient checksums")
    return [f"training state: not fingerprinted while training (--fingerprint-every 0){only}; {said}"]


def _checksums_kept(run: RunData) -> bool:
    """Whether ``consistency.jsonl`` would hold every step whose aggregated gradients split:
    it holds checksums, or the monitor was on and wrote records (a step whose update the
    loss scaler skipped keeps no checksum), or had nothing else to record
    (--monitor-interval 0 --fingerprint-every 0), so that a run whose gradients never
    split has no record at all (its report said "not recorded"). A monitor that records
    at intervals writes records whatever happens: none means they were lost."""
    monitor = run.config.get("monitor") or {}
    return any("replicas/grad_distinct" in r for r in run.consistency) or monitor.get("enabled") is True and (
        bool(run.consistency) or (monitor.get("interval") == 0 and monitor.get("fingerprint_every") == 0))


def _plural(items: Sequence[Any]) -> str:
    return "s" if len(items) > 1 else ""


def _listed(items: Sequence[Any], shown: int, total: int | None = None) -> str:
    """``4, 8, 12`` / ``4, 8 and 3 more``: the first ``shown`` of ``items``, and how many
    of ``total`` (default: all of ``items``) they leave out."""
    listed = items[:shown]
    more = (len(items) if total is None else total) - len(listed)
    return ", ".join(str(s) for s in listed) + (f" and {more} more" if more > 0 else "")


def _faults(run: RunData) -> list[str]:
    lines = [f"faults injected: {int((run.summary or {}).get('faults_injected', len(run.faults)))}"]
    if run.faults:
        lines.append(f"  by site: {_counts(run.faults, 'site')}")
        lines.append(f"  by kind: {_counts(run.faults, 'kind')}")
        lines.append(f"  by rank: {_counts(run.faults, 'rank', 'rank ')}")
        bits = [b for f in run.faults for b in (f.get("bits") or []) if isinstance(b, int)]
        if bits:
            # A record lists the bits of the first elements it hit only (RECORD_VALUES):
            # with count= or fraction= the counts below are of those.
            hit = sum(max(f["num_elements"], len(f["bits"])) if isinstance(f.get("num_elements"), int)
                      else len(f["bits"]) for f in run.faults if f.get("bits"))
            of = f" (the {len(bits)} elements recorded of {hit} hit)" if hit > len(bits) else ""
            lines.append(f"  by bit{of}: {_counts([{'bit': b} for b in bits], 'bit')}")
        f0 = min(run.faults, key=lambda f: f.get("step", 0))
        lines.append(f"  first: step {f0.get('step')}, rank {f0.get('rank')}, {f0.get('site')}/{f0.get('kind')}")
        lines.extend(_values_hit(run.faults))
    return lines


def _values_hit(faults: list[dict[str, Any]]) -> list[str]:
    """What the faults made of the values they hit (``before`` / ``after``, the first
    RECORD_VALUES of each): how many turned NaN/Inf and the largest finite value one
    left, so that faults a guard let pass can be seen to have stayed small."""
    hits = [(f, b, a) for f in faults for b, a in zip(f.get("before") or [], f.get("after") or [])
            if is_number(b) and is_number(a)]
    if not hits:
        return []
    nonfinite = sum(1 for _, b, a in hits if math.isfinite(b) and not math.isfinite(a))
    line = f"  values hit: {len(hits)} recorded, {nonfinite} made NaN/Inf"
    finite = [(f, b, a) for f, b, a in hits if math.isfinite(a)]
    if finite:
        f, b, a = max(finite, key=lambda hit: abs(hit[2]))
        line += f"; largest finite value after: {a:.4g} (was {b:.4g}; step {f.get('step')}, rank {f.get('rank')})"
    return [line]


def _first_split_line(run: RunData, split: Split | None) -> str:
    """The line on ``split``, the run's :func:`first_split`."""
    if split is not None:
        step, ranks, what, by = split
        # No ranks named: the guard found no strict majority to tell the odd ones out.
        tie = "; no strict majority" if not ranks or 2 * len(ranks) >= run.world_size else ""
        undone = {"guard": "; the guard caught it before the update",
                  "sync": "; found and repaired by the sync at this step, no fingerprint saw it before"}.get(by, "")
        where = f" on {ranks_phrase(ranks)}" if ranks else ""
        return f"first replica split: step {step}{where} ({' and '.join(what)} differ{tie}{undone})"
    if not _checksums_kept(run):
        return "first replica split: not recorded (no fingerprints in consistency.jsonl)"
    # The gradients' checksums are every step's; the training state's fingerprints only
    # every few steps: a fault at rest after the last one shows only at the end's check,
    # which a library run, or a run stopped before its summary, has not.
    checked = [int(r["step"]) for r in run.consistency if "replicas/state_distinct" in r]
    last = f"last at step {checked[-1]}" if checked else "never"
    end = number((run.summary or {}).get("replicas_distinct", math.nan))
    if end > 1:
        return (f"first replica split: after the last state check ({last}): the end of the run found "
                f"{int(end)} distinct replicas")
    late = sum(1 for f in run.faults if int(f.get("step", -1)) > (checked[-1] if checked else -1))
    if end == 1 and not checked:  # --fingerprint-every 0: a split of the state alone may have come and gone
        before = f", {late} fault{'s' if late > 1 else ''} injected before" if late else ""
        return ("first replica split: none seen (aggregated gradients identical at every recorded step; the "
                f"training state fingerprinted only at the end, one replica there{before})")
    if end == 1 or (checked and checked[-1] == run.last_step):
        return "first replica split: none (replicas identical at every recorded step)"
    unchecked = f", {late} fault{'s' if late > 1 else ''} injected after it" if late else ""
    return ("first replica split: none seen (aggregated gradients identical at every recorded step; the "
            f"training state fingerprinted {last}{unchecked})")


def _differing_tensors(run: RunData, split: Split | None, shown: int = 4) -> list[str]:
    """The tensors the replicas first differed in, where a record names them: the first
    sync or repair that found the parameters or optimizer state split (the syncs
    exchange per-tensor digests), or, earlier, the monitor's first state-split alert
    (the tensors farthest apart, measured after that step's update). ``split``: the
    run's :func:`first_split`."""
    found: list[tuple[int, int, str]] = []  # (step, the sync's exact names first, the line)
    for e in split_syncs(run):
        named: dict[str, list[list[int]]] = e.get("differing") or {}
        if not named:
            continue
        parts = []
        # Parameters and optimizer state first: the buffers (BatchNorm's statistics) differ
        # under DDP as a rule.
        for name, groups in sorted(named.items(), key=lambda item: item[0].startswith("buffer/"))[:shown]:
            odd = outside_majority(groups, run.world_size)
            parts.append(f"{name} on {ranks_phrase(odd)}" if odd else f"{name} (no strict majority: {groups})")
        listed = _listed(parts, shown, total=int(e.get("differing_tensors", len(named))))
        found.append((int(e["step"]), 0, f"as the {e['event']} at step {e['step']} found them: {listed}"))
        break
    for a in run.events_of("alert"):
        divergence = (a.get("divergence") or {}) if a.get("detector") == "state_split" else {}
        moved = divergence.get("tensors")
        if moved:
            # The ranks tied farthest (records before that named one: an int).
            parts = [f"{name} on {ranks_phrase(ranks if isinstance(ranks, list) else [ranks])} "
                     f"(relative distance {number(rel):.3g} to the mean)" for name, rel, ranks in moved]
            found.append((int(a["step"]), 1, f"farthest apart at the state-split alert of step {a['step']}: "
                                             f"{_listed(parts, shown, total=divergence.get('moved_tensors'))}"))
            break
    if not found:
        return []
    # A first split the guard undid at its step (a recompute) left the state whole: what a
    # later record found split is another incident's.
    step, _, line = min(found)
    later = split is not None and split[3] == "guard" and step != split[0]
    return [f"  tensors that differed{' (a later split: the guard undid the first)' if later else ''}, {line}"]


def _counters(run: RunData) -> str:
    """Syncs and the guard's counts: the summary's, else the guard's own counts, which
    each of its events carries; a run recorded before they did is counted from the
    events (an incident's first attempt that made the guard act is one detection; a
    repair is followed by a recompute)."""
    s = run.summary or {}
    guards = run.events_of("guard")
    totals = _guard_totals(run) or {
        "detections": len({g.get("step") for g in guard_incidents(run)}),
        "recomputes": sum(1 for g in guards if g.get("action") in ("recompute", "repair")),
        "skipped_batches": sum(1 for g in guards if g.get("action") == "skip"),
    }
    counts = {
        "syncs": s.get("syncs", _recorded_syncs(run)),
        "detections": s.get("detections", totals.get("detections", 0)),
        "recomputes": s.get("recomputes", totals.get("recomputes", 0)),
        "skipped batches": s.get("skipped_batches", totals.get("skipped_batches", 0)),
    }
    return "   ".join(f"{k}: {v}" for k, v in counts.items())


def _guard_totals(run: RunData) -> dict[str, Any]:
    """The guard's running counts, which each of its events carries: the last one's
    ({} from runs recorded before events carried them); not a stop's that a resume went
    on past (kept, :func:`paft.records.is_leg_end`): its counts hold the steps re-done."""
    return next((g["totals"] for g in reversed(run.events_of("guard")) if isinstance(g.get("totals"), dict)
                 and not (is_leg_end(g) and run.last_step >= g.get("step", 0))), {})


def _repairs(run: RunData) -> list[str]:
    """The syncs that found the replicas apart (each leaves them identical): when, how
    they merged, who stood outside the majority, and the largest divergence found."""
    splits = split_syncs(run)
    if not splits:
        return []
    outside = [{"rank": r} for e in splits for r in outside_majority(e["groups"], run.world_size)]
    line = (f"  syncs that found the replicas apart: {len(splits)} (step{_plural(splits)} "
            f"{_listed([e['step'] for e in splits], 8)}), merged by {_counts(splits, 'mode')}")
    if outside:
        line += f"; outside the majority: {_counts(outside, 'rank', 'rank ')}"
    found = [e for e in splits if is_number(e.get("divergence")) and math.isfinite(number(e["divergence"]))]
    if found:
        worst = max(found, key=lambda e: number(e["divergence"]))
        line += f"; largest divergence {number(worst['divergence']):.3g} (step {worst['step']})"
    return [line]


def _detections(run: RunData) -> list[str]:
    """The guard's incidents: which detectors fired, the ranks they flagged, and the
    causes its reruns settled on (its running totals, in every guard event)."""
    incidents = guard_incidents(run)
    if not incidents:
        return []
    line = f"  guard detections: {_counts(incidents, 'detector')}"
    flagged = [{"rank": r} for g in incidents for r in g.get("ranks") or []]
    if flagged:
        line += f"; flagged {_counts(flagged, 'rank', 'rank ')}"
    totals = _guard_totals(run)
    causes = [f"{c} ({totals[c]})" for c in ("transient", "persistent", "data", "state") if totals.get(c)]
    if causes:
        line += f"; causes: {', '.join(causes)}"
    return [line]


def _recorded_syncs(run: RunData) -> int:
    """The syncs and repairs of a run without a summary. events.jsonl holds each of
    PAFT-Sync's and the guard's, but none of PyTorch's averager: its averages are
    counted from the recorded steps (a step one rank recorded had its averaging
    all-reduce done), at the steps :func:`paft.resync.averages_at` says it averages, by
    the period in force at each: ``config.json``'s is the last leg's, and a resume that
    changed it recorded a ``period`` event (with the one the run began with)."""
    protect = run.config.get("protect") or {}
    if protect.get("mode") != "averager":
        return len(sync_events(run))
    changes = sorted((e["step"], e["period"]) for e in run.events_of("period")
                     if is_steps(e.get("step"), 0) and is_steps(e.get("period")))
    periods = [(0, first_period(run) if changes else protect.get("sync_period")), *changes]
    if not all(is_steps(p) for _, p in periods):
        return len(sync_events(run))
    averaged = sum(1 for step in range(run.last_step + 1)
                   if averages_at(step, next(p for s, p in reversed(periods) if s <= step)))
    return len(sync_events(run)) + averaged


def _metric_extremes(run: RunData) -> list[str]:
    """The largest loss CV and smallest cosine, or why they are missing (one reason for both)."""
    if (run.config.get("monitor") or {}).get("interval") == 0:
        why = "worker metrics off: --monitor-interval 0"
    elif run.consistency:
        why = "a cosine needs 2 ranks" if run.world_size < 2 else "cosine monitoring off"
    elif (run.path / "consistency.jsonl").is_file():
        why = "consistency.jsonl holds no complete record"
    else:
        why = "no consistency.jsonl: monitoring off"
    loss_cv = _extreme(run, "consistency/loss_cv", True)
    cos_min = _extreme(run, "consistency/grad_cos_min", False)
    return [f"max loss_cv: {loss_cv}{f' ({why})' if loss_cv == 'not recorded' else ''}",
            f"min grad_cos_min: {cos_min}{f' ({why})' if cos_min == 'not recorded' else ''}"]


def _alerts(run: RunData) -> str:
    alerts = run.events_of("alert")
    detail = f" ({_counts(alerts, 'detector')})" if alerts else ""
    return f"alerts: {(run.summary or {}).get('alerts', len(alerts))}{detail}"
