"""The default pool of texts a challenge's prompt is made from (``traffic.draw_request``).

Public, so a node that runs the layers before its span could learn to recognise these texts: an
operator sets ``SWARM_CHALLENGE_PROMPTS`` to a file of their own (one text per line, kept private),
ideally written like the traffic their customers send. A prompt is assembled from several texts
(earlier turns of a conversation, a cut to the length drawn), so even this pool gives many prompts.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

from django.conf import settings

DEFAULT_POOL: tuple[str, ...] = (
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about autumn leaves falling in a quiet park.",
    "What is the capital of Australia, and why is it not Sydney?",
    "Summarize the plot of Romeo and Juliet for a ten-year-old.",
    "How do I reverse a list in Python without using the reverse method?",
    "Give me three ideas for a birthday party for my grandmother, who loves gardening.",
    "Translate 'Where is the train station?' into French, Spanish and German.",
    "What are the main differences between TCP and UDP?",
    "Can you help me write a polite email asking my landlord to fix the heating?",
    "List five healthy breakfast options that take less than ten minutes to prepare.",
    "Why do cats purr? Keep the answer short.",
    "Write a haiku about the ocean at night.",
    "I have eggs, spinach, onions and cheese. What can I cook for dinner?",
    "Explain what a hash table is and when I should use one.",
    "What happened during the French Revolution, in a few bullet points?",
    "How many minutes are there in a week? Show the calculation.",
    "Suggest a name for a small bakery that sells sourdough bread and pastries.",
    "Describe the water cycle in simple words.",
    "What is the difference between weather and climate?",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Tell me a fun fact about octopuses.",
    "How can I improve my sleep? Give practical tips.",
    "Rewrite this sentence to sound more formal: we gotta finish this by friday or we're toast.",
    "What does the term 'opportunity cost' mean in economics?",
    "Plan a three-day trip to Rome for someone who loves history and food.",
    "Explain recursion to a beginner programmer with a simple example.",
    "What are some good habits for learning a new language?",
    "Write a limerick about a programmer who forgot to save their work.",
    "Why is the Pacific Ocean called pacific?",
    "Compare electric cars and petrol cars in terms of running costs.",
    "What should I pack for a weekend hiking trip in the mountains?",
    "Give me a short motivational message for a Monday morning.",
    "How does photosynthesis work?",
    "Write a function in JavaScript that checks whether a string is a palindrome.",
    "What is the tallest mountain in Africa and how high is it?",
    "Explain the rules of chess in a short paragraph.",
    "I feel stressed about my exams next week. Any advice?",
    "What is machine learning, in plain English?",
    "Draft a tweet announcing the opening of a new community library.",
    "Why do we have leap years?",
    "Give me a recipe for a simple tomato soup.",
    "What are black holes made of?",
    "Write a short story opening line that makes the reader want to continue.",
    "How do vaccines train the immune system?",
    "What are the pros and cons of working from home?",
    "Convert 72 degrees Fahrenheit to Celsius and explain the formula.",
    "Describe the taste of a mango to someone who has never eaten one.",
    "What is the best way to store fresh herbs?",
    "Explain the difference between a virus and a bacterium.",
    "Name three famous paintings by Vincent van Gogh and describe one of them.",
    "How do I set up a Python virtual environment?",
    "What is inflation and why does it happen?",
    "Write a thank-you note to a colleague who helped me with a difficult project.",
    "Why does ice float on water?",
    "What are some easy houseplants for a beginner?",
    "Explain what an API is using a restaurant analogy.",
    "Give me a workout plan for three days a week with no equipment.",
    "What is the meaning of the idiom 'break the ice'?",
    "How far is the Moon from the Earth?",
    "Write a product description for a reusable water bottle.",
)


@cache
def _read(path: str) -> tuple[str, ...]:
    lines = tuple(line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines())
    texts = tuple(line for line in lines if line)
    if not texts:
        raise ValueError(f"SWARM_CHALLENGE_PROMPTS names {path}, which holds no text")
    return texts


def prompt_pool() -> tuple[str, ...]:
    """The texts challenges' prompts are made of: the operator's file, or the default pool."""
    path = settings.SWARM_CHALLENGE_PROMPTS
    return _read(str(path)) if path else DEFAULT_POOL
