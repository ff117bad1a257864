"""Generate megalite's bundled demo corpus: short templated stories, deterministically.

    python data/generate_corpus.py                       # writes data/corpus.jsonl
    python data/generate_corpus.py --num-docs 100 --output /tmp/x.jsonl

The text is written by this script alone (no third-party text), from a vocabulary of a few hundred
words and a small story grammar. It has structure a tiny GPT can learn quickly (a character's name
and animal recur through the story, pronouns agree, stories open and close with set phrases), so the
loss visibly falls within minutes on a CPU. Same arguments, same bytes, on every machine: only
Python's own ``random.Random`` (a documented, stable generator) is used.
"""

from __future__ import annotations

import argparse
import json
import os
import random

NAMES_SHE = ["Anna", "Lily", "Mia", "Rosa", "Nora", "Ella", "Ivy", "Luna", "Maya", "Zoe", "Clara",
             "Hana", "Sara", "Tess", "Ruby", "Jade"]
NAMES_HE = ["Tom", "Ben", "Leo", "Max", "Sam", "Finn", "Omar", "Jack", "Theo", "Eli", "Noah", "Ravi",
            "Hugo", "Ivan", "Kai", "Otto"]
ANIMALS = ["cat", "dog", "fox", "bear", "rabbit", "owl", "mouse", "frog", "duck", "horse", "goat",
           "lion", "turtle", "bird", "pig", "deer", "wolf", "squirrel", "hedgehog", "badger"]
ADJ_CHAR = ["little", "brave", "shy", "kind", "curious", "clever", "happy", "sleepy", "tiny", "young",
            "gentle", "funny", "proud", "quiet", "friendly", "busy", "lazy", "old", "smart", "silly"]
PLACES = ["a small village", "a big forest", "a green valley", "a quiet town", "a sunny farm",
          "a house by the sea", "a tall tree", "a warm cave", "a busy city", "a field of flowers",
          "the hills", "a garden", "a little boat", "a red barn", "the mountains", "an old mill"]
OBJECTS = ["ball", "kite", "book", "hat", "box", "cake", "key", "map", "lamp", "drum", "shell",
           "stone", "apple", "basket", "flower", "blanket", "bell", "cup", "toy", "coin", "rope",
           "ribbon", "feather", "pie", "boat", "leaf", "letter", "spoon", "sock", "scarf"]
OBJ_ADJ = ["red", "blue", "green", "yellow", "shiny", "big", "small", "old", "new", "soft", "round",
           "heavy", "bright", "warm", "pretty", "strange", "golden", "striped", "wooden", "lost"]
FEELINGS = ["happy", "sad", "scared", "excited", "tired", "angry", "surprised", "proud", "worried",
            "calm", "hungry", "lonely", "glad", "sorry", "hopeful"]
WEATHER = ["the sun was shining", "it was raining", "the wind was blowing", "it was very cold",
           "the sky was grey", "snow was falling", "it was a warm morning", "the stars were out",
           "the air smelled of rain", "it was a windy night"]
TIMES = ["One day", "One morning", "One evening", "The next day", "Later that day", "After lunch",
         "That night", "In the afternoon", "On Sunday", "Early in the morning"]
VERBS_PAST = ["found", "lost", "saw", "wanted", "made", "painted", "carried", "dropped", "hid",
              "shared", "fixed", "washed", "opened", "gave away", "looked for"]
ACTIVITIES = ["played in the garden", "went for a long walk", "sang a song", "read a story",
              "took a nap", "baked some bread", "climbed a hill", "swam in the lake", "danced in the rain",
              "counted the clouds", "picked some berries", "built a little house", "drew a picture",
              "watched the birds", "ran to the river"]
LESSONS = ["it is good to share", "friends help each other", "being brave is not the same as being loud",
           "it is fine to ask for help", "kind words make a day better", "patience pays off",
           "a small gift can mean a lot", "telling the truth is important", "everyone makes mistakes",
           "there is always something new to learn"]
SAYS = ["said", "asked", "shouted", "whispered", "replied", "laughed", "cried"]
NUMBERS = ["two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


class Character:
    def __init__(self, rng: random.Random):
        self.she = rng.random() < 0.5
        self.name = rng.choice(NAMES_SHE if self.she else NAMES_HE)
        self.animal = rng.choice(ANIMALS)
        self.adj = rng.choice(ADJ_CHAR)
        self.subj, self.obj, self.poss = ("she", "her", "her") if self.she else ("he", "him", "his")


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def story(rng: random.Random) -> str:
    hero, friend = Character(rng), Character(rng)
    while friend.name == hero.name:
        friend = Character(rng)
    place, thing, thing_adj = rng.choice(PLACES), rng.choice(OBJECTS), rng.choice(OBJ_ADJ)
    a = "an" if thing_adj[0] in "aeiou" else "a"
    para = [
        f"Once upon a time, there was a {hero.adj} {hero.animal} named {hero.name}. "
        f"{hero.name} lived in {place}. Every day, {hero.subj} {rng.choice(ACTIVITIES)}.",
    ]
    p = [f"{rng.choice(TIMES)}, {rng.choice(WEATHER)}. {hero.name} {rng.choice(VERBS_PAST)} "
         f"{a} {thing_adj} {thing}."]
    feeling = rng.choice(FEELINGS)
    p.append(f"{_cap(hero.subj)} felt {feeling}.")
    p.append(f"\"What a {thing_adj} {thing}!\" {hero.name} {rng.choice(SAYS)}.")
    para.append(" ".join(p))
    p = [f"Then {hero.name} met {friend.name}, a {friend.adj} {friend.animal}."]
    p.append(f"\"Hello, {hero.name}. Can I see your {thing}?\" {friend.name} {rng.choice(SAYS)}.")
    for _ in range(rng.randint(1, 4)):
        r = rng.random()
        if r < 0.3:
            p.append(f"They {rng.choice(ACTIVITIES)} together.")
        elif r < 0.55:
            n = rng.choice(NUMBERS)
            p.append(f"{friend.name} had {n} {rng.choice(OBJECTS)}s, and {hero.name} had one {thing}.")
        elif r < 0.8:
            p.append(f"{_cap(friend.subj)} told {hero.obj} about {rng.choice(PLACES)}, where "
                     f"{rng.choice(WEATHER)}.")
        else:
            p.append(f"{hero.name} gave {friend.name} {hero.poss} {thing}, and {friend.subj} felt "
                     f"{rng.choice(FEELINGS)}.")
    para.append(" ".join(p))
    end = rng.choice([
        f"In the end, {hero.name} and {friend.name} became good friends. "
        f"{hero.name} learned that {rng.choice(LESSONS)}.",
        f"When the day was over, {hero.name} went home with {hero.poss} {thing}. "
        f"{_cap(hero.subj)} was {rng.choice(FEELINGS)}, and {hero.subj} knew that {rng.choice(LESSONS)}.",
        f"{friend.name} smiled and said, \"Thank you, {hero.name}.\" From that day on, the {hero.animal} "
        f"and the {friend.animal} played together every day.",
    ])
    para.append(end)
    return "\n\n".join(para)


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default=os.path.join(here, "corpus.jsonl"))
    p.add_argument("--num-docs", type=int, default=3000)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    tmp = args.output + ".tmp"
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for _ in range(args.num_docs):
            f.write(json.dumps({"text": story(rng)}) + "\n")
    os.replace(tmp, args.output)
    print(f"wrote {args.num_docs} documents, {os.path.getsize(args.output)} bytes to {args.output}")


if __name__ == "__main__":
    main()
