"""The scale-out run's analysis: each stream put on the hosts of its first attempt, the figures
and the done-when checks of ``bench/scaleout.py``, and its printed table."""

from __future__ import annotations

import collections

from load import percentile

KILLED_COORDINATOR = "coord1"
KILLED = ("web1", KILLED_COORDINATOR)  # the hosts SIGKILLed mid-run
SURVIVING = {"web": "web2", "coordinator": "coord2"}


def analyse(
    result: dict, checked: dict, log: list[dict], taken: dict[str, str], kills: dict, in_flight: int, marked_down
) -> dict:
    """Each stream put on the hosts of its first attempt, and the figures of the run."""
    first_server: dict[str, str] = {}
    for entry in log:
        first_server.setdefault(entry["key"], entry["srv"])
    jobs = checked["jobs"]
    rows = [stream_row(stream, jobs, first_server, taken) for stream in result["streams"]]
    surviving = [r for r in rows if not r["killed_host"]]
    on_killed = [r for r in rows if r["killed_host"]]
    disrupted = [r for r in surviving if r["attempts"] > 1 or r["first"] != "ok"]
    interrupted = [r for r in on_killed if r["first"] != "ok"]
    failed = [r for r in rows if r["final"] != "ok"]
    five_xx = server_errors(result, log)
    from_survivor = sum(count for where, count in five_xx.items() if where.endswith(SURVIVING["web"]))
    recovery = [r["completed_at"] - r["first_failed_at"] for r in interrupted if r["completed_at"]]
    coordinator_cut = [r for r in interrupted if r["coordinator"] == KILLED_COORDINATOR and r["web"] not in KILLED]
    detection = [r["first_failed_at"] - kills[KILLED_COORDINATOR] for r in coordinator_cut]
    ledger = checked["ledger"]
    wall = result["ended_at"] - result["started_at"]
    tokens = sum(r["completion_tokens"] for r in rows)
    figures = {
        "streams": len(rows),
        "streams_in_flight_at_kill": in_flight,
        "completed_first_time": sum(1 for r in rows if r["first"] == "ok"),
        "completed_on_retry": sum(1 for r in rows if r["first"] != "ok" and r["final"] == "ok"),
        "failed": len(failed),
        "on_surviving_hosts": len(surviving),
        "surviving_disrupted": len(disrupted),
        "on_killed_hosts": len(on_killed),
        "killed_host_interrupted": len(interrupted),
        "interrupted_by_error": dict(collections.Counter(r["first_code"] or r["first"] for r in interrupted)),
        "interrupted_not_retry_safe": sum(1 for r in interrupted if not r["retry_safe"]),
        "streams_by_hosts": dict(collections.Counter(f"{r['web']}+{r['coordinator']}" for r in rows)),
        "jobs_unstarted_on_killed_coordinator": sum(1 for r in rows if r["unstarted"]),
        "attempts_histogram": dict(collections.Counter(str(r["attempts"]) for r in rows)),
        "5xx": dict(five_xx),
        "5xx_from_surviving_hosts": from_survivor,
        "recovery_s_p50": _rounded(percentile(recovery, 0.5)),
        "recovery_s_max": _rounded(max(recovery, default=None)),
        "coordinator_loss_error_after_s_p50": _rounded(percentile(detection, 0.5)),
        "coordinator_loss_error_after_s_max": _rounded(max(detection, default=None)),
        "lb_marked_web1_down_after_s": _rounded(marked_down - kills["web1"]) if marked_down else None,
        "ttft_first_attempt_p50_s": _rounded(percentile([r["ttft_s"] for r in rows if r["ttft_s"]], 0.5)),
        "completion_tokens": tokens,
        "wall_s": round(wall, 1),
        "tokens_per_s": round(tokens / wall, 1) if wall else None,
        "jobs": ledger["jobs"],
        "superseded_jobs": ledger["superseded_jobs"],
        "refunded_nano": ledger["refunded_nano"],
        "jobs_failed_coordinator_lost": sum(1 for j in jobs.values() if j["error_code"] == "coordinator_lost"),
    }
    done_when = {
        "streams on surviving hosts unaffected": bool(surviving) and not disrupted,
        "every stream on a killed host completes or ends in a retry-safe error whose retry completes": bool(interrupted)
        and not failed
        and figures["interrupted_not_retry_safe"] == 0,
        "no retry charged twice (each Idempotency-Key charged at most once)": ledger["keys_charged_twice"] == 0
        and ledger["exact"],
        "ledger exact": ledger["exact"],
        "0 5xx from surviving hosts": from_survivor == 0,
    }
    return {"figures": figures, "ledger": ledger, "done_when": done_when, "kills": kills, "streams": rows}


def stream_row(stream: dict, jobs: dict, first_server: dict[str, str], taken: dict[str, str]) -> dict:
    """A stream's hosts and outcome. Its web host: lb's X-Served-By on its first attempt, else the
    server lb's log names for its key first (an answer lb made itself, as a 502). Its coordinator
    host: the one its first job's record names, else the one whose log shows it started the job's
    task (a coordinator killed before it marked the job running), else, for a job no coordinator
    started, the killed one: the surviving coordinator logs every task it starts, so a task it
    never started was delivered to the killed one and went down with it (``unstarted``)."""
    attempts = stream["attempts"]
    first, final = attempts[0], attempts[-1]
    job_id = first["job"] or next((j for j, job in jobs.items() if job["request_id"] == first["request_id"]), None)
    web = first["served_by"] or first_server.get(stream["key"])
    coordinator = (jobs[job_id]["coordinator"] if job_id in jobs else None) or taken.get(job_id)
    unstarted = job_id in jobs and coordinator is None
    coordinator = KILLED_COORDINATOR if unstarted else coordinator
    completed = final["outcome"] == "ok"
    return {
        "key": stream["key"],
        "web": web,
        "coordinator": coordinator,
        "killed_host": web in KILLED or coordinator in KILLED,
        "unstarted": unstarted,
        "attempts": len(attempts),
        "first": first["outcome"],
        "first_code": first["code"],
        "final": final["outcome"],
        "retry_safe": all(attempt["retryable"] for attempt in attempts[:-1]),
        "ttft_s": first["first_token_at"] - first["sent_at"] if first["first_token_at"] else None,
        "first_failed_at": None if first["outcome"] == "ok" else first["ended_at"],
        "completed_at": final["ended_at"] if completed else None,
        "completion_tokens": final["usage"]["completion_tokens"] if completed else 0,
    }


def server_errors(result: dict, log: list[dict]) -> collections.Counter:
    """The 5xx answers, counted by who saw them (the client, lb's log) and the web host (or lb)."""
    counted: collections.Counter = collections.Counter()
    for stream in result["streams"]:
        for attempt in stream["attempts"]:
            if (attempt["status"] or 0) >= 500:
                counted[f"client saw, from {attempt['served_by'] or 'lb'}"] += 1
    for entry in log:
        if entry["status"].isdigit() and int(entry["status"]) >= 500:
            counted[f"lb log, {entry['srv']}"] += 1
    return counted


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def print_table(result: dict) -> None:
    figures = result["figures"]
    header = ("streams", "first time", "on retry", "failed", "surviving", "disrupted", "killed-host", "interrupted")
    print(" ".join(f"{name:>11}" for name in (*header, "5xx (web2)")))
    columns = ("streams", "completed_first_time", "completed_on_retry", "failed", "on_surviving_hosts")
    columns += ("surviving_disrupted", "on_killed_hosts", "killed_host_interrupted", "5xx_from_surviving_hosts")
    print(" ".join(f"{figures[name]:>11}" for name in columns))
    print(f"streams by web+coordinator host: {figures['streams_by_hosts']}")
    print(f"interrupted, by first error: {figures['interrupted_by_error']}; 5xx: {figures['5xx']}")
    print(
        f"recovery (first failure to completion) p50 {figures['recovery_s_p50']} s, max {figures['recovery_s_max']} s;"
        f" coordinator loss to error event p50 {figures['coordinator_loss_error_after_s_p50']} s, max "
        f"{figures['coordinator_loss_error_after_s_max']} s; lb marked web1 down after "
        f"{figures['lb_marked_web1_down_after_s']} s"
    )
    print(f"{figures['completion_tokens']} tokens in {figures['wall_s']} s ({figures['tokens_per_s']} tok/s)")
    ledger = result["ledger"]
    print(
        f"ledger: {ledger['jobs']} jobs, {ledger['superseded_jobs']} superseded, {ledger['refunded_nano']} nano-$ "
        f"refunded, {ledger['keys_charged_twice']} keys charged twice, exact {ledger['exact']} {ledger['problems']}"
    )
    for item, met in result["done_when"].items():
        print(f"  {'PASS' if met else 'MISS'}  {item}")
