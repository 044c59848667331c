"""Structured output through the OpenAI-compatible API, with the official ``openai`` client's
``chat.completions.parse``: 20 Pydantic schemas (nested objects, arrays with bounds, enums,
literals, optional fields, numbers with bounds, $defs), ``json_object``, streaming, speculation,
and the refusals. A live control plane serves smollm2-135m over three joined agents.

The output follows the grammar token by token (``worker_agent/coordinator/grammar.py``), so it
parses and validates whatever the model would rather write; strings and arrays are bounded in
these schemas because a 135M model may otherwise write one string until ``max_tokens`` runs out,
which leaves unfinished JSON with ``finish_reason: "length"`` (as with OpenAI)."""

from __future__ import annotations

import json
import re
from enum import StrEnum
from typing import Annotated, Literal

import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from marketplace.jobs.models import Job
from tests.api_fixtures import MODEL, greedy_chat, module_db

pytestmark = [pytest.mark.api]
pytest_plugins = ["tests.api_fixtures"]
db = module_db

Name = Field(max_length=24)
MAX_TOKENS = 160


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Point(BaseModel):
    x: int = Field(ge=-100, le=100)
    y: int = Field(ge=-100, le=100)


class City(BaseModel):
    name: str = Name
    country: str = Name
    population: int = Field(ge=0, le=50_000_000)


class Person(BaseModel):
    name: str = Name
    age: int = Field(ge=0, le=120)


class Book(BaseModel):
    title: str = Name
    author: Person
    year: int = Field(ge=1400, le=2030)


class Library(BaseModel):
    books: list[Book] = Field(min_length=1, max_length=2)


class Paint(BaseModel):
    color: Color
    liters: float = Field(ge=0.5, le=20)


class Traffic(BaseModel):
    light: Literal["red", "amber", "green"]
    seconds: int = Field(ge=1, le=90)


class Tags(BaseModel):
    tags: list[Literal["fast", "cheap", "good"]] = Field(min_length=1, max_length=3)


class MaybeEmail(BaseModel):
    name: str = Name
    email: str | None = Field(max_length=40)


class Flags(BaseModel):
    enabled: bool
    beta: bool


class Temperature(BaseModel):
    celsius: float = Field(ge=-50, le=60)
    city: str = Name


class Polygon(BaseModel):
    points: list[Point] = Field(min_length=3, max_length=4)


class Score(BaseModel):
    team: str = Name
    points: int = Field(ge=0, le=200)
    rank: int = Field(ge=1, le=20)


class Recipe(BaseModel):
    dish: str = Name
    ingredients: list[str] = Field(min_length=1, max_length=3)
    minutes: int = Field(ge=1, le=300)


class Address(BaseModel):
    street: str = Name
    city: City


class Order(BaseModel):
    item: str = Name
    quantity: int = Field(ge=1, le=9)
    express: bool
    color: Color


class Weather(BaseModel):
    sky: Literal["clear", "cloudy", "rain", "snow"]
    wind_kmh: int = Field(ge=0, le=150)
    warning: Literal["none", "yellow", "red"]


class Pet(BaseModel):
    kind: Literal["cat", "dog", "bird"]
    name: str = Name
    owner: Person | None


class Grade(BaseModel):
    student: str = Name
    grade: Literal["A", "B", "C", "D", "F"]
    percent: float = Field(ge=0, le=100)


Digit = Annotated[int, Field(ge=0, le=9)]


class Matrix(BaseModel):
    rows: list[Annotated[list[Digit], Field(min_length=2, max_length=2)]] = Field(min_length=2, max_length=2)


SCHEMAS = [
    (City, "Describe Paris."),
    (Person, "Describe a famous scientist."),
    (Book, "Describe a classic novel."),
    (Library, "List a book in a library."),
    (Paint, "Pick a paint for a kitchen."),
    (Traffic, "Describe a traffic light now."),
    (Tags, "Tag a restaurant."),
    (MaybeEmail, "Describe a contact."),
    (Flags, "Give feature flags."),
    (Temperature, "Give the weather in Rome."),
    (Point, "Give a point on a grid."),
    (Polygon, "Give a triangle."),
    (Score, "Give a football score."),
    (Recipe, "Give a pancake recipe."),
    (Address, "Give an address in London."),
    (Order, "Order a t-shirt."),
    (Weather, "Describe the weather."),
    (Pet, "Describe a pet."),
    (Grade, "Grade a student."),
    (Matrix, "Give a 2x2 matrix of small numbers."),
]


@pytest.fixture
def client(live_swarm) -> OpenAI:
    return OpenAI(base_url=f"{live_swarm.url}/v1", api_key=live_swarm.key, max_retries=0, timeout=180)


def ask(schema: type[BaseModel], request: str) -> list[dict]:
    return [{"role": "user", "content": f"{request} Answer in JSON."}]


@pytest.mark.parametrize(("schema", "request_text"), SCHEMAS, ids=[schema.__name__ for schema, _ in SCHEMAS])
def test_parse_returns_an_object_of_the_schema(client, schema, request_text):
    completion = client.chat.completions.parse(
        model=MODEL, messages=ask(schema, request_text), response_format=schema, max_tokens=MAX_TOKENS, temperature=0
    )

    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, schema)
    assert schema.model_validate_json(choice.message.content) == choice.message.parsed
    stored = Job.objects.get(public_id=completion.id).params["response_format"]
    assert stored["type"] == "json_schema"


class Town(BaseModel):
    """The issue's own: no bound on any field, a float among them."""

    name: str
    country: str
    population_millions: float


def test_a_number_without_bounds_ends_as_a_double_does(client):
    """Greedy, a small model would write a number's digits without end; a number of at most 17
    significant digits (and 3 of exponent) ends well within the length, and parses as a double."""
    completion = client.chat.completions.parse(
        model=MODEL, messages=ask(Town, "Describe Tokyo."), response_format=Town, max_tokens=MAX_TOKENS, temperature=0
    )

    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    town = choice.message.parsed
    assert isinstance(town, Town) and town.name and town.country
    written = re.search(r'"population_millions":\s*-?([0-9.]+)(?:[eE][+-]?([0-9]+))?', choice.message.content)
    assert written is not None, choice.message.content
    assert sum(char.isdigit() for char in written.group(1)) <= 17  # as the model wrote it, not re-read
    assert len(written.group(2) or "") <= 3


def test_sampled_structured_output_validates_too(client):
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=MODEL,
            messages=ask(Order, "Order something."),
            response_format=Order,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
        )

        assert isinstance(completion.choices[0].message.parsed, Order)


def test_json_object_mode_gives_a_json_object(client):
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a JSON object with a key 'a' holding 1."}],
        response_format={"type": "json_object"},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )

    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].message.content), dict)


def test_speculation_changes_no_token_of_structured_output(client):
    def run(speculation: bool) -> str:
        return (
            client.chat.completions.create(
                model=MODEL,
                messages=ask(Library, "List a book in a library."),
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "library", "schema": Library.model_json_schema(), "strict": True},
                },
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"speculation": speculation},
            )
            .choices[0]
            .message.content
        )

    assert run(True) == run(False)


def test_streamed_structured_output_adds_up_to_valid_json(client):
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=ask(Recipe, "Give a pancake recipe."),
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "recipe", "schema": Recipe.model_json_schema()},
        },
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )

    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert Recipe.model_validate_json(text)


def test_the_grammar_changes_what_the_model_would_write(client):
    messages = ask(City, "Describe Paris.")

    free = greedy_chat(messages, 24).text
    constrained = client.chat.completions.parse(
        model=MODEL, messages=messages, response_format=City, max_tokens=MAX_TOKENS, temperature=0
    )

    with pytest.raises(ValueError):
        City.model_validate_json(free)  # left alone, the model does not write this JSON
    assert constrained.choices[0].message.parsed is not None


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ({"type": "xml"}, "response_format"),
        ({"type": "json_schema"}, "response_format.json_schema.name"),
        (
            {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}},
            "response_format.json_schema.name",
        ),
        ({"type": "json_schema", "json_schema": {"name": "s", "schema": []}}, "response_format.json_schema.schema"),
        (
            {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string", "format": "no-such"}}},
            "response_format",
        ),
    ],
    ids=["type", "no-spec", "bad-name", "schema-not-object", "uncompilable"],
)
def test_a_bad_response_format_is_refused_400_before_any_job(client, response_format, param):
    jobs = Job.objects.count()

    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL, messages=ask(City, "x"), response_format=response_format, max_tokens=8
        )

    assert refused.value.response.json()["error"]["param"] == param
    assert Job.objects.count() == jobs
