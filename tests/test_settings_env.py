"""Configuration from environment variables: the typed readers, and settings.py built from them."""

from __future__ import annotations

import os
import runpy
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured

from marketplace.conf import env_bool, env_float, env_int, env_list, env_str

pytestmark = [pytest.mark.control, pytest.mark.django_db]

SETTINGS_FILE = Path(__file__).resolve().parent.parent / "marketplace" / "settings.py"
VAR = "SWARM_TEST_VALUE"


@pytest.fixture
def env(monkeypatch):
    """Set (or, with None, remove) the test variable."""

    def set_to(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(VAR, raising=False)
        else:
            monkeypatch.setenv(VAR, value)

    return set_to


@pytest.fixture
def load_settings(monkeypatch, tmp_path):
    """Run settings.py afresh under the given environment (a clean slate of the variables it reads)."""

    def load(**environ: str) -> dict:
        read = [name for name in os.environ if name.startswith(("SWARM_", "DJANGO_"))] + ["DATABASE_URL", "REDIS_URL"]
        for name in read:
            if name != "DJANGO_SETTINGS_MODULE":
                monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("SWARM_DATA_DIR", str(tmp_path / "data"))
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
        return runpy.run_path(str(SETTINGS_FILE))

    return load


@pytest.mark.parametrize(("raw", "value"), [(None, 7), ("", 7), ("42", 42), (" 3 ", 3), ("-2", -2)])
def test_env_int_reads_an_integer_or_the_default(raw, value, env):
    env(raw)

    assert env_int(VAR, 7) == value


@pytest.mark.parametrize("raw", ["abc", "4.5", "1e3", "0x10"])
def test_env_int_refuses_what_is_not_an_integer(raw, env):
    env(raw)

    with pytest.raises(ImproperlyConfigured) as error:
        env_int(VAR, 7)

    assert str(error.value) == f"{VAR} must be an integer, got {raw!r}"


def test_env_int_refuses_a_value_below_the_minimum(env):
    env("59")

    with pytest.raises(ImproperlyConfigured) as error:
        env_int(VAR, 3600, minimum=60)

    assert str(error.value) == f"{VAR} must be >= 60, got 59"


def test_env_int_accepts_the_minimum_itself(env):
    env("60")

    assert env_int(VAR, 3600, minimum=60) == 60


@pytest.mark.parametrize(("raw", "value"), [(None, 5.0), ("", 5.0), ("0.25", 0.25), ("3", 3.0), ("1e1", 10.0)])
def test_env_float_reads_a_number_or_the_default(raw, value, env):
    env(raw)

    assert env_float(VAR, 5.0) == value


@pytest.mark.parametrize("raw", ["fast", "1,5", "five"])
def test_env_float_refuses_what_is_not_a_number(raw, env):
    env(raw)

    with pytest.raises(ImproperlyConfigured) as error:
        env_float(VAR, 5.0, minimum=0.1)

    assert str(error.value) == f"{VAR} must be a number, got {raw!r}"


@pytest.mark.parametrize("raw", ["nan", "NaN", "0.05", "-1"])
def test_env_float_refuses_nan_and_values_below_the_minimum(raw, env):
    env(raw)

    with pytest.raises(ImproperlyConfigured) as error:
        env_float(VAR, 5.0, minimum=0.1)

    assert str(error.value) == f"{VAR} must be a number >= 0.1, got {raw!r}"


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "yes", "on", " On "])
def test_env_bool_reads_true(raw, env):
    env(raw)

    assert env_bool(VAR, False) is True


@pytest.mark.parametrize("raw", ["0", "false", "False", "no", "off"])
def test_env_bool_reads_false(raw, env):
    env(raw)

    assert env_bool(VAR, True) is False


@pytest.mark.parametrize("default", [True, False])
def test_env_bool_falls_back_to_the_default_when_unset_or_empty(default, env):
    env("")

    assert env_bool(VAR, default) is default


@pytest.mark.parametrize("raw", ["maybe", "2", "y", "enabled"])
def test_env_bool_refuses_anything_else(raw, env):
    env(raw)

    with pytest.raises(ImproperlyConfigured) as error:
        env_bool(VAR, False)

    assert str(error.value) == f"{VAR} must be a boolean (1/0, true/false), got {raw!r}"


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        (None, ["local"]),
        ("", ["local"]),
        ("   ", ["local"]),
        ("eu", ["eu"]),
        (" eu-west , us-east,,ap ", ["eu-west", "us-east", "ap"]),
    ],
)
def test_env_list_splits_on_commas_and_drops_blanks(raw, value, env):
    env(raw)

    assert env_list(VAR, ["local"]) == value


def test_env_str_reads_the_raw_value_or_the_default(env):
    env(None)
    assert env_str(VAR, "fallback") == "fallback"
    env(" as is ")
    assert env_str(VAR, "fallback") == " as is "


def test_settings_refuse_a_bad_number_naming_the_variable(load_settings):
    with pytest.raises(ImproperlyConfigured) as error:
        load_settings(SWARM_HEARTBEAT_TIMEOUT_S="soon")

    assert str(error.value) == "SWARM_HEARTBEAT_TIMEOUT_S must be a number, got 'soon'"


def test_settings_refuse_a_value_below_its_minimum(load_settings):
    with pytest.raises(ImproperlyConfigured) as error:
        load_settings(SWARM_JOIN_TOKEN_TTL_S="10")

    assert str(error.value) == "SWARM_JOIN_TOKEN_TTL_S must be >= 60, got 10"


def test_settings_refuse_a_bad_boolean(load_settings):
    with pytest.raises(ImproperlyConfigured) as error:
        load_settings(DJANGO_DEBUG="sometimes")

    assert str(error.value) == "DJANGO_DEBUG must be a boolean (1/0, true/false), got 'sometimes'"


def test_settings_refuse_a_database_url_they_cannot_parse(load_settings):
    with pytest.raises(ImproperlyConfigured) as error:
        load_settings(DATABASE_URL="nonsense")

    assert str(error.value).startswith("DATABASE_URL is not a database URL: ")


def test_settings_demand_a_secret_key_when_told_to(load_settings):
    with pytest.raises(ImproperlyConfigured) as error:
        load_settings(SWARM_REQUIRE_SECRET_KEY="1")

    assert str(error.value) == "DJANGO_SECRET_KEY must be set in production"


SECRET = "k" * 50


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({}, "SWARM_PRODUCTION=1 needs DJANGO_SECRET_KEY set to a secret of your own"),
        (
            {"DJANGO_SECRET_KEY": "insecure-embedded-default-key-change-me"},
            "SWARM_PRODUCTION=1 needs DJANGO_SECRET_KEY set to a secret of your own",
        ),
        (
            {"DJANGO_SECRET_KEY": "django-insecure-" + SECRET},
            "SWARM_PRODUCTION=1 needs DJANGO_SECRET_KEY set to a secret of your own",
        ),
        ({"DJANGO_SECRET_KEY": "short"}, "SWARM_PRODUCTION=1 needs a DJANGO_SECRET_KEY of at least 32 characters"),
        ({"DJANGO_SECRET_KEY": SECRET, "DJANGO_DEBUG": "1"}, "SWARM_PRODUCTION=1 refuses DJANGO_DEBUG=1"),
    ],
    ids=["unset", "the-public-default", "django-insecure", "too-short", "debug-on"],
)
def test_production_refuses_a_public_or_missing_secret_key_and_debug(load_settings, environ, message):
    with pytest.raises(ImproperlyConfigured) as error:
        load_settings(SWARM_PRODUCTION="1", **environ)

    assert str(error.value) == message


def test_production_turns_on_secure_cookies_https_and_hsts(load_settings):
    values = load_settings(SWARM_PRODUCTION="1", DJANGO_SECRET_KEY=SECRET)

    assert values["SECRET_KEY"] == SECRET
    assert {
        name: values[name]
        for name in (
            "SESSION_COOKIE_SECURE",
            "CSRF_COOKIE_SECURE",
            "SECURE_SSL_REDIRECT",
            "SECURE_HSTS_SECONDS",
            "SECURE_HSTS_INCLUDE_SUBDOMAINS",
        )
    } == {
        "SESSION_COOKIE_SECURE": True,
        "CSRF_COOKIE_SECURE": True,
        "SECURE_SSL_REDIRECT": True,
        "SECURE_HSTS_SECONDS": 31_536_000,
        "SECURE_HSTS_INCLUDE_SUBDOMAINS": True,
    }
    assert values["SECURE_REDIRECT_EXEMPT"] == [r"^healthz$", r"^readyz$"]
    assert "SECURE_PROXY_SSL_HEADER" not in values


def test_production_behind_a_tls_proxy_trusts_its_header_and_may_leave_redirects_to_it(load_settings):
    values = load_settings(
        SWARM_PRODUCTION="1", DJANGO_SECRET_KEY=SECRET, SWARM_PROXY_SSL_HEADER="1", SWARM_SSL_REDIRECT="0"
    )

    assert values["SECURE_PROXY_SSL_HEADER"] == ("HTTP_X_FORWARDED_PROTO", "https")
    assert (values["SECURE_SSL_REDIRECT"], values["SESSION_COOKIE_SECURE"]) == (False, True)


def test_the_embedded_default_keeps_plain_http_cookies_and_the_demo_key(load_settings):
    values = load_settings()

    assert values["SECRET_KEY"] == "insecure-embedded-default-key-change-me"
    assert (values["SESSION_COOKIE_SECURE"], values["CSRF_COOKIE_SECURE"], values["SECURE_SSL_REDIRECT"]) == (
        False,
        False,
        False,
    )
    assert values["SECURE_HSTS_SECONDS"] == 0
    assert [v["NAME"].rsplit(".", 1)[1] for v in values["AUTH_PASSWORD_VALIDATORS"]] == [
        "UserAttributeSimilarityValidator",
        "MinimumLengthValidator",
        "CommonPasswordValidator",
        "NumericPasswordValidator",
    ]


def test_settings_default_to_the_embedded_services(load_settings, tmp_path):
    values = load_settings()

    assert values["DATABASES"]["default"]["ENGINE"] == "django.db.backends.sqlite3"
    assert values["DATABASES"]["default"]["NAME"] == tmp_path / "data" / "swarm.sqlite3"
    assert values["CHANNEL_LAYERS"] == {
        "default": {"BACKEND": "channels.layers.InMemoryChannelLayer", "CONFIG": {"capacity": 2112}}
    }
    assert values["CELERY_TASK_ALWAYS_EAGER"] is True
    assert values["SWARM_EMBEDDED_SCHEDULER"] is True
    assert values["SWARM_MODELS"] == ["smollm2-135m"]
    assert (values["SWARM_HEARTBEAT_INTERVAL_S"], values["SWARM_HEARTBEAT_TIMEOUT_S"]) == (5.0, 20.0)
    assert values["SWARM_MAX_HEALS"] == 2
    assert values["SECRET_KEY"] == "insecure-embedded-default-key-change-me"


def test_settings_switch_to_postgres_and_redis_from_their_urls(load_settings):
    values = load_settings(
        DATABASE_URL="postgres://swarm:pw@db.internal:5432/swarm",
        REDIS_URL="redis://cache.internal:6379/0",
        DJANGO_SECRET_KEY="s3cret",
    )

    database = values["DATABASES"]["default"]
    assert (database["ENGINE"], database["NAME"], database["HOST"], database["PORT"]) == (
        "django.db.backends.postgresql",
        "swarm",
        "db.internal",
        5432,
    )
    assert values["CHANNEL_LAYERS"] == {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {
                "hosts": [{"address": "redis://cache.internal:6379/0", "socket_timeout": 30, "max_connections": 1000}],
                "capacity": 2112,
            },
        }
    }
    assert values["CELERY_BROKER_URL"] == "redis://cache.internal:6379/0"
    assert values["CELERY_TASK_ALWAYS_EAGER"] is False
    assert values["SWARM_EMBEDDED_SCHEDULER"] is False
    assert values["SECRET_KEY"] == "s3cret"


def test_settings_read_the_heal_bound_and_refuse_a_negative_one(load_settings):
    assert load_settings(SWARM_MAX_HEALS="0")["SWARM_MAX_HEALS"] == 0
    with pytest.raises(ImproperlyConfigured) as error:
        load_settings(SWARM_MAX_HEALS="-1")

    assert str(error.value) == "SWARM_MAX_HEALS must be >= 0, got -1"


def test_settings_read_lists_from_the_environment(load_settings):
    values = load_settings(SWARM_MODELS="smollm2-135m, tiny-llama", DJANGO_ALLOWED_HOSTS="swarm.example,localhost")

    assert values["SWARM_MODELS"] == ["smollm2-135m", "tiny-llama"]
    assert values["ALLOWED_HOSTS"] == ["swarm.example", "localhost"]
