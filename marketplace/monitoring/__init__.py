"""Operations endpoints: ``/metrics`` (Prometheus), ``/readyz`` (readiness) and ``/healthz`` (liveness),
and the middleware that counts HTTP requests. The series themselves are in ``marketplace.metrics``
(observed by the process) and ``collectors`` (read from the database and Redis at scrape time)."""
