"""The built-in tiny conversation set (``builtin:tiny-chat``), generated deterministically.

Prompts are short, varied user requests composed from small word lists with a fixed seed; each
conversation has a placeholder assistant turn that ``dflash-extract regenerate`` replaces with the
teacher's own generation. The same text also trains the tiny teacher's tokenizer.
"""

from __future__ import annotations

import random

BUILTIN_SEED = 20260602
DEFAULT_NUM_CONVERSATIONS = 320

_TOPICS = [
    "rivers", "volcanoes", "bread", "bicycles", "glaciers", "bees", "clocks", "bridges", "tides",
    "compilers", "gardens", "batteries", "comets", "coffee", "libraries", "magnets", "forests",
    "trains", "deserts", "music", "rainbows", "chess", "spiders", "satellites", "cheese", "tea",
    "windmills", "oceans", "languages", "mountains", "printers", "whales", "maps", "soap", "storms",
    "robots", "candles", "owls", "telescopes", "islands", "paper", "engines", "ants", "thunder",
]
_ADJECTIVES = [
    "small", "ancient", "modern", "quiet", "bright", "cold", "busy", "simple", "strange", "gentle",
    "heavy", "fast", "careful", "curious", "distant", "tiny", "golden", "broken", "hidden", "early",
]
_AUDIENCES = [
    "a child", "a farmer", "a student", "my grandmother", "a sailor", "a new engineer", "a poet",
    "a tired doctor", "a beginner", "a friend", "a teacher", "a robot",
]
_VERBS = ["work", "change", "grow", "move", "fail", "begin", "matter", "sound", "last", "travel"]
_PLACES = [
    "in winter", "at night", "near the sea", "in a city", "on a farm", "in space", "under the ground",
    "in old stories", "during a storm", "in the morning",
]
_TEMPLATES = [
    "Explain how {topic} {verb} {place}.",
    "Write a short poem about {adj} {topic}.",
    "Why do {topic} {verb} {place}?",
    "Describe {adj} {topic} to {audience}.",
    "Give me three facts about {topic}.",
    "Tell a story about {adj} {topic} {place}.",
    "What would happen if {topic} stopped working {place}?",
    "Compare {topic} and {topic2} for {audience}.",
    "List some {adj} ideas about {topic}.",
    "How can {audience} learn about {topic}?",
    "Summarize what you know about {adj} {topic}.",
    "Is it true that {topic} {verb} faster {place}?",
]
_FOLLOW_UPS = [
    "Can you make it shorter?", "Now explain it to {audience}.", "Give one more example.",
    "What about {topic2}?", "Why is that?",
]
_SYSTEM_PROMPTS = [
    "You are a helpful assistant.", "You are a concise assistant.", "You answer like a friendly teacher.",
]
_ANSWER_OPENINGS = [
    "Here is a short answer.", "Good question.", "Let me explain.", "Sure.", "In short:",
]


def _fill(template: str, rng: random.Random) -> str:
    topic, topic2 = rng.sample(_TOPICS, 2)
    return template.format(
        topic=topic, topic2=topic2, adj=rng.choice(_ADJECTIVES), audience=rng.choice(_AUDIENCES),
        verb=rng.choice(_VERBS), place=rng.choice(_PLACES),
    )


def _placeholder_answer(prompt: str, rng: random.Random) -> str:
    words = [w.strip(".,?!").lower() for w in prompt.split()]
    body = " ".join(rng.choice(words) for _ in range(rng.randint(12, 40)))
    return f"{rng.choice(_ANSWER_OPENINGS)} {body}."


def builtin_conversations(n: int = DEFAULT_NUM_CONVERSATIONS, seed: int = BUILTIN_SEED) -> list[dict]:
    """``n`` conversations ``{"messages": [...]}``: optional system, 1-2 user turns, placeholder replies."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages: list[dict[str, str]] = []
        if rng.random() < 0.3:
            messages.append({"role": "system", "content": rng.choice(_SYSTEM_PROMPTS)})
        prompt = _fill(rng.choice(_TEMPLATES), rng)
        messages += [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": _placeholder_answer(prompt, rng)},
        ]
        if rng.random() < 0.25:
            follow = _fill(rng.choice(_FOLLOW_UPS), rng)
            messages += [
                {"role": "user", "content": follow},
                {"role": "assistant", "content": _placeholder_answer(prompt + " " + follow, rng)},
            ]
        out.append({"messages": messages})
    return out


def builtin_prompts(n: int = DEFAULT_NUM_CONVERSATIONS, seed: int = BUILTIN_SEED) -> list[str]:
    """The first user turn of each built-in conversation."""
    convs = builtin_conversations(n, seed)
    return [next(m["content"] for m in c["messages"] if m["role"] == "user") for c in convs]


def tokenizer_corpus() -> list[str]:
    """Text that trains the tiny tokenizer: every word list, template and generated conversation."""
    lines = [" ".join(words) for words in (_TOPICS, _ADJECTIVES, _AUDIENCES, _VERBS, _PLACES)]
    lines += _TEMPLATES + _FOLLOW_UPS + _SYSTEM_PROMPTS + _ANSWER_OPENINGS
    for conv in builtin_conversations(2000, seed=BUILTIN_SEED + 1):
        lines += [m["content"] for m in conv["messages"]]
    return lines
