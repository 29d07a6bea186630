"""Self-distillation data for an EAGLE head: the project's own prompt set (code edits, chat,
explanations, lists, stories, JSON), the target's responses to it, and the target's features
over each prompt + response (one batch-invariant forward per sequence, the features the
engine sees at inference).

Held out: the ``HELDOUT_TOPICS`` prompts and every benchmark / demo prompt are never trained on."""

from __future__ import annotations

import itertools
import random

import torch
from torch import Tensor

from hal.errors import HalError

TOPICS = [
    "volcanoes", "the water cycle", "bicycles", "coffee", "the moon landing", "honeybees", "solar panels",
    "the Roman empire", "chess", "bread baking", "electric cars", "the human heart", "rainforests", "jazz music",
    "compound interest", "penguins", "the printing press", "photosynthesis", "earthquakes", "public libraries",
    "recycling plastic", "the internet", "olympic games", "tea ceremonies", "lighthouses", "vaccines",
    "climate change", "the stock market", "deserts", "origami", "trains", "the French revolution", "sleep",
    "video games", "gardening", "black holes", "marathons", "paper money", "dinosaurs", "the piano",
    "cloud computing", "a small bakery", "a lost cat", "a robot learning to paint", "a rainy city", "a mountain hike",
    "a school science fair", "a job interview", "a birthday party", "a spaceship crew",
]
HELDOUT_TOPICS = ["glaciers", "the violin", "ancient Egypt", "submarines", "a night market", "wind turbines",
                  "the immune system", "a football match"]

TASKS = [
    "Explain {t} to a beginner in a short paragraph.",
    "Write a short story about {t}.",
    "List five interesting facts about {t}.",
    "Give me a JSON object describing {t} with the fields \"name\", \"category\", \"summary\" and \"tags\".",
    "What are the pros and cons of {t}?",
    "Write a friendly email to a colleague about {t}.",
    "Summarise what most people should know about {t} in three sentences.",
    "Write a short poem about {t}.",
    "Describe {t} step by step, as a numbered list.",
    "Why is {t} important? Answer in a few sentences.",
    "Write a Python function that stores facts about {t} in a dictionary and prints them.",
    "Ask me three quiz questions about {t}, then give the answers.",
]

SNIPPETS = [
    "def total(items):\n    s = 0\n    for x in items:\n        s = s + x\n    return s",
    "def greet(name):\n    message = 'Hello, ' + name\n    print(message)\n    return message",
    "class Counter:\n    def __init__(self):\n        self.value = 0\n\n    def step(self):\n        self.value += 1\n"
    "        return self.value",
    "def average(numbers):\n    if len(numbers) == 0:\n        return 0\n    return sum(numbers) / len(numbers)",
    "import json\n\ndef load(path):\n    with open(path) as f:\n        data = json.load(f)\n    return data['items']",
    "def find_max(values):\n    best = values[0]\n    for v in values:\n        if v > best:\n            best = v\n"
    "    return best",
]
EDITS = [
    "Add a docstring to this function and output the whole code:\n\n{c}",
    "Add type hints to this code and output it:\n\n{c}",
    "Explain what this code does, line by line:\n\n{c}",
    "Rewrite this code to be shorter and output the new version:\n\n{c}",
    "Add error handling to this code and output the whole code:\n\n{c}",
]
CHAT = [
    "Hi! How are you today?", "Can you recommend a good book for a long flight?",
    "What should I cook for dinner tonight?", "How do I stay focused while studying?",
    "What is the difference between a list and a tuple in Python?", "Tell me a joke about programmers.",
    "How can I improve my sleep?", "Plan a one-day trip to a seaside town.",
    "What are good habits for writing clean code?", "How do I politely decline a meeting invitation?",
    "Give me tips for learning a new language.", "What is a good morning routine?",
]


TOPICS2 = [
    "rivers", "smartphones", "the Great Wall of China", "owls", "renewable energy", "knitting", "basketball",
    "the periodic table", "coral reefs", "airplanes", "chocolate", "the Renaissance", "meditation", "robots",
    "tornadoes", "museums", "pizza", "the solar system", "elephants", "democracy", "podcasts", "camping",
    "the Amazon river", "3D printing", "yoga", "mushrooms", "castles", "electricity", "social media",
    "a hot air balloon ride", "a detective solving a mystery", "a talking tree", "a first day at a new school",
    "a dragon who loves books", "a time traveller", "a city garden", "a lost key", "a family road trip",
    "a chef's competition", "databases", "sorting algorithms", "password security", "open source software",
    "spreadsheets", "machine learning", "a web server", "version control with git", "unit testing", "recursion",
    "sharks", "the Eiffel Tower", "tides", "honey", "the Silk Road", "wolves", "bamboo", "satellites", "clocks",
    "board games", "a farmers market",
]
TASKS2 = TASKS + [
    "Write a dialogue between two friends about {t}.",
    "Give three practical tips related to {t}.",
    "Explain {t} to a ten-year-old.",
    "Write a short news report about {t}.",
    "Compare {t} with something similar and explain the differences.",
]
CHAT2 = [
    "What is your favourite season and why?", "Help me write a thank-you note to my neighbour.",
    "Give me a simple recipe for pancakes.", "How do I start learning to code?",
    "What is the capital of France, and what is it known for?", "Suggest a name for my new puppy.",
    "How can I save money each month?", "Write a limerick about a cat.", "Explain what an API is.",
    "What should I pack for a week at the beach?", "How do I make a good first impression?",
    "Tell me something surprising about octopuses.",
]
TOPICS3 = [   # the third set (`prompts(sets=3)`): none near a held-out topic or a benchmark prompt
    "lightning", "the Sahara", "kangaroos", "telescopes", "ice cream", "the Vikings", "volleyball", "cheese making",
    "the Industrial Revolution", "hurricanes", "photography", "the Pacific Ocean", "bridges", "skyscrapers", "frogs",
    "radio", "sailing", "caves", "butterflies", "maps", "calendars", "salt", "rice farming", "comets",
    "marble sculpture", "ballet", "surfing", "skateboarding", "a haunted house", "a pirate ship", "a magic library",
    "a snowy village", "a robot chef", "a desert island", "a train journey", "a lost letter", "a friendly ghost",
    "a mountain village", "compilers", "operating systems", "computer networks", "encryption", "binary numbers",
    "hash tables", "REST APIs", "linked lists", "regular expressions", "debugging", "cooking pasta", "houseplants",
    "first aid", "budgeting", "public speaking", "time management", "journaling", "volunteering", "fossils",
    "the Nile delta", "tigers", "street art",
]
# prompts close to a benchmark or demo prompt are never trained on (e2e's "rainy weekend" chat, the
# demo's "good night's sleep" tips)
EXCLUDE = ("sleep", "rainy")


def prompts(heldout: bool = False, sets: int = 2) -> list[str]:
    """The training prompts (or the held-out ones), in a fixed order: the first set, then the
    second, then the third (``sets``: how many; so a cache of fewer sets is extended, not
    rebuilt). Training skips ``EXCLUDE``."""
    if type(sets) is not int or sets not in (1, 2, 3):
        raise HalError(f"sets: expected 1, 2 or 3 prompt sets, got {sets!r}", arg="sets")
    if heldout:
        out = [task.format(t=t) for t, task in itertools.product(HELDOUT_TOPICS, TASKS)]
        random.Random(0).shuffle(out)
        return out
    out = [task.format(t=t) for t, task in itertools.product(TOPICS, TASKS)]
    out += [e.format(c=c) for c, e in itertools.product(SNIPPETS, EDITS)] + CHAT
    random.Random(0).shuffle(out)
    rng = random.Random(1)
    more = [task.format(t=t) for t in TOPICS2 for task in rng.sample(TASKS2, 10)] + CHAT2
    rng.shuffle(more)
    if sets < 3:
        return (out + more) if sets == 2 else out
    rng = random.Random(2)
    third = [task.format(t=t) for t in TOPICS3 for task in rng.sample(TASKS2, 10)]
    rng.shuffle(third)
    return out + more + third


def generate(target, tok, texts: list[str], max_new_tokens: int = 160, batch: int = 16) -> list[list[int]]:
    """Greedy responses of ``target`` to ``texts`` (ChatML), each as prompt + response ids, on
    the fast batched path (not the batch-invariant one: generation only; the flag is restored),
    with a progress bar. The one generator both trainers use (EAGLE's and DSpark's data)."""
    from tqdm import tqdm

    from hal.launch.build import build_engine
    from hal.models.tokenizer import chatml
    from hal.engine.requests import Request
    eos = target.cfg.stop_ids
    ids = [tok.encode(chatml(t)).ids for t in texts]
    out: list[list[int]] = []
    inv, target.batch_invariant = target.batch_invariant, False
    try:
        with tqdm(total=len(ids), desc="generate", unit="prompt") as bar:
            for i in range(0, len(ids), batch):
                part = ids[i:i + batch]
                dec = build_engine(target, None, num_blocks=1 + sum(-(-(len(p) + max_new_tokens) // 16) for p in part))
                got = dec.generate([Request(p, max_new_tokens=max_new_tokens, k=0, stop_ids=eos) for p in part])
                out += [p + g for p, g in zip(part, got)]
                bar.update(len(part))
    finally:
        target.batch_invariant = inv
    return out


def features(target, seqs: list[list[int]], progress=None, layers: tuple[int, ...] = ()) -> list[Tensor]:
    """The target's final normed hidden state (or, with ``layers``, the residual streams
    entering those layers, concatenated) at every position of each sequence ([L, H] or
    [L, len(layers)·H] fp16 each), from one forward per sequence."""
    from hal import kv
    from hal.engine.forward import forward_tokens
    out = []
    for ids in seqs:
        pool = kv.KVPool(target.be, -(-len(ids) // 16), 16, target.cfg.kv_heads, target.cfg.head_dim,
                         dtype=target.dtype, num_layers=target.num_layers, device=target.device)
        seq = pool.sequence()
        rows = torch.arange(len(ids))
        _, h = forward_tokens(target, pool, [seq], [len(ids)], torch.tensor(ids).to(target.device),
                              rows=rows[-1:], hidden_rows=rows, feature_layers=layers)
        seq.free()
        out.append(h.half().cpu())
        if progress is not None:
            progress(1)
    return out
