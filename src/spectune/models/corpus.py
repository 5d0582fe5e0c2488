"""A broad "general" corpus written by this generator, to pretrain the demo world's generic base models.

Many kinds of text (stories, facts, arithmetic, recipes, weather, code, letters, tables, several scripts) and
generic assistant chats, but never the voice-bot task: the off-the-shelf draft must really be generic.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from spectune.data.demo import CITIES, DAYS, FIRST_NAMES, ITEMS, LAST_NAMES, MONTHS, SERVICES, STREETS

PEOPLE = "Ada Bruno Chloe Dmitri Esther Fatima Gustav Helga Ines Jonas Kwame Lucia Malik Nora Otto Priya".split()
PLACES = "market library harbour forest station museum garden bakery village mountain river school".split()
ANIMALS = {
    "fox": ("mammal", "forests"),
    "heron": ("bird", "wetlands"),
    "salmon": ("fish", "rivers"),
    "gecko": ("reptile", "deserts"),
    "otter": ("mammal", "rivers"),
    "owl": ("bird", "woods"),
    "frog": ("amphibian", "ponds"),
    "whale": ("mammal", "oceans"),
    "beetle": ("insect", "meadows"),
    "penguin": ("bird", "cold coasts"),
}
FOODS = "bread apples cheese soup rice lentils pears noodles honey carrots olives tomatoes".split()
ADJECTIVES = "quiet bright old narrow busy cold warm green tall small golden dusty".split()
VERBS = "found painted carried opened counted followed repaired planted watched measured".split()
OBJECTS = "map lantern letter clock bicycle basket kite compass violin notebook".split()
GREETINGS = (
    "Bonjour, ça va très bien, merci !",
    "Guten Morgen! Die Straße ist heute ruhig.",
    "¿Dónde está la estación? Está allí, señor.",
    "Привет! Как дела?",
    "你好，今天天气很好。",
    "こんにちは、お元気ですか。",
    "Καλημέρα! Τι κάνεις;",
    "مرحبا، كيف حالك؟",
    "नमस्ते, आप कैसे हैं?",
    "안녕하세요, 반갑습니다.",
    "Olá! Até amanhã, João.",
    "Hyvää päivää! Kiitos paljon.",
)
EMOJI = ["🙂", "🚀", "🌧️", "☀️", "🍎", "📚", "🎵", "✅", "🦙", "🐟", "❤️", "👍🏽"]
FUNCTIONS = (
    ("double", "x * 2"),
    ("square", "x * x"),
    ("is_even", "x % 2 == 0"),
    ("halve", "x / 2"),
    ("negate", "-x"),
    ("increment", "x + 1"),
)


def story(rng: random.Random) -> str:
    name, other = rng.sample(PEOPLE, 2)
    place = rng.choice(PLACES)
    lines = [
        f"{name} walked to the {rng.choice(ADJECTIVES)} {place} early in the morning.",
        f"There {name} {rng.choice(VERBS)} the {rng.choice(OBJECTS)} that belonged to {other}.",
        f"{other} had been looking for it for {rng.randint(2, 19)} days.",
        f'"Thank you," said {other}, and they shared some {rng.choice(FOODS)} by the {rng.choice(PLACES)}.',
    ]
    return " ".join(lines[: rng.randint(2, 4)])


def fact(rng: random.Random) -> str:
    animal, (kind, habitat) = rng.choice(list(ANIMALS.items()))
    return rng.choice(
        (
            f"The {animal} is a {kind} that lives in {habitat}.",
            f"Most {animal}s live in {habitat}. The {animal} is a {kind}.",
            f"Q: What kind of animal is a {animal}?\nA: A {kind}. It is found in {habitat}.",
        )
    )


def arithmetic(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    op = rng.choice("+-*")
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    if rng.random() < 0.5:
        return f"{a} {op} {b} = {value}"
    name = rng.choice(PEOPLE)
    food = rng.choice(FOODS)
    return f"{name} has {a} {food} and buys {b} more. Now {name} has {a + b} {food}."


def recipe(rng: random.Random) -> str:
    items = rng.sample(FOODS, 3)
    steps = [
        f"Wash the {items[0]}.",
        f"Cook the {items[1]} for {rng.randint(5, 40)} minutes.",
        f"Add the {items[2]} and a pinch of salt.",
        f"Serve warm to {rng.randint(2, 8)} people.",
    ]
    return f"Recipe: {items[0]} and {items[1]}\n" + "\n".join(f"{i}. {s}" for i, s in enumerate(steps, 1))


def weather(rng: random.Random) -> str:
    low = rng.randint(-12, 18)
    return (
        f"Weather for {rng.choice(PEOPLE)}ville: {rng.choice(('sunny', 'cloudy', 'rain', 'snow', 'windy'))}, "
        f"low {low}°C, high {low + rng.randint(2, 14)}°C, humidity {rng.randint(20, 99)}%."
    )


def code(rng: random.Random) -> str:
    name, body = rng.choice(FUNCTIONS)
    n = rng.randint(1, 50)
    return f"def {name}(x):\n    return {body}\n\n\nfor x in range({n}):\n    print({name}(x))\n"


def letter(rng: random.Random) -> str:
    writer, reader = rng.sample(PEOPLE, 2)
    return (
        f"Dear {reader},\n\nI hope you are well. The {rng.choice(PLACES)} was {rng.choice(ADJECTIVES)} "
        f"this year, and I {rng.choice(VERBS)} a {rng.choice(OBJECTS)}.\n\nBest wishes,\n{writer}"
    )


def table(rng: random.Random) -> str:
    rows = [f"{food},{rng.randint(1, 20)}.{rng.randint(0, 99):02d}" for food in rng.sample(FOODS, rng.randint(2, 5))]
    return "item,price\n" + "\n".join(rows)


def multilingual(rng: random.Random) -> str:
    picked = rng.sample(GREETINGS, rng.randint(1, 3))
    return " ".join(picked) + " " + " ".join(rng.sample(EMOJI, rng.randint(0, 3)))


def everyday(rng: random.Random) -> str:
    """News-like prose with the everyday words any pretrained model knows (names, dates, times, money,
    services, goods, places): the words of a voice-bot task, never its dialogue."""

    name = f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"
    day, month = rng.choice(DAYS), rng.choice(MONTHS)
    return rng.choice(
        (
            f"On {day}, {name} ordered a {rng.choice(ITEMS)} and paid {rng.randint(5, 400)} dollars.",
            f"The {rng.choice(SERVICES)} company in {rng.choice(CITIES)} opened a new office on {rng.choice(STREETS)}.",
            f"{name} moved to {rng.randint(1, 240)} {rng.choice(STREETS)} in {month} and changed every address.",
            f"Reference numbers, dates and times were printed on the invoice: {month} {rng.randint(1, 28)}, "
            f"{rng.randint(1, 12)} {rng.choice(('am', 'pm'))}.",
            f"The delivery was delayed until {day}, so {name} called the shop to check the status of the order.",
            f"In {rng.choice(CITIES)}, most appointments are booked by phone, and many people cancel or reschedule.",
        )
    )


KINDS: dict[str, Callable[[random.Random], str]] = {
    "everyday": everyday,
    "story": story,
    "fact": fact,
    "arithmetic": arithmetic,
    "recipe": recipe,
    "weather": weather,
    "code": code,
    "letter": letter,
    "table": table,
    "multilingual": multilingual,
}


def generic_chat(rng: random.Random) -> list[dict[str, str]]:
    """A general-assistant exchange (no voice-bot task), so base models know the chat format."""
    animal, (kind, habitat) = rng.choice(list(ANIMALS.items()))
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    name, body = rng.choice(FUNCTIONS)
    pairs = (
        (f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."),
        (f"Where do {animal}s live?", f"{animal.capitalize()}s usually live in {habitat}."),
        (f"Is a {animal} a {kind}?", f"Yes, the {animal} is a {kind}."),
        (f"Write a Python function called {name}.", f"def {name}(x):\n    return {body}"),
        (f"Tell me a short story about {rng.choice(PEOPLE)}.", story(rng)),
        ("Give me a recipe.", recipe(rng)),
        ("Translate hello into another language, please.", rng.choice(GREETINGS)),
    )
    turns = []
    for question, answer in rng.sample(pairs, rng.randint(1, 3)):
        turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return turns


def generate_corpus(n: int, seed: int = 0) -> list[str]:
    """`n` plain-text documents of every kind, deterministic by `seed`."""
    rng = random.Random(seed)
    kinds = list(KINDS.values())
    return ["\n".join(rng.choice(kinds)(rng) for _ in range(rng.randint(1, 4))) for _ in range(n)]


def generate_chats(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    rng = random.Random(seed + 1)
    return [generic_chat(rng) for _ in range(n)]
