"""What the playground tells a customer when a reply cannot be had: one sentence per error code,
and the next thing to do (add credits, choose another model, start a new chat, sign in).

This is the one place that maps the API's error codes to the playground's words: the page hands
the table to its script (``playground.js``), which shows the advice for the code of a refused
request or of a stream that ended in error. A failure's own message can name nodes, addresses and
stage indexes (the providers' business), so it is never shown, except for a refused input
(``SHOW_MESSAGE``), whose message is about what the customer typed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from django.urls import reverse


@dataclass(frozen=True)
class Action:
    label: str
    href: str = ""  # a link to follow
    focus: str = ""  # or the id of a field to move to
    press: str = ""  # or the id of a button to press


@dataclass(frozen=True)
class Advice:
    message: str
    action: Action | None = None


# Codes whose message is about the request's own input, shown after the advice.
SHOW_MESSAGE = ("invalid_request", "invalid_json", "unsupported_parameter", "unknown_parameter")
CHOOSE_MODEL = Action("Choose another model", focus="pg-model")
NEW_CHAT = Action("Start a new chat", press="pg-new")
# Keys: the API's error codes; "network" is the browser losing the connection, "default" any other.
DEFAULT = "default"


def advice_table() -> dict[str, dict]:
    """Every code's advice, as the page hands it to its script."""
    busy = Advice(
        "Every pipeline of this model is busy or down right now. Try again in a minute, or choose another model.",
        CHOOSE_MODEL,
    )
    failed = Advice(
        "The swarm could not finish this reply: a provider's machine dropped out. "
        "You pay only for the tokens you received. Send it again."
    )
    refused = Advice("The request was refused:")
    table = {
        "insufficient_quota": Advice(
            "Your credits do not cover this reply: a reply holds the price of Max tokens until it ends. "
            "Add credits, or lower Max tokens.",
            Action("Add credits", href=reverse("web:billing")),
        ),
        "model_not_found": Advice("This model is not served right now.", CHOOSE_MODEL),
        "no_capacity": busy,
        "overloaded": busy,
        "rate_limit_exceeded": Advice("You are sending replies faster than your limit allows. Wait a minute."),
        "context_length_exceeded": Advice(
            "This conversation is longer than the model can read. Start a new chat, or lower Max tokens.", NEW_CHAT
        ),
        "not_signed_in": Advice("You are signed out.", Action("Sign in again", href=reverse("accounts:login"))),
        "not_a_customer": Advice("The playground is for customer accounts."),
        "timeout": Advice("The reply took too long and was stopped. You pay only for the tokens you received."),
        "network": Advice("The connection to the server was lost. Check your network, then send again."),
        DEFAULT: failed,
        **{code: refused for code in SHOW_MESSAGE},
    }
    return {code: asdict(advice) | {"show_message": code in SHOW_MESSAGE} for code, advice in table.items()}
