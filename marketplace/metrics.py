"""The control plane's own Prometheus counters and histograms, observed where things happen: HTTP
requests (``marketplace.monitoring.middleware``) and job endings (``jobs.services.finish_job``).

What the database already knows (jobs in flight, nodes, placements, checks, strikes, the ledger)
is read at scrape time instead (``marketplace.monitoring.collectors``), so it is the same whichever
process answers ``/metrics``. These series live in the process that observed them:

* Without ``PROMETHEUS_MULTIPROC_DIR`` each process counts on its own. In the embedded default every
  job runs in the web process, so its ``/metrics`` shows them all; with several uvicorn workers or
  coordinators in Celery workers, a scrape sees only the process that answered it.
* With ``PROMETHEUS_MULTIPROC_DIR`` set (prometheus-client's multiprocess mode) every process (web
  and Celery workers alike) writes its samples to files in that directory and ``/metrics`` adds up
  the files of all of them. The directory must be shared by those processes and emptied when the
  whole deployment starts afresh; the files are named by host and process id, so containers that
  share it (each with its own pid 1) do not overwrite each other.

This module imports nothing of the project: any layer may record into it.
"""

from __future__ import annotations

import functools
import os
import socket
import sys

from prometheus_client import Counter, Histogram, values

MULTIPROC_DIR = os.environ.get("PROMETHEUS_MULTIPROC_DIR", "")
if MULTIPROC_DIR:
    os.makedirs(MULTIPROC_DIR, exist_ok=True)
    # Chosen before the first series below is made: each value keeps the class it was made with.
    values.ValueClass = values.MultiProcessValue(lambda: f"{socket.gethostname()}-{os.getpid()}")

HTTP_REQUESTS = Counter(
    "swarm_http_requests",
    "HTTP requests answered, by endpoint (the URL route, never the raw path), method and status",
    ["endpoint", "method", "status"],
)
HTTP_DURATION = Histogram(
    "swarm_http_request_duration_seconds",
    "Time from a request's arrival to the last byte of its answer (a streamed answer's whole stream)",
    ["endpoint", "method"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
)
JOBS_FINISHED = Counter("swarm_jobs_finished", "Jobs that ended, by model and final state", ["model", "state"])
JOB_TOKENS = Counter(
    "swarm_job_tokens",
    "Tokens of ended jobs, by model and kind (prompt, or completion tokens delivered to the client)",
    ["model", "kind"],
)
JOB_TTFT = Histogram(
    "swarm_job_ttft_seconds",
    "Time to first token of succeeded jobs, from the coordinator's start to the first token",
    ["model"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0),
)
JOB_TOKENS_PER_S = Histogram(
    "swarm_job_decode_tokens_per_second",
    "Decode rate of succeeded jobs (first to last token) in tokens per second",
    ["model"],
    buckets=(0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 50.0, 75.0, 100.0, 150.0, 250.0, 500.0),
)
SPECULATIVE_DRAFTED = Counter(
    "swarm_speculative_drafted_tokens", "Drafted tokens the pipeline verified, by model", ["model"]
)
SPECULATIVE_ACCEPTED = Counter(
    "swarm_speculative_accepted_tokens", "Drafted tokens accepted (committed as drafted), by model", ["model"]
)


def http_request(endpoint: str, method: str, status: int, seconds: float) -> None:
    HTTP_REQUESTS.labels(endpoint, method, str(status)).inc()
    HTTP_DURATION.labels(endpoint, method).observe(seconds)


def job_finished(
    model: str,
    state: str,
    *,
    prompt_tokens: int,
    completion_tokens: int,
    ttft_ms: float | None,
    tokens_per_s: float | None,
    drafted_tokens: int,
    accepted_tokens: int,
) -> None:
    """Count one job's end; its timings only when it measured them (a succeeded job)."""
    JOBS_FINISHED.labels(model, state).inc()
    JOB_TOKENS.labels(model, "prompt").inc(prompt_tokens)
    JOB_TOKENS.labels(model, "completion").inc(completion_tokens)
    if ttft_ms is not None:
        JOB_TTFT.labels(model).observe(ttft_ms / 1000)
    if tokens_per_s is not None:
        JOB_TOKENS_PER_S.labels(model).observe(tokens_per_s)
    SPECULATIVE_DRAFTED.labels(model).inc(drafted_tokens)
    SPECULATIVE_ACCEPTED.labels(model).inc(accepted_tokens)


MODEL_CPU_SECONDS = Counter(
    "swarm_model_cpu_seconds",
    "CPU seconds spent on the model (worker_agent.cpu: embed, head, sampling, drafting, replay), by the "
    "kind of process that spent them (process_kind) and part; the rest of a process's CPU is the "
    "control plane's own cost",
    ["process", "part"],
)


def process_kind(argv: list[str] | None = None) -> str:
    """What this process is in the deployment: ``SWARM_PROCESS_KIND`` if set, else read off its
    command line: web (uvicorn, daphne), coordinator (a Celery worker on a ``coord.*`` queue),
    verifier (the ``verify`` queue), worker (other queues), beat, or the program's name."""
    if os.environ.get("SWARM_PROCESS_KIND"):
        return os.environ["SWARM_PROCESS_KIND"]
    argv = sys.argv if argv is None else argv
    program = os.path.basename(argv[0]) if argv else ""
    if program in ("uvicorn", "daphne"):
        return "web"
    if program == "celery" or "celery" in argv[1:2]:
        if "beat" in argv:
            return "beat"
        queues = argv[argv.index("-Q") + 1] if "-Q" in argv[:-1] else "celery"
        if queues.startswith("coord."):
            return "coordinator"
        return "verifier" if queues == "verify" else "worker"
    return program or "python"


@functools.cache
def _this_process_kind() -> str:
    return process_kind()


def record_model_cpu(part: str, seconds: float) -> None:
    """A ``worker_agent.cpu`` listener: counts the model's CPU under this process's kind."""
    MODEL_CPU_SECONDS.labels(process=_this_process_kind(), part=part).inc(seconds)
