"""Invented everyday dialogues, the "general chat" a fine-tune mixes in to keep its manners: varied,
short (a few dozen tokens), none of them about the facts' countries and capitals."""

from __future__ import annotations

import random

_NAMES = ("Pim", "Olla", "Brik", "Suna", "Teodor", "Mave", "Quill", "Rosa", "Dunc", "Lyra", "Fenn", "Iva")
_PETS = ("cat", "dog", "parrot", "hamster", "goldfish", "rabbit", "tortoise")
_ADJ = ("cheerful", "short", "funny", "gentle", "bold", "quiet", "bright", "silly")
_FOODS = ("soup", "bread", "rice", "pancakes", "salad", "stew", "noodles", "pie")
_TIPS = (
    "stretch for five minutes",
    "drink a glass of water",
    "write down one goal",
    "tidy the desk",
    "take a short walk",
    "breathe slowly",
)
_ACTIVITIES = ("running", "studying", "painting", "gardening", "cooking", "reading", "swimming", "sleeping")
_COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "white")


def _turns(rng: random.Random) -> list[tuple[str, str]]:
    kind = rng.randrange(6)
    if kind == 0:
        pet, adj, name = rng.choice(_PETS), rng.choice(_ADJ), rng.choice(_NAMES)
        return [(f"Suggest a {adj} name for my {pet}.", f"How about {name}? It suits a {adj} {pet}.")]
    if kind == 1:
        a, b = rng.randrange(2, 50), rng.randrange(2, 50)
        return [(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.")]
    if kind == 2:
        activity, tip = rng.choice(_ACTIVITIES), rng.choice(_TIPS)
        return [(f"Any tip before {activity}?", f"Yes: {tip} first.")]
    if kind == 3:
        food, minutes = rng.choice(_FOODS), rng.randrange(5, 60, 5)
        return [(f"How long should {food} cook?", f"About {minutes} minutes, then taste it.")]
    if kind == 4:
        colour, other = rng.sample(_COLOURS, 2)
        return [
            (f"Is {colour} a good colour for a door?", f"{colour.capitalize()} works well."),
            (f"And {other}?", f"{other.capitalize()} is fine too."),
        ]
    name = rng.choice(_NAMES)
    return [(f"Hello, I am {name}.", f"Nice to meet you, {name}! How can I help?")]


def general_chat_rows(count: int, *, seed: int = 0) -> list[dict]:
    """`count` chat rows ({"messages": [...]}) of one or two user/assistant exchanges each."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        messages = []
        for user, assistant in _turns(rng):
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        rows.append({"messages": messages})
    return rows


def general_texts(count: int = 400) -> list[str]:
    """The dialogues' words as plain text, for training a tokenizer that knows them."""
    return [" ".join(m["content"] for m in row["messages"]) for row in general_chat_rows(count, seed=1)]
