"""Templated training prompts for draft distillation (train split only; never used by benchmarks).

The hand-written collection has a few hundred training prompts; a draft distilled on the target's answers
to them memorises their topics. These templates, written for Nightjar, cross task phrasings with
subject lists to give the target thousands of different things to talk about, so the draft learns the
target's style rather than its answers to a few hundred questions. Deterministic for a given seed.
"""
from __future__ import annotations

import itertools
import random

SUBJECTS = """photosynthesis; the water cycle; volcanoes; earthquakes; black holes; the moon's phases; tides;
rainbows; lightning; magnets; electricity; batteries; solar panels; wind turbines; nuclear power; recycling;
compost; bees; ants; whales; octopuses; dinosaurs; fossils; glaciers; deserts; rainforests; coral reefs;
the human heart; the immune system; vaccines; sleep; dreams; memory; muscles; bones; vitamins; protein;
caffeine; hydration; the internet; email; passwords; encryption; cloud storage; smartphones; GPS; radio;
television; printing presses; the wheel; bridges; skyscrapers; trains; airplanes; rockets; satellites;
submarines; bicycles; electric cars; traffic lights; money; banks; interest rates; inflation; taxes;
budgets; supply and demand; small businesses; marketing; job interviews; resumes; teamwork; leadership;
public speaking; negotiation; time management; habits; motivation; stress; meditation; friendship;
kindness; gratitude; chess; soccer; basketball; swimming; running; yoga; gardening; houseplants;
baking bread; making soup; coffee brewing; tea; chocolate; cheese; spices; rice; pasta; breakfast;
camping; hiking; maps; compasses; weather forecasts; clouds; snow; hurricanes; climate; seasons;
the Roman Empire; ancient Egypt; the printing of books; libraries; museums; castles; pyramids;
the Olympic Games; music notes; pianos; guitars; drums; painting; photography; poetry; novels;
fairy tales; theater; movies; video games; board games; puzzles; prime numbers; fractions; percentages;
probability; geometry; triangles; circles; graphs; statistics; algorithms; sorting; recursion;
databases; spreadsheets; operating systems; computer memory; programming languages; debugging;
version control; unit tests; robots; artificial intelligence; languages; grammar; punctuation;
dictionaries; handwriting; maps of cities; public transport; recycling plastic; saving water;
first aid; fire safety; road safety; pets; dogs; cats; parrots; horses; farms; tractors; wheat;
apples; oranges; bananas; tomatoes; potatoes; honey; salt; sugar; oceans; rivers; lakes; mountains;
islands; caves; stars; planets; comets; the sun; gravity; friction; sound; light; heat; ice""".replace("\n", " ")

TASKS = """Explain {s} in simple terms.
What is the most important thing to know about {s}?
Give me three interesting facts about {s}.
Describe {s} to a ten-year-old.
Write a short paragraph about {s}.
What are the advantages and disadvantages of {s}?
Why does {s} matter in everyday life?
List five words related to {s} and explain each briefly.
Write a short poem about {s}.
Write a haiku about {s}.
Tell me a very short story that involves {s}.
What are common misconceptions about {s}?
How would you teach a beginner about {s}?
Summarize what people should know about {s} in two sentences.
Write three quiz questions about {s}, with answers.
Give a simple analogy that explains {s}.
What questions might a curious student ask about {s}? Answer one of them.
Write a friendly tweet about {s}.
Compare {s} and {t} in a few sentences.
What do {s} and {t} have in common?""".splitlines()

CODE_TASKS = """Write a Python function that {c}.
Write a JavaScript function that {c}.
Explain step by step how you would write a program that {c}.
Write a Python function that {c}, and add a short docstring.
Write a short Python script that {c} and prints the result.""".splitlines()

CODE_GOALS = """reverses a string; counts the vowels in a string; returns the largest number in a list;
checks whether a word is a palindrome; converts Celsius to Fahrenheit; sums the even numbers in a list;
removes duplicates from a list; counts how often each word appears in a sentence; returns the factorial
of n; returns the n-th Fibonacci number; checks whether a year is a leap year; merges two sorted lists;
finds the second smallest number in a list; capitalizes the first letter of every word; splits a list
into chunks of size k; flattens a nested list; computes the average of a list of numbers; checks whether
two strings are anagrams; returns the longest word in a sentence; converts a list of pairs into a
dictionary; counts the lines in a text file; validates that a password has at least eight characters
and one digit; rounds a price to two decimals; generates a random password; finds the common elements of
two lists; rotates a list by k positions; returns the digits of a number as a list; converts minutes to
hours and minutes; checks whether a number is even; returns the greatest common divisor of two numbers;
sorts a list of names alphabetically; counts the uppercase letters in a string; replaces spaces with
underscores; computes the area of a circle from its radius; finds the index of an item in a list;
returns the sum of the digits of a number; builds a multiplication table for n; filters out negative
numbers; joins a list of words with commas; checks whether a list is sorted""".replace("\n", " ")

MATH_TASKS = """A shop sells pencils for {a} cents each. How much do {b} pencils cost? Show your steps.
What is {a} plus {b}? Explain how you added them.
What is {a} times {b}? Show the multiplication step by step.
If a train travels {a} kilometers in {c} hours, what is its average speed?
A class has {a} students and {b} of them are absent. How many are present?
What is {c} percent of {a}?
Sam has {a} apples and gives away {c}. How many are left? Explain.
A rectangle is {c} meters wide and {b} meters long. What is its area and perimeter?
Solve for x: x + {c} = {a}. Show your work.
Is {a} a prime number? Explain how you checked.""".splitlines()

SENTENCES = """The library opens at nine in the morning.; My brother likes to play football after school.;
We are going to the beach this weekend.; Please close the window because it is cold.; The train to the
city leaves in ten minutes.; I would like a cup of tea with milk.; Our neighbors have a small brown dog.;
The museum is closed on Mondays.; She reads a new book every week.; Can you help me carry these bags?;
It rained all day yesterday.; The children are painting pictures in the garden.; Where is the nearest
pharmacy?; I forgot my umbrella at the office.; The soup is too hot to eat right now.; We planted
tomatoes and beans this spring.; He is learning to play the violin.; The concert starts at eight
o'clock.; Thank you for the lovely dinner.; The shop on the corner sells fresh bread.""".replace("\n", " ")

SENTENCE_TASKS = """Translate into French: {x}
Translate into Spanish: {x}
Translate into German: {x}
Rewrite this sentence in the past tense: {x}
Rewrite this sentence to sound more formal: {x}
Identify the subject and the verb in this sentence: {x}
Turn this sentence into a question: {x}""".splitlines()


def is_templated(prompt_id: str) -> bool:
    """Whether a prompt id is one of this module's (``templated_prompts`` or ``passage_prompts``)."""
    return prompt_id.startswith(("tpl-", "tpd-"))


def _records(prefix: str, pool: list[tuple[str, str]]) -> list[dict]:
    """(category, prompt) pairs as records shaped like ``load_prompts``', ids ``<prefix>-NNNNN`` in order."""
    return [{"id": f"{prefix}-{i:05d}", "category": cat, "prompt": text, "split": "train", "max_tokens": 128}
            for i, (cat, text) in enumerate(pool)]


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(";") if t.strip()]


def templated_prompts(n: int, seed: int = 0) -> list[dict]:
    """``n`` distinct training prompts (records shaped like ``load_prompts``), ids ``tpl-NNNNN``."""
    rng = random.Random(seed)
    pool = _all_prompts(rng)
    rng.shuffle(pool)
    if n > len(pool):
        raise ValueError(f"only {len(pool)} templated prompts exist, asked for {n}")
    return _records("tpl", pool[:n])


def _all_prompts(rng: random.Random) -> list[tuple[str, str]]:
    subjects, goals, sentences = _split(SUBJECTS), _split(CODE_GOALS), _split(SENTENCES)
    out = []
    for task, s in itertools.product(TASKS, subjects):
        out.append(("writing" if "poem" in task or "story" in task or "haiku" in task else "qa",
                    task.format(s=s, t=rng.choice(subjects))))
    out += [("code", t.format(c=g)) for t, g in itertools.product(CODE_TASKS, goals)]
    for t in MATH_TASKS:
        for _ in range(20):
            a, b, c = rng.randint(12, 480), rng.randint(2, 60), rng.randint(2, 12)
            out.append(("math", t.format(a=a, b=b, c=c)))
    out += [("translation", t.format(x=x)) for t, x in itertools.product(SENTENCE_TASKS, sentences)]
    return list(dict.fromkeys(out))


PASSAGE_TASKS = [("summarization", t) for t in """Summarize this passage in one sentence:
Give a one-line summary of this text:
Summarize the following paragraph in two sentences:
What is the main point of this passage? Answer in one sentence.
Write a short title for this paragraph, then summarize it in one sentence.""".splitlines()] + [
    ("extraction", t) for t in """Extract the main keywords (5 to 8) from this paragraph:
List the key facts in this passage as bullet points:
Extract every name of a thing, a place or a person mentioned in this passage:
What are the three most important ideas in this text? List them.""".splitlines()] + [
    ("qa", "Write two questions that this passage answers, with their answers."),
    ("writing", "Rewrite this paragraph for a young child, keeping it short:")]

CHAT_TASKS = """I want to get better at {s}. Where should I start?
My friend loves {s}. What would be a thoughtful small gift for them?
I'm giving a five-minute talk about {s} tomorrow and I'm nervous. Any tips?
Can you suggest a fun weekend activity related to {s}?
I find {s} boring. Can you convince me it's interesting?
What are some good beginner questions to ask an expert on {s}?""".splitlines()


def passage_prompts(passages: list[str], n: int, seed: int = 0) -> list[dict]:
    """``n`` distinct training prompts of the hand-written collection's other kinds, ids ``tpd-NNNNN``:
    two summarization/extraction-style tasks (of ``PASSAGE_TASKS``) over each of ``passages`` (paragraphs the
    target wrote for templated prompts, training/answers.py ``--passages``), and chat-style requests
    (``CHAT_TASKS``) about the templated subjects. Deterministic for given passages and seed."""
    rng = random.Random(seed)
    pool = [(cat, f"{task}\n\n{p}") for p in passages for cat, task in rng.sample(PASSAGE_TASKS, 2)]
    pool += [("chat", t.format(s=s)) for t, s in itertools.product(CHAT_TASKS, _split(SUBJECTS))]
    pool = list(dict.fromkeys(pool))
    rng.shuffle(pool)
    if n > len(pool):
        raise ValueError(f"only {len(pool)} passage and chat prompts exist for {len(passages)} passages, asked for {n}")
    return _records("tpd", pool[:n])
