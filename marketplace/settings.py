# Over 500 lines: the one settings module, grouped by subsystem, so that every setting is read in one place.
"""Settings, driven by environment variables (every one in docs/operations.md's table).

Embedded default: SQLite, the in-memory channel layer, Celery tasks run eagerly in-process and
periodic sweeps run in the web process. Production: DATABASE_URL (PostgreSQL) and REDIS_URL
(channel layer, Celery broker, cache) switch to the real services.
"""

from __future__ import annotations

import os
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from marketplace.conf import env_bool, env_float, env_int, env_list, env_str
from marketplace.logs import LOG_FORMATS, LOG_LEVELS, logging_config
from marketplace.periodic import beat_schedule

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(env_str("SWARM_DATA_DIR", str(BASE_DIR / ".data")))

# --- core -------------------------------------------------------------------------------
# The one production switch: a real secret key is required, DEBUG must be off, and cookies,
# HTTPS and HSTS are locked down (see "security" below).
PRODUCTION = env_bool("SWARM_PRODUCTION", False)
DEBUG = env_bool("DJANGO_DEBUG", False)
INSECURE_DEFAULT_SECRET_KEY = "insecure-embedded-default-key-change-me"
SECRET_KEY = env_str("DJANGO_SECRET_KEY", "")
if PRODUCTION:
    if not SECRET_KEY or SECRET_KEY == INSECURE_DEFAULT_SECRET_KEY or SECRET_KEY.startswith("django-insecure"):
        raise ImproperlyConfigured("SWARM_PRODUCTION=1 needs DJANGO_SECRET_KEY set to a secret of your own")
    if len(SECRET_KEY) < 32:
        raise ImproperlyConfigured("SWARM_PRODUCTION=1 needs a DJANGO_SECRET_KEY of at least 32 characters")
    if DEBUG:
        raise ImproperlyConfigured("SWARM_PRODUCTION=1 refuses DJANGO_DEBUG=1")
if not SECRET_KEY:
    if not DEBUG and env_bool("SWARM_REQUIRE_SECRET_KEY", False):
        raise ImproperlyConfigured("DJANGO_SECRET_KEY must be set in production")
    SECRET_KEY = INSECURE_DEFAULT_SECRET_KEY
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS", [])

# --- security -----------------------------------------------------------------------------
# Behind SWARM_PRODUCTION: cookies only over HTTPS, plain HTTP redirected (/healthz and /readyz
# excepted, for health checks), HSTS. Behind a proxy that ends TLS, SWARM_PROXY_SSL_HEADER=1 trusts its
# X-Forwarded-Proto header to say the request was HTTPS.
SESSION_COOKIE_SECURE = PRODUCTION
CSRF_COOKIE_SECURE = PRODUCTION
SESSION_COOKIE_HTTPONLY = True
SECURE_SSL_REDIRECT = env_bool("SWARM_SSL_REDIRECT", PRODUCTION)
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$"]
SECURE_HSTS_SECONDS = env_int("SWARM_HSTS_SECONDS", 31_536_000 if PRODUCTION else 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = PRODUCTION
SECURE_CONTENT_TYPE_NOSNIFF = True
if env_bool("SWARM_PROXY_SSL_HEADER", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

# --- accounts -------------------------------------------------------------------------------
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {
        "NAME": "django.contrib.auth.password_validation.MinimumLengthValidator",
        "OPTIONS": {"min_length": env_int("SWARM_PASSWORD_MIN_LENGTH", 10, minimum=8)},
    },
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
# Failed sign-ins (the login form and HTTP basic auth of the API alike), counted in the cache per
# username and client address and per address: past either limit within a window of
# SWARM_LOGIN_WINDOW_S, sign-ins from there are refused (429, or the form's error) until it ends.
SWARM_LOGIN_FAILURES_PER_USER = env_int("SWARM_LOGIN_FAILURES_PER_USER", 5, minimum=1)
SWARM_LOGIN_FAILURES_PER_ADDRESS = env_int("SWARM_LOGIN_FAILURES_PER_ADDRESS", 50, minimum=1)
SWARM_LOGIN_WINDOW_S = env_int("SWARM_LOGIN_WINDOW_S", 300, minimum=1)
# Password reset emails one client address may ask for within a window of SWARM_LOGIN_WINDOW_S:
# nobody's inbox is flooded from the reset form.
SWARM_PASSWORD_RESETS_PER_ADDRESS = env_int("SWARM_PASSWORD_RESETS_PER_ADDRESS", 5, minimum=1)
# A password reset link works once, for this long.
PASSWORD_RESET_TIMEOUT = env_int("SWARM_PASSWORD_RESET_TIMEOUT_S", 3600, minimum=60)

# --- email: password resets and notices ---------------------------------------------------------
# Sent through SMTP once EMAIL_HOST names a server; printed to the web process's output otherwise
# (the embedded default and the demo: the reset link is in its log).
EMAIL_HOST = env_str("EMAIL_HOST", "")
EMAIL_PORT = env_int("EMAIL_PORT", 587, minimum=1)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD", "")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", True)
EMAIL_TIMEOUT = 30
EMAIL_BACKEND = env_str(
    "SWARM_EMAIL_BACKEND",
    "django.core.mail.backends.smtp.EmailBackend" if EMAIL_HOST else "django.core.mail.backends.console.EmailBackend",
)
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "Swarm <no-reply@localhost>")

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django_htmx",
    "django_celery_beat",
    "channels",
    "marketplace.accounts",
    "marketplace.nodes",
    "marketplace.placement",
    "marketplace.jobs",
    "marketplace.billing",
    "marketplace.api",
    "marketplace.web",
    "marketplace.verification",
    "marketplace.payouts",
    "marketplace.install",
    "marketplace.catalog",
]

# The inference API's (/v1/...: bearer keys, no sessions, cookies, CSRF or messages), which the ASGI
# app serves with these alone (``marketplace.asgi.InferenceHandler``); the rest add the dashboards'.
INFERENCE_MIDDLEWARE = [
    "marketplace.monitoring.middleware.http_metrics",  # first: it sees the status that went out
    "marketplace.logs.RequestIdMiddleware",  # names the request (x-request-id) in every line logged from here in
    "marketplace.middleware.SecurityMiddleware",  # Django's, on the event loop (``marketplace.middleware``)
]
MIDDLEWARE = [
    *INFERENCE_MIDDLEWARE,
    "django.contrib.sessions.middleware.SessionMiddleware",
    "marketplace.middleware.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "marketplace.middleware.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
]

ROOT_URLCONF = "marketplace.urls"
ASGI_APPLICATION = "marketplace.asgi.application"
AUTH_USER_MODEL = "accounts.User"
LOGIN_URL = "accounts:login"
LOGIN_REDIRECT_URL = "accounts:home"
LOGOUT_REDIRECT_URL = "accounts:login"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "frontend" / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "frontend" / "static"]
STATIC_ROOT = DATA_DIR / "static"
# The ASGI app serves /static/ itself (from the apps' and frontend's folders, no collectstatic
# needed), so the dashboards work under uvicorn with DEBUG off; turn it off where a proxy or CDN
# serves the collected files from STATIC_ROOT instead.
SWARM_SERVE_STATIC = env_bool("SWARM_SERVE_STATIC", True)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"

# Migrations live in the top-level migrations/ package.
MIGRATION_MODULES = {
    app: f"migrations.{app}"
    for app in ("accounts", "nodes", "placement", "jobs", "billing", "verification", "payouts", "catalog")
}

# --- database -----------------------------------------------------------------------------
DATABASE_URL = env_str("DATABASE_URL", "")
if DATABASE_URL:
    try:
        # Typed as Django reads it: dj_database_url's typed config, or the SQLite one below (whose NAME is a Path).
        DATABASES: dict[str, Any] = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=0)}
    except Exception as exc:
        raise ImproperlyConfigured(f"DATABASE_URL is not a database URL: {exc}") from exc
    if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
        # Every concurrent request (and streaming response) runs its ORM calls in a thread of its
        # own: a pool bounds the connections a process opens, the rest wait their turn.
        DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
            "min_size": 1,
            "max_size": env_int("SWARM_DB_POOL_SIZE", 20, minimum=1),
            "timeout": env_float("SWARM_DB_POOL_TIMEOUT_S", 60.0, minimum=1.0),
        }
else:
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": DATA_DIR / "swarm.sqlite3",
            # WAL lets readers run beside the one writer, which concurrent requests need.
            "OPTIONS": {
                "timeout": 20,
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
            # A file, not memory, so a live server thread and the tests share it; one per process,
            # so that two test runs on one machine do not clash.
            "TEST": {"NAME": DATA_DIR / f"test-{os.getpid()}.sqlite3"},
        }
    }

# --- redis: jobs' events, channel layer, Celery broker, cache -----------------------------------
REDIS_URL = env_str("REDIS_URL", "")
# The channel layer carries a job's cancel and the dashboards' live updates; a job's tokens go as its
# events (flows.events, Redis streams). A channel holds a completion's worth of messages all the same:
# channel layers drop what passes capacity, and a burst of live updates must not.
CHANNEL_CAPACITY = env_int("SWARM_MAX_TOKENS_LIMIT", 2048, minimum=1) + 64
# The most connections one process's channel layer opens to Redis. redis-py's own default (100) is
# fewer than a coordinator worker may need once it carries a second worker's jobs too: each job's
# cancel listener holds one as long as the job runs, and each send takes another for its round
# trip; past the limit a send fails at once (MaxConnectionsError), and its job with it.
SWARM_CHANNEL_LAYER_CONNECTIONS = env_int("SWARM_CHANNEL_LAYER_CONNECTIONS", 1000, minimum=1)
if REDIS_URL:
    # A receive blocks in BZPOPMIN for up to 5 s: the socket timeout must be longer than that, or
    # an idle stream's read times out before Redis answers.
    redis_host = {"address": REDIS_URL, "socket_timeout": 30, "max_connections": SWARM_CHANNEL_LAYER_CONNECTIONS}
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [redis_host], "capacity": CHANNEL_CAPACITY},
        }
    }
    # Django's, with one connection pool and client per process rather than per request (``marketplace.redis_pool``).
    CACHES = {"default": {"BACKEND": "marketplace.redis_pool.RedisCache", "LOCATION": REDIS_URL}}
else:
    CHANNEL_LAYERS = {
        "default": {"BACKEND": "channels.layers.InMemoryChannelLayer", "CONFIG": {"capacity": CHANNEL_CAPACITY}}
    }
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

# --- celery -------------------------------------------------------------------------------
CELERY_BROKER_URL = REDIS_URL or "memory://"
CELERY_TASK_ALWAYS_EAGER = env_bool("SWARM_CELERY_EAGER", not REDIS_URL)
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_SERIALIZER = "json"
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
# Built from the one table of periodic work, after the periods below are read (see the end).

# --- REST API -----------------------------------------------------------------------------
REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.SessionAuthentication",
        "marketplace.api.auth.ThrottledBasicAuthentication",
    ],
    "DEFAULT_PARSER_CLASSES": [
        "marketplace.api.parsers.BoundedJSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_PAGINATION_CLASS": "marketplace.api.pagination.BoundedLimitOffsetPagination",
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "PAGE_SIZE": 100,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "Swarm marketplace API",
    "DESCRIPTION": "The swarm marketplace: inference through its OpenAI-compatible API (`/v1`, with an API "
    "key as the bearer token), and nodes, keys, credits and billing through its REST API.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "OAS_VERSION": "3.1.0",  # JSON Schema 2020-12, as the /v1 request types are written
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # The /v1 inference API is plain async views: its request types are added here.
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "marketplace.api.inference_schema.add_inference_api",
    ],
}

# --- the swarm ------------------------------------------------------------------------------
# Models the marketplace serves besides the catalog's enabled entries: registry ids of
# worker_agent.model, or checkpoint folders (each registered in the catalog under its folder's name
# at start-up, and served as that entry).
SWARM_MODELS = env_list("SWARM_MODELS", ["smollm2-135m"])
# The catalog (marketplace/catalog): where the control plane keeps the checkpoints it registered,
# one folder per content hash, which its coordinators load and agents download; an archive source
# is fetched within SWARM_CATALOG_FETCH_TIMEOUT_S per read and refused past SWARM_CATALOG_MAX_ARCHIVE_BYTES.
SWARM_CATALOG_DIR = Path(env_str("SWARM_CATALOG_DIR", str(DATA_DIR / "catalog")))
SWARM_CATALOG_FETCH_TIMEOUT_S = env_float("SWARM_CATALOG_FETCH_TIMEOUT_S", 60.0, minimum=0.1)
SWARM_CATALOG_MAX_ARCHIVE_BYTES = env_int("SWARM_CATALOG_MAX_ARCHIVE_BYTES", 200 * 1024**3, minimum=1)
# A node that sent no heartbeat for this long goes offline and loses its assignment.
SWARM_HEARTBEAT_INTERVAL_S = env_float("SWARM_HEARTBEAT_INTERVAL_S", 5.0, minimum=0.1)
SWARM_HEARTBEAT_TIMEOUT_S = env_float("SWARM_HEARTBEAT_TIMEOUT_S", 20.0, minimum=0.5)
# Control-channel messages a node may send: a token bucket refilled at this rate (messages per
# second) up to the burst; a message over it is refused with an error, and a channel with more
# refusals than the last bound in a row is closed.
SWARM_CONTROL_RATE_PER_S = env_float("SWARM_CONTROL_RATE_PER_S", 20.0, minimum=0.01)
SWARM_CONTROL_BURST = env_int("SWARM_CONTROL_BURST", 100, minimum=1)
SWARM_CONTROL_MAX_REFUSED = env_int("SWARM_CONTROL_MAX_REFUSED", 50, minimum=0)
# Run the periodic sweeps inside the web process (embedded default) instead of Celery beat.
SWARM_EMBEDDED_SCHEDULER = env_bool("SWARM_EMBEDDED_SCHEDULER", not REDIS_URL)
SWARM_SWEEP_INTERVAL_S = env_float("SWARM_SWEEP_INTERVAL_S", 2.0, minimum=0.1)
# How often the embedded scheduler runs the trust work (challenges, strikes, reputation, earnings).
SWARM_TRUST_INTERVAL_S = env_float("SWARM_TRUST_INTERVAL_S", 10.0, minimum=0.1)
# Nodes kept off the serving path with a warm block, per pipeline, when there are more nodes
# than the pipelines need (0: every node serves).
SWARM_SPARES_PER_PIPELINE = env_int("SWARM_SPARES_PER_PIPELINE", 1, minimum=0)
# Spares go to the spans whose loss is likeliest and costliest: a node's failures per hour are its
# attributed failures over its hours online, from a prior of SWARM_LOSS_PRIOR_FAILURES in
# SWARM_LOSS_PRIOR_HOURS, times SWARM_LOSS_DISTRESS_FACTOR while it is suspected or backed off
# routing (marketplace/placement/candidates.py, ``loss_rate``).
SWARM_LOSS_PRIOR_FAILURES = env_float("SWARM_LOSS_PRIOR_FAILURES", 1.0, minimum=0.0)
SWARM_LOSS_PRIOR_HOURS = env_float("SWARM_LOSS_PRIOR_HOURS", 24.0, minimum=0.01)
SWARM_LOSS_DISTRESS_FACTOR = env_float("SWARM_LOSS_DISTRESS_FACTOR", 4.0, minimum=1.0)
# A node is given the layers whose weights, plus a KV cache for this many sessions of its full
# position limit on every layer, fit in its reported memory (marketplace/placement/memory.py); no
# more sessions than the node said it holds at once.
SWARM_KV_BUDGET_SESSIONS = env_int("SWARM_KV_BUDGET_SESSIONS", 8, minimum=1)
SWARM_COORDINATOR_REGIONS = env_list("SWARM_COORDINATOR_REGIONS", ["local"])
# Where agents measure their RTT to each region ("region=url,..."); a region without one is
# probed at the control plane's own /healthz.
SWARM_REGION_PROBE_URLS = dict(item.split("=", 1) for item in env_list("SWARM_REGION_PROBE_URLS", []) if "=" in item)
SWARM_REGION_UPLINK_MBPS = env_float("SWARM_REGION_UPLINK_MBPS", 1000.0, minimum=0.001)
# Re-place a model when the coefficient of variation of its per-layer load passes this.
SWARM_REBALANCE_CV = env_float("SWARM_REBALANCE_CV", 0.25, minimum=0.0)
SWARM_REBALANCE_MIN_INTERVAL_S = env_float("SWARM_REBALANCE_MIN_INTERVAL_S", 60.0, minimum=0.0)
# ... and only when the new placement is predicted to serve this fraction more tokens/s (0.15: 15 %).
SWARM_REPLACE_MARGIN = env_float("SWARM_REPLACE_MARGIN", 0.15, minimum=0.0)
# With several SWARM_MODELS, the nodes are shared among them by demand: the tokens (prompt +
# completion) of each model's jobs over the last SWARM_DEMAND_WINDOW_S seconds. Demand moves nodes
# at most once per SWARM_REBALANCE_MIN_INTERVAL_S, and only once some model's fraction of the work
# moved by more than SWARM_DEMAND_SHIFT (0.25: by more than a quarter) since the last split.
SWARM_DEMAND_WINDOW_S = env_float("SWARM_DEMAND_WINDOW_S", 600.0, minimum=1.0)
SWARM_DEMAND_SHIFT = env_float("SWARM_DEMAND_SHIFT", 0.25, minimum=0.0)
# A node whose last this-many blocks of a model, assigned since its control channel opened, all
# failed to load or serve is left out of that model's placements until it reconnects.
SWARM_BLOCK_FAILURES_BEFORE_BACKOFF = env_int("SWARM_BLOCK_FAILURES_BEFORE_BACKOFF", 3, minimum=1)
# Speed is measured, not claimed (marketplace/nodes/capacity.py): a node's claim counts up to this
# many times the speed a passed challenge proved. Unproven, a claim past this many times the median
# of the other nodes' claims is in doubt: it counts for nothing, and the node serves only where no
# other can, until a challenge measures it.
SWARM_SPEED_VERIFIED_SLACK = env_float("SWARM_SPEED_VERIFIED_SLACK", 4.0, minimum=1.0)
SWARM_SPEED_CLAIM_OUTLIER = env_float("SWARM_SPEED_CLAIM_OUTLIER", 4.0, minimum=1.0)
# A node claiming more than this many times the best speed it proved in a challenge gets a strike
# (the proof is a lower bound, round trips and queueing included: honest nodes stay far below).
SWARM_SPEED_FALSE_CLAIM = env_float("SWARM_SPEED_FALSE_CLAIM", 50.0, minimum=2.0)
# Passed challenges a node must have before the best speed they proved can make its claim a strike
# (load on its machine only slows a challenge: one slow one is no evidence of a lie).
SWARM_SPEED_EVIDENCE_CHALLENGES = env_int("SWARM_SPEED_EVIDENCE_CHALLENGES", 3, minimum=1)
# Round trips are measured from both ends (marketplace/placement/round_trips.py): a node's report of
# a link that the other end measured more than this many times as long, and by more than the
# margin (answering delays and jitter make honest ends disagree by some milliseconds), is clamped
# to the other end's measurement / the tolerance and struck.
SWARM_RTT_CLAIM_TOLERANCE = env_float("SWARM_RTT_CLAIM_TOLERANCE", 2.0, minimum=1.0)
SWARM_RTT_CLAIM_MARGIN_MS = env_float("SWARM_RTT_CLAIM_MARGIN_MS", 50.0, minimum=0.0)
# Reports of a link an end must have made before the least of them is evidence against the other
# end's claim (a single report from a busy end is inflated by its load, not by the other's lie).
SWARM_RTT_EVIDENCE_SAMPLES = env_int("SWARM_RTT_EVIDENCE_SAMPLES", 3, minimum=1)
# A node whose stage refuses a session for its length within the positions it reported holding is
# clamped to less than that length, and one that fails a memory challenge to the memory it showed at
# most; one that reported more than this many times that is struck.
SWARM_MEMORY_CLAIM_TOLERANCE = env_float("SWARM_MEMORY_CLAIM_TOLERANCE", 1.5, minimum=1.0)
# Memory challenges (docs/trust-and-payouts.md, "Memory is held, not claimed"): this share of the
# challenges due are memory ones, which ask a node to hold this fraction of the KV budget its blocks
# were placed with (SWARM_KV_BUDGET_SESSIONS sessions of full length), all at once.
SWARM_MEMORY_CHALLENGE_SHARE = env_float("SWARM_MEMORY_CHALLENGE_SHARE", 0.25, minimum=0.0, maximum=1.0)
SWARM_MEMORY_CHALLENGE_FRACTION = env_float("SWARM_MEMORY_CHALLENGE_FRACTION", 0.75, minimum=0.01, maximum=1.0)
# Host names an agent may advertise as its data-plane URL whatever address its control channel
# comes from (agents behind a reverse proxy or a port forward); otherwise the URL's host must be that address.
SWARM_AGENT_URL_HOSTS = env_list("SWARM_AGENT_URL_HOSTS", [])
# Reachability (marketplace/nodes/reachability.py): before a block enters placement the control
# plane opens its reported data URL itself, within SWARM_REACHABILITY_TIMEOUT_S. Off only where the
# control plane can open no connection to agents at all: their reports are then taken as they come.
SWARM_REACHABILITY_CHECK = env_bool("SWARM_REACHABILITY_CHECK", True)
SWARM_REACHABILITY_TIMEOUT_S = env_float("SWARM_REACHABILITY_TIMEOUT_S", 5.0, minimum=0.1)
# Relays (`swarm-relay`) that serve the agents nobody can reach, as ID=HOST:PORT entries: the address
# agents connect out to and peers reach them at. Each relay trusts the ticket key's public half
# (`python -m marketplace ticket_key`) and is started with --id ID --public-host HOST --port PORT.
SWARM_RELAYS = env_list("SWARM_RELAYS", [])
for _relay in SWARM_RELAYS:
    if not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}=[A-Za-z0-9.\-]{1,253}:[0-9]{1,5}", _relay):
        raise ImproperlyConfigured(f"SWARM_RELAYS entries are ID=HOST:PORT, got {_relay!r}")
# How long a relay pass the control plane signs for an unreachable node stays good (seconds); the
# agent gets a fresh one each time its data URL is found unreachable again.
SWARM_RELAY_PASS_TTL_S = env_int("SWARM_RELAY_PASS_TTL_S", 86400, minimum=60)
# The control plane's ed25519 key that signs job tickets (created on first use if missing).
SWARM_TICKET_KEY_PATH = Path(env_str("SWARM_TICKET_KEY_PATH", str(DATA_DIR / "ticket.key")))
# The swarm's certificate authority for the data plane's TLS (marketplace/nodes/authority.py): an EC
# P-256 key and its self-signed certificate, created on first use; agents pin the certificate at join.
SWARM_CA_KEY_PATH = Path(env_str("SWARM_CA_KEY_PATH", str(DATA_DIR / "swarm-ca.key")))
SWARM_CA_CERT_PATH = Path(env_str("SWARM_CA_CERT_PATH", str(DATA_DIR / "swarm-ca.pem")))
# Days a node certificate issued at join stays valid (each join issues a new one).
SWARM_NODE_CERT_DAYS = env_int("SWARM_NODE_CERT_DAYS", 30, minimum=1)
# Refuse agents whose data plane is not TLS pinned to that CA: a join without a CSR or a ws:// data
# URL, and a block reported ready at a ws:// URL (agents join with `swarm-worker join --tls auto`).
SWARM_REQUIRE_DATA_TLS = env_bool("SWARM_REQUIRE_DATA_TLS", PRODUCTION)
# The two URLs below go into the install script: only characters the shell reads as themselves.
_plain_http_url = r"https?://[A-Za-z0-9.\-]+(:[0-9]+)?(/[A-Za-z0-9._~\-/]*)?"
# The address agents and people reach this control plane at (https://swarm.example.com): the
# dashboard's install command and the install script name it, and Stripe sends customers back from
# Checkout and providers back from Connect onboarding to it. Empty: the address of each request.
SWARM_PUBLIC_URL = env_str("SWARM_PUBLIC_URL", "").rstrip("/")
if SWARM_PUBLIC_URL and not re.fullmatch(_plain_http_url, SWARM_PUBLIC_URL):
    raise ImproperlyConfigured(f"SWARM_PUBLIC_URL must be a plain http(s) URL, got {SWARM_PUBLIC_URL!r}")
# The package index (PEP 503 "simple" layout, e.g. http://10.0.0.5:8080/simple/) that the install
# script takes pip, torch and the agent's dependencies from, for hosts with no route to the public
# registries (a closed network, an air-gapped site). A plain-http one is trusted for its host:port,
# which pip otherwise refuses. Empty: torch from download.pytorch.org, the rest from pip's own settings.
SWARM_AGENT_PIP_INDEX = env_str("SWARM_AGENT_PIP_INDEX", "")
if SWARM_AGENT_PIP_INDEX and not re.fullmatch(_plain_http_url, SWARM_AGENT_PIP_INDEX):
    raise ImproperlyConfigured(f"SWARM_AGENT_PIP_INDEX must be a plain http(s) URL, got {SWARM_AGENT_PIP_INDEX!r}")
# Where the agent's wheel and the models' wheels served at /install/wheels/ are kept (filled by
# `python -m marketplace build_agent_wheel`, or on the first request to /install/).
SWARM_WHEELS_DIR = Path(env_str("SWARM_WHEELS_DIR", str(DATA_DIR / "wheels")))
# Where a job's coordinator runs: "inprocess" (the web process's event loop) or "celery" (a task
# on the queue coord.<region>, for Celery workers of that region).
SWARM_COORDINATOR_LAUNCH = env_str("SWARM_COORDINATOR_LAUNCH", "celery" if REDIS_URL else "inprocess")
# A coordinator worker's threads for its jobs' database and cache calls (marketplace.flows.tasks).
SWARM_COORDINATOR_DB_THREADS = env_int("SWARM_COORDINATOR_DB_THREADS", 16, minimum=1)
# torch's CPU threads in each control-plane process (web, coordinator and verify workers), set as
# it loads the models. Their torch work is a few rows at a time (the coordinators' embeddings and
# heads, batched across jobs; the verifiers' replays), and a team of threads per process only
# spins against the others' on a shared machine: one each by default. 0: torch's own choice.
SWARM_TORCH_THREADS = env_int("SWARM_TORCH_THREADS", 1, minimum=0)
# Whether a control-plane process freezes the heap it keeps for good once its models are loaded
# (``worker_agent.heap``): on for the processes the control plane runs as (web, Celery workers, the
# embedded demo); off where it runs inside a larger program that goes on making and dropping
# objects of its own (the test suite's live servers), whose garbage alive at the freeze would never
# be collected.
SWARM_FREEZE_HEAP = env_bool("SWARM_FREEZE_HEAP", True)
if SWARM_COORDINATOR_LAUNCH not in ("inprocess", "celery"):
    raise ImproperlyConfigured("SWARM_COORDINATOR_LAUNCH must be 'inprocess' or 'celery'")
# How a job's activations travel: ``ring`` (each stage forwards to the next, taps to the
# coordinator) or ``star`` (every stage's output comes back to the coordinator, which sends it on).
SWARM_TOPOLOGY = env_str("SWARM_TOPOLOGY", "ring")
if SWARM_TOPOLOGY not in ("ring", "star"):
    raise ImproperlyConfigured("SWARM_TOPOLOGY must be 'ring' or 'star'")
SWARM_JOB_TIMEOUT_S = env_float("SWARM_JOB_TIMEOUT_S", 300.0, minimum=1.0)
# How many times one request may have its route healed (a stage died or stalled) before it fails.
SWARM_MAX_HEALS = env_int("SWARM_MAX_HEALS", 2, minimum=0)
# A step that makes no progress past a stage this long (plus a little per prefilled token) has
# stalled: the coordinator heals around that stage.
SWARM_STALL_TIMEOUT_S = env_float("SWARM_STALL_TIMEOUT_S", 10.0, minimum=0.5)
# A failure a job's coordinator attributes to a node (it stalled, dropped, or owed a receipt it never
# sent) keeps requests off it for SWARM_FAILURE_BACKOFF_S * 2^(n-1) seconds, n its failures in the
# current window of SWARM_FAILURE_WINDOW_S (counted from the window's first), at most
# SWARM_FAILURE_BACKOFF_MAX_S; more than SWARM_FAILURES_BEFORE_STRIKE in one window is a strike.
SWARM_FAILURE_BACKOFF_S = env_float("SWARM_FAILURE_BACKOFF_S", 30.0, minimum=0.0)
SWARM_FAILURE_BACKOFF_MAX_S = env_float("SWARM_FAILURE_BACKOFF_MAX_S", 3600.0, minimum=0.0)
SWARM_FAILURE_WINDOW_S = env_float("SWARM_FAILURE_WINDOW_S", 24 * 3600.0, minimum=1.0)
SWARM_FAILURES_BEFORE_STRIKE = env_int("SWARM_FAILURES_BEFORE_STRIKE", 3, minimum=1)
# One event (a crash, a freeze) fails every job on the node at once: the failures it attributes within
# SWARM_FAILURE_INCIDENT_S of the last counted one are one incident, counted once.
SWARM_FAILURE_INCIDENT_S = env_float("SWARM_FAILURE_INCIDENT_S", 15.0, minimum=0.0)
# Speculative decoding in the coordinators: "auto" (each request's router speculates where it pays;
# a request may send "speculation": false) or "off"; an optional draft model run by the
# coordinator (a registry id or checkpoint folder sharing the served model's tokenizer).
SWARM_SPECULATION = env_str("SWARM_SPECULATION", "auto")
if SWARM_SPECULATION not in ("auto", "off"):
    raise ImproperlyConfigured("SWARM_SPECULATION must be 'auto' or 'off'")
SWARM_DRAFT_MODEL = env_str("SWARM_DRAFT_MODEL", "") or None
# Prefix reuse (docs/data-plane.md): stages keep the KV of an account's finished requests, named by
# keys salted per account (an HMAC of SECRET_KEY and the account id), and a request whose prompt
# starts with a kept prefix computes only the rest. Routing remembers which route served an
# account's prefixes for SWARM_PREFIX_ROUTE_TTL_S and takes it again for a request that extends one
# while its cost is within SWARM_PREFIX_ROUTE_MARGIN (0.25: 25 %) of the lowest-latency route's.
SWARM_PREFIX_REUSE = env_bool("SWARM_PREFIX_REUSE", True)
SWARM_PREFIX_ROUTE_TTL_S = env_float("SWARM_PREFIX_ROUTE_TTL_S", 600.0, minimum=0.0)
SWARM_PREFIX_ROUTE_MARGIN = env_float("SWARM_PREFIX_ROUTE_MARGIN", 0.25, minimum=0.0)
# A heal that finds no route around a failed stage has a node load its span (a spare of another
# span, an idle node) and waits for it while the model is recovering (a node holds or is loading a
# block of it): SWARM_HEAL_WAIT_S, plus SWARM_HEAL_WAIT_S_PER_GIB per GiB of the span's float32
# weights (what the loading node fetches and reads); then the request ends with what it delivered.
SWARM_HEAL_WAIT_S = env_float("SWARM_HEAL_WAIT_S", 30.0, minimum=0.0)
SWARM_HEAL_WAIT_S_PER_GIB = env_float("SWARM_HEAL_WAIT_S_PER_GIB", 60.0, minimum=0.0)
# A request admitted when its model has no ready route waits this long for one while the model is
# recovering, then answers 503; a model no node serves answers 503 at once.
SWARM_ADMISSION_WAIT_S = env_float("SWARM_ADMISSION_WAIT_S", 30.0, minimum=0.0)
# A request whose model's every route carries as many jobs as its stages hold queues this long for
# a free one, then answers 503 overloaded; SWARM_JOBS_PER_NODE caps the jobs one node carries at
# once (below what its agent reports holding).
SWARM_QUEUE_WAIT_S = env_float("SWARM_QUEUE_WAIT_S", 60.0, minimum=0.0)
SWARM_JOBS_PER_NODE = env_int("SWARM_JOBS_PER_NODE", 64, minimum=1)
SWARM_JOB_STALE_S = env_float("SWARM_JOB_STALE_S", 60.0, minimum=1.0)  # no progress this long: coordinator lost
# A web process answering a request and a coordinator worker running a job keep a sign of life in
# Redis (``jobs.liveness``); one silent this long is dead: its jobs end, and retries of its requests'
# Idempotency-Keys run, at once rather than after SWARM_JOB_STALE_S.
SWARM_PROCESS_ALIVE_S = env_float("SWARM_PROCESS_ALIVE_S", 10.0, minimum=1.0)
# A job whose settlement raised is tried again after SWARM_SETTLE_RETRY_S, doubling up to
# SWARM_SETTLE_RETRY_MAX_S; after SWARM_SETTLE_FLAG_AFTER failures in a row it is flagged for admins.
SWARM_SETTLE_RETRY_S = env_float("SWARM_SETTLE_RETRY_S", 30.0, minimum=0.0)
SWARM_SETTLE_RETRY_MAX_S = env_float("SWARM_SETTLE_RETRY_MAX_S", 3600.0, minimum=0.0)
SWARM_SETTLE_FLAG_AFTER = env_int("SWARM_SETTLE_FLAG_AFTER", 3, minimum=1)
SWARM_MAX_TOKENS_LIMIT = env_int("SWARM_MAX_TOKENS_LIMIT", 2048, minimum=1)
# The most choices (``n``) one request may ask for: each is a job of its own, on a pipeline of its own.
SWARM_MAX_CHOICES = env_int("SWARM_MAX_CHOICES", 8, minimum=1)
# A request sent with an Idempotency-Key is answered again, not run again, to a retry within this.
SWARM_IDEMPOTENCY_TTL_S = env_float("SWARM_IDEMPOTENCY_TTL_S", 24 * 3600.0, minimum=1.0)
# Prices when an admin set none for a model: nano-dollars per million (prompt, completion) tokens.
SWARM_DEFAULT_PRICES = (
    env_int("SWARM_PRICE_PROMPT_PER_MILLION", 100_000_000, minimum=0),  # $0.10 per million
    env_int("SWARM_PRICE_COMPLETION_PER_MILLION", 200_000_000, minimum=0),  # $0.20 per million
)
SWARM_JOIN_TOKEN_TTL_S = env_int("SWARM_JOIN_TOKEN_TTL_S", 7 * 24 * 3600, minimum=60)
# Failed join token checks (POST /api/v1/agents/check-token) one client address may make in a
# minute, counted in the cache; past it, checks from there answer 429 until the minute ends.
SWARM_JOIN_CHECK_FAILURES_PER_ADDRESS = env_int("SWARM_JOIN_CHECK_FAILURES_PER_ADDRESS", 30, minimum=1)
# Active API keys one customer may hold (the dashboard playground's own key is not counted).
SWARM_API_KEYS_PER_ACCOUNT = env_int("SWARM_API_KEYS_PER_ACCOUNT", 50, minimum=1)
# A request's prompt (a completion's prompt, or a chat's message contents together), in UTF-8 bytes,
# refused before it is tokenized; and the largest JSON body the inference API reads.
SWARM_MAX_PROMPT_BYTES = env_int("SWARM_MAX_PROMPT_BYTES", 256 * 1024, minimum=1)
SWARM_MAX_REQUEST_BYTES = env_int("SWARM_MAX_REQUEST_BYTES", 4 * 1024 * 1024, minimum=1024)
DATA_UPLOAD_MAX_MEMORY_SIZE = SWARM_MAX_REQUEST_BYTES

# --- trust: challenges, audits, strikes, reputation ---------------------------------------------
# Where challenge answers and audits are checked against the trusted float32 blocks: "inline" (the
# process that received them; the embedded default) or "celery" (tasks on the queue "verify").
SWARM_VERIFIER = env_str("SWARM_VERIFIER", "celery" if REDIS_URL else "inline")
if SWARM_VERIFIER not in ("inline", "celery"):
    raise ImproperlyConfigured("SWARM_VERIFIER must be 'inline' or 'celery'")
# A token passes when its cosine similarity to the trusted output is at least this and the relative
# difference of their norms is below SWARM_CHECK_MAX_REL_NORM.
SWARM_CHECK_MIN_COSINE = env_float("SWARM_CHECK_MIN_COSINE", 0.99, minimum=0.0)
SWARM_CHECK_MAX_REL_NORM = env_float("SWARM_CHECK_MAX_REL_NORM", 0.05, minimum=0.0)
# A challenge is a job the verifier runs (docs/trust-and-payouts.md, "Challenges are jobs"): it has a job's time to end.
SWARM_CHALLENGE_DEADLINE_S = env_float("SWARM_CHALLENGE_DEADLINE_S", SWARM_JOB_TIMEOUT_S, minimum=0.1)
# The address the verifier's stand-in stages listen on, which a challenged node reaches its successor
# at: an address of the verifying process's host that the nodes can reach (default: SWARM_PUBLIC_URL's host).
SWARM_CHALLENGE_HOST = env_str("SWARM_CHALLENGE_HOST", urlsplit(SWARM_PUBLIC_URL).hostname or "127.0.0.1")
if not re.fullmatch(r"[A-Za-z0-9.\-]+", SWARM_CHALLENGE_HOST):
    raise ImproperlyConfigured(f"SWARM_CHALLENGE_HOST must be an IPv4 address or host name: {SWARM_CHALLENGE_HOST!r}")
# A file of the texts challenges' prompts are made of, one per line, kept private ("": a public default pool).
SWARM_CHALLENGE_PROMPTS = env_str("SWARM_CHALLENGE_PROMPTS", "")
# Node ids the verifier trusts to serve the other spans of a challenge's route (nodes the operator runs,
# which serve customers' jobs too); a span no trusted node serves gets a stand-in of the verifier's.
SWARM_CHALLENGE_TRUSTED_NODES = env_list("SWARM_CHALLENGE_TRUSTED_NODES", [])
# The check-rate formula (docs/trust-and-payouts.md, "How often a node is checked"): a node is
# checked often enough that cheating loses it more than it gains. SAFETY is the factor k by which
# the expected loss must exceed the gain; HORIZON is the days of future income an ejected node
# forfeits (scaled by its age and reputation).
SWARM_CHECK_SAFETY = env_float("SWARM_CHECK_SAFETY", 2.0, minimum=1.0)
SWARM_CHECK_HORIZON_DAYS = env_float("SWARM_CHECK_HORIZON_DAYS", 30.0, minimum=0.0)
SWARM_CHALLENGES_MIN_PER_DAY = env_float("SWARM_CHALLENGES_MIN_PER_DAY", 24.0, minimum=0.0)
SWARM_CHALLENGES_MAX_PER_DAY = env_float("SWARM_CHALLENGES_MAX_PER_DAY", 1440.0, minimum=0.0)
SWARM_AUDIT_MIN_FRACTION = env_float("SWARM_AUDIT_MIN_FRACTION", 0.02, minimum=0.0)
SWARM_AUDIT_NEW_NODE_FRACTION = env_float("SWARM_AUDIT_NEW_NODE_FRACTION", 0.25, minimum=0.0)
SWARM_NEW_NODE_DAYS = env_float("SWARM_NEW_NODE_DAYS", 7.0, minimum=0.0)
# Strikes: open ones withhold the node's pending pay; unreviewed ones are upheld after
# SWARM_STRIKE_REVIEW_S; SWARM_STRIKES_TO_EJECT upheld strikes within SWARM_STRIKE_PERIOD_DAYS eject it.
SWARM_STRIKE_REVIEW_S = env_float("SWARM_STRIKE_REVIEW_S", 24 * 3600.0, minimum=0.0)
SWARM_STRIKES_TO_EJECT = env_int("SWARM_STRIKES_TO_EJECT", 3, minimum=1)
SWARM_STRIKE_PERIOD_DAYS = env_float("SWARM_STRIKE_PERIOD_DAYS", 30.0, minimum=0.0)

# --- monitoring: /metrics, /readyz ---------------------------------------------------------------
# /metrics (Prometheus) shows business figures: with a token set it answers only "Authorization:
# Bearer <token>"; without one, only requests from this machine. (PROMETHEUS_MULTIPROC_DIR, read by
# marketplace.metrics, adds up the counters of every process; see there.)
SWARM_METRICS_TOKEN = env_str("SWARM_METRICS_TOKEN", "")
# How long a scrape waits for the database's figures and the Celery queues' lengths.
SWARM_METRICS_TIMEOUT_S = env_float("SWARM_METRICS_TIMEOUT_S", 5.0, minimum=0.1)
# /readyz: each dependency's connect and read timeout; and the database it checks (a URL as
# DATABASE_URL; empty: the app's own).
SWARM_READYZ_TIMEOUT_S = env_float("SWARM_READYZ_TIMEOUT_S", 2.0, minimum=0.1)
SWARM_READYZ_DATABASE_URL = env_str("SWARM_READYZ_DATABASE_URL", "")

# --- payouts ------------------------------------------------------------------------------------
# The platform keeps this share of each verified job's charge (basis points); the rest is split
# across its stages in proportion to layers x tokens each processed.
SWARM_PLATFORM_FEE_BPS = env_int("SWARM_PLATFORM_FEE_BPS", 2000, minimum=0)
if SWARM_PLATFORM_FEE_BPS > 10_000:
    raise ImproperlyConfigured("SWARM_PLATFORM_FEE_BPS must be at most 10000")
# Earnings stay pending (and can be clawed back by an upheld strike) this long after their job.
SWARM_CHALLENGE_WINDOW_S = env_float("SWARM_CHALLENGE_WINDOW_S", 24 * 3600.0, minimum=0.0)
# A payout batch includes providers whose available earnings reach this (nano-dollars; $1).
SWARM_PAYOUT_MINIMUM = env_int("SWARM_PAYOUT_MINIMUM", 1_000_000_000, minimum=1)
SWARM_PAYOUT_BATCH_INTERVAL_S = env_float("SWARM_PAYOUT_BATCH_INTERVAL_S", 24 * 3600.0, minimum=1.0)
SWARM_PAYOUT_MAX_ATTEMPTS = env_int("SWARM_PAYOUT_MAX_ATTEMPTS", 5, minimum=1)

# --- stripe -------------------------------------------------------------------------------------
# Customers top up credits through Stripe Checkout; credits arrive only with Stripe's signed webhook
# (POST /stripe/webhook). Without a secret key top-ups are off; without a webhook secret the webhook
# answers 503.
STRIPE_SECRET_KEY = env_str("STRIPE_SECRET_KEY", "")
STRIPE_WEBHOOK_SECRET = env_str("STRIPE_WEBHOOK_SECRET", "")
# The API the SDK calls (stripe.api_base); tests and offline runs point it at a local Stripe-compatible server.
STRIPE_API_BASE = env_str("STRIPE_API_BASE", "https://api.stripe.com")
STRIPE_TIMEOUT_S = env_float("STRIPE_TIMEOUT_S", 10.0, minimum=0.1)
# A transient failure (no connection, timeout, rate limit, 5xx) is retried this many times, with the
# same idempotency key, waiting STRIPE_RETRY_BACKOFF_S before the first retry and twice as long each time after.
STRIPE_MAX_RETRIES = env_int("STRIPE_MAX_RETRIES", 2, minimum=0)
STRIPE_RETRY_BACKOFF_S = env_float("STRIPE_RETRY_BACKOFF_S", 0.5, minimum=0.0)
# A webhook whose signature timestamp is older than this is refused (replay protection).
STRIPE_WEBHOOK_TOLERANCE_S = env_int("STRIPE_WEBHOOK_TOLERANCE_S", 300, minimum=1)
try:
    STRIPE_TOPUP_MIN_DOLLARS = Decimal(env_str("STRIPE_TOPUP_MIN_DOLLARS", "5.00"))
    STRIPE_TOPUP_MAX_DOLLARS = Decimal(env_str("STRIPE_TOPUP_MAX_DOLLARS", "1000.00"))
except InvalidOperation:
    raise ImproperlyConfigured("STRIPE_TOPUP_MIN_DOLLARS and STRIPE_TOPUP_MAX_DOLLARS must be dollar amounts") from None
# Stripe charges at least $0.50 and at most $999,999.99 in USD.
if not (
    STRIPE_TOPUP_MIN_DOLLARS.is_finite()
    and STRIPE_TOPUP_MAX_DOLLARS.is_finite()
    and Decimal("0.50") <= STRIPE_TOPUP_MIN_DOLLARS <= STRIPE_TOPUP_MAX_DOLLARS <= Decimal("999999.99")
):
    raise ImproperlyConfigured(
        "STRIPE_TOPUP_MIN_DOLLARS and STRIPE_TOPUP_MAX_DOLLARS must satisfy 0.50 <= min <= max <= 999999.99, "
        f"got {STRIPE_TOPUP_MIN_DOLLARS} and {STRIPE_TOPUP_MAX_DOLLARS}"
    )

# --- logging ------------------------------------------------------------------------------------
# Every line, the web process's and the Celery workers' alike, to stderr with its UTC time, level,
# logger, and the request id and job id it was logged for ("-" outside any): as text, or with
# SWARM_LOG_FORMAT=json one JSON object per line with the same fields (marketplace/logs.py).
SWARM_LOG_FORMAT = env_str("SWARM_LOG_FORMAT", "text").strip().lower()
if SWARM_LOG_FORMAT not in LOG_FORMATS:
    raise ImproperlyConfigured(f"SWARM_LOG_FORMAT must be one of {', '.join(LOG_FORMATS)}, got {SWARM_LOG_FORMAT!r}")
SWARM_LOG_LEVEL = env_str("SWARM_LOG_LEVEL", "INFO").strip().upper()
if SWARM_LOG_LEVEL not in LOG_LEVELS:
    raise ImproperlyConfigured(f"SWARM_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, got {SWARM_LOG_LEVEL!r}")
LOGGING = logging_config(SWARM_LOG_FORMAT, SWARM_LOG_LEVEL)

# --- periodic work (one table for Celery beat and the embedded scheduler) --------------------
CELERY_BEAT_SCHEDULE = beat_schedule(globals())
CELERY_IMPORTS = ("marketplace.periodic", "marketplace.flows.tasks")  # their tasks are in no app's tasks module
