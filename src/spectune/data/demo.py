"""Built-in demo data: phone voice-bot dialogues written by this generator (no third-party text).

A caller phones "Brightline", a home-services company; the bot books, moves and cancels visits, tracks orders,
answers billing and opening-hours questions, changes addresses, resets PINs, and hands over to a human.
Answers are short and spoken-style. The same seed gives the same dialogues.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from pydantic import Field

from spectune.config import Settings
from spectune.data.read import Dialogue

FIRST_NAMES = [
    "Anna",
    "Ben",
    "Carla",
    "David",
    "Elena",
    "Farid",
    "Grace",
    "Hugo",
    "Irene",
    "Jamal",
    "Keiko",
    "Liam",
    "Maria",
    "Noah",
    "Olga",
    "Pedro",
    "Quinn",
    "Rosa",
    "Sam",
    "Tara",
    "Umar",
    "Vera",
    "Wei",
    "Xena",
    "Yusuf",
    "Zoe",
    "Amir",
    "Bianca",
    "Chen",
    "Diego",
    "Emma",
    "Felix",
    "Hana",
    "Ivan",
    "Julia",
    "Kofi",
    "Lena",
    "Mateo",
    "Nina",
]
LAST_NAMES = [
    "Adams",
    "Baker",
    "Costa",
    "Dubois",
    "Evans",
    "Fischer",
    "Garcia",
    "Hughes",
    "Ito",
    "Jensen",
    "Kowalski",
    "Lopez",
    "Moreau",
    "Novak",
    "Okafor",
    "Patel",
    "Quintero",
    "Rossi",
    "Silva",
    "Tanaka",
    "Usman",
    "Vogel",
    "Walsh",
    "Xu",
    "Young",
    "Zimmer",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
SERVICES = ("boiler service", "plumbing repair", "electrical check", "window cleaning", "heating inspection")
ITEMS = ("water filter", "smart thermostat", "replacement tap", "smoke alarm", "shower head", "door lock")
STREETS = (
    "Oak Street",
    "Mill Lane",
    "Station Road",
    "Park Avenue",
    "River Walk",
    "Church Street",
    "Hill Road",
)
CITIES = ("Springfield", "Riverton", "Lakeside", "Northgate", "Fairview", "Brookhaven")
STATUSES = (
    ("shipped", "It left our warehouse yesterday and should arrive {c.day}."),
    ("out for delivery", "It's out for delivery today and should reach you before six."),
    ("processing", "We're still packing it. It should ship by {c.day}."),
    ("delayed", "I'm sorry, it's delayed by two days. The new delivery day is {c.day}."),
)

BILLING_FOLLOW_UPS = (
    ("Can I pay it in two parts?", "Yes. I've split it into two payments, the first due on {c.date}."),
    ("Okay. When is it due?", "It's due on {c.date}. You can pay by card or bank transfer."),
    ("Can you send me the invoice?", "Of course. I've emailed the invoice to the address on your account."),
)

Turns = list[dict[str, str]]


class Caller:
    """Random slot values for one call."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.first = rng.choice(FIRST_NAMES)
        self.last = rng.choice(LAST_NAMES)
        self.day = rng.choice(DAYS)
        self.date = f"{rng.choice(MONTHS)} {rng.randint(1, 28)}"
        self.time = self.clock()
        self.other_time = self.clock()
        while self.other_time == self.time:
            self.other_time = self.clock()
        letters = "ABCDEFGHJKLMNPRSTUVWXYZ"
        self.ref = f"{rng.choice(letters)}{rng.choice(letters)}-{rng.randint(10000, 99999)}"
        self.amount = f"{rng.randint(12, 480)}.{rng.choice(('00', '50', '25', '99', '75'))}"
        self.service = rng.choice(SERVICES)
        self.item = rng.choice(ITEMS)
        self.address = f"{rng.randint(1, 240)} {rng.choice(STREETS)}, {rng.choice(CITIES)}"

    def clock(self) -> str:
        hour = self.rng.randint(8, 17)
        minute = self.rng.choice((0, 0, 15, 30, 45))
        suffix = "am" if hour < 12 else "pm"
        hour12 = hour if hour <= 12 else hour - 12
        return f"{hour12}:{minute:02d} {suffix}" if minute else f"{hour12} {suffix}"

    def say(self, *options: str, **extra: object) -> str:
        """One of the phrasings, at random, with this call's slots filled in."""
        return self.rng.choice(options).format(c=self, **extra)

    def user(self, *options: str, **extra: object) -> dict[str, str]:
        return {"role": "user", "content": self.say(*options, **extra)}

    def bot(self, *options: str, **extra: object) -> dict[str, str]:
        return {"role": "assistant", "content": self.say(*options, **extra)}


def _identify(c: Caller) -> Turns:
    return [
        c.bot(
            "Can I have your name, please?",
            "Sure. What's your full name?",
            "Of course. Who am I speaking with?",
        ),
        c.user("It's {c.first} {c.last}.", "{c.first} {c.last}.", "My name is {c.first} {c.last}."),
    ]


def booking(c: Caller) -> Turns:
    turns = [
        c.user(
            "Hi, I'd like to book a {c.service}.",
            "Hello, can I schedule a {c.service} for {c.day}?",
            "I need someone to come for a {c.service}.",
            "Yeah hi, I want to book an appointment for a {c.service}.",
        )
    ]
    turns += _identify(c)
    turns += [
        c.bot(
            "Thanks, {c.first}. On {c.day} I have {c.time} or {c.other_time}. Which suits you?",
            "Thank you. I can offer {c.day} at {c.time} or at {c.other_time}.",
        ),
        c.user("{c.time}, please.", "Let's do {c.time}.", "{c.time} works for me."),
        c.bot(
            "Done. Your {c.service} is booked for {c.day} at {c.time}. Your reference is {c.ref}.",
            "All set, {c.first}. {c.day} at {c.time}. The reference number is {c.ref}.",
        ),
    ]
    return turns


def rescheduling(c: Caller) -> Turns:
    return [
        c.user(
            "I need to move my appointment.",
            "Can I reschedule my visit? The reference is {c.ref}.",
            "Hi, something came up and I have to change my booking.",
        ),
        c.bot("No problem. What's your booking reference?", "Sure. Can you read me the reference number?"),
        c.user("It's {c.ref}.", "{c.ref}.", "The reference is {c.ref}."),
        c.bot(
            "I see your {c.service} on {c.date}. What day would you prefer instead?",
            "Found it, a {c.service} on {c.date}. When would you like to move it to?",
        ),
        c.user("{c.day} if possible.", "How about {c.day}?", "Any time on {c.day}."),
        c.bot(
            "I've moved it to {c.day} at {c.time}. You'll get a text to confirm.",
            "Done. The new time is {c.day} at {c.time}.",
        ),
    ]


def cancelling(c: Caller) -> Turns:
    turns = [
        c.user(
            "I want to cancel my appointment.",
            "Please cancel my booking, reference {c.ref}.",
            "Hi, I won't need the {c.service} anymore. Can you cancel it?",
        )
    ]
    turns += [
        c.bot("I can help with that. What's the booking reference?", "Sure. What's your reference number?"),
        c.user("{c.ref}.", "It's {c.ref}."),
        c.bot(
            "Your {c.service} on {c.date} is cancelled. There's no charge.",
            "Okay, I've cancelled the visit on {c.date}. You won't be charged.",
        ),
    ]
    return turns


def order_status(c: Caller) -> Turns:
    status, detail = c.rng.choice(STATUSES)
    return [
        c.user(
            "Where is my order?",
            "Hi, I'm calling about my {c.item} order.",
            "Can you check the status of order {c.ref}?",
        ),
        c.bot("Let me check. What's the order number?", "Sure. Can I have the order number, please?"),
        c.user("{c.ref}.", "It's {c.ref}.", "The number is {c.ref}."),
        c.bot(f"Your {{c.item}} is {status}. {detail}"),
    ]


def billing(c: Caller) -> Turns:
    turns = [
        c.user(
            "I have a question about my bill.",
            "Why was I charged {c.amount} dollars?",
            "Hi, there's a charge on my account I don't understand.",
        ),
    ]
    turns += _identify(c)
    turns += [
        c.bot(
            "Thanks, {c.first}. The charge of {c.amount} dollars is for the {c.service} on {c.date}.",
            "I see it. {c.amount} dollars for the {c.service} on {c.date}.",
        ),
    ]
    question, answer = c.rng.choice(BILLING_FOLLOW_UPS)
    turns += [c.user(question), c.bot(answer)]
    return turns


def opening_hours(c: Caller) -> Turns:
    close = c.rng.choice(("5 pm", "6 pm", "7 pm"))
    return [
        c.user("What are your opening hours?", "Are you open on {c.day}?", "When can I call you?"),
        c.bot(
            "We're open Monday to Friday, 8 am to {close}, and Saturday 9 am to 1 pm. We're closed on Sunday.",
            close=close,
        ),
    ]


def address_change(c: Caller) -> Turns:
    turns = [
        c.user(
            "I moved and need to update my address.",
            "Can you change the address on my account?",
            "Hi, I have a new address.",
        )
    ]
    turns += _identify(c)
    turns += [
        c.bot("Thanks, {c.first}. What's the new address?", "Got it. What's your new address?"),
        c.user("{c.address}.", "It's {c.address}."),
        c.bot("Updated. Your address is now {c.address}.", "Thanks. I've changed it to {c.address}."),
    ]
    return turns


def reset_pin(c: Caller) -> Turns:
    return [
        c.user("I forgot my account PIN.", "Can you reset my PIN?", "I'm locked out of my account."),
        c.bot(
            "I can send a reset code. Is your phone number still the one ending in {n}?",
            "Sure. I'll text a code to the number ending in {n}. Is that right?",
            n=c.rng.randint(1000, 9999),
        ),
        c.user("Yes, that's right.", "Yes.", "Yep, that's me."),
        c.bot(
            "The code is on its way. Enter it in the app to choose a new PIN.",
            "Sent. Use the code to set a new PIN in the app.",
        ),
    ]


def transfer_to_human(c: Caller) -> Turns:
    return [
        c.user(
            "Can I speak to a person?",
            "I want to talk to a human.",
            "Put me through to an agent, please.",
        ),
        c.bot(
            "Of course. Can I ask what it's about, so I connect you to the right team?",
            "Sure. What's it about?",
        ),
        c.user("It's about a complaint.", "A problem with my last {c.service}.", "It's a billing issue."),
        c.bot(
            "Thanks. I'm transferring you now. The wait is about {m} minutes.",
            "I'll put you through now. Someone will be with you in about {m} minutes.",
            m=c.rng.randint(2, 9),
        ),
    ]


INTENTS: dict[str, Callable[[Caller], Turns]] = {
    "booking": booking,
    "rescheduling": rescheduling,
    "cancelling": cancelling,
    "order_status": order_status,
    "billing": billing,
    "opening_hours": opening_hours,
    "address_change": address_change,
    "reset_pin": reset_pin,
    "transfer_to_human": transfer_to_human,
}
CLOSINGS = (
    ("Thanks, bye.", "You're welcome. Have a great day!"),
    ("That's all, thank you.", "Glad I could help. Goodbye!"),
    ("Great, thanks.", "You're welcome. Is there anything else?"),
)


class DemoDataSettings(Settings):
    demo_dialogues: int = Field(2000, ge=100, le=50_000, description="How many demo dialogues to generate.")


class DemoDataConfig(DemoDataSettings):
    """Everything `spectune data demo` takes."""

    out: Path = Field(description="Where to write the dialogues (JSONL).")
    seed: int = Field(0, description="Seed: the same seed gives the same dialogues.")


def generate_dialogues(n: int, seed: int = 0) -> list[Dialogue]:
    """`n` voice-bot dialogues (2–8 turns), every intent in turn, deterministic by `seed`."""
    if not 1 <= n <= 1_000_000:
        raise ValueError(f"n must be between 1 and 1,000,000, got {n}")
    rng = random.Random(seed)
    names = list(INTENTS)
    dialogues = []
    for index in range(n):
        intent = names[index % len(names)] if index < len(names) else rng.choice(names)
        caller = Caller(rng)
        turns = INTENTS[intent](caller)
        if len(turns) <= 6 and rng.random() < 0.5:
            thanks, goodbye = rng.choice(CLOSINGS)
            turns += [caller.user(thanks), caller.bot(goodbye)]
        dialogues.append(Dialogue(turns, source=f"demo:{intent}", line=index + 1))
    return dialogues
