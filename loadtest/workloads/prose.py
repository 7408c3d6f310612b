"""Deterministic, varied, real-looking English prose: documents for the synthetic chats.

No downloads and no fixed paragraph repeated: sentences are assembled from a grammar of clause
templates and word lists by a seeded generator, so each document is different, reads like a
report, and is the same on every run for the same seed. The length is measured with the real
tokenizer (the one the engine and the gateway use), so "a 6,000-token document" is exact.
"""

from __future__ import annotations

import random
from collections.abc import Callable

SUBJECTS = (
    "the harbour authority", "the regional council", "our field team", "the survey", "the committee",
    "the northern depot", "the maintenance crew", "the audit", "the pilot programme", "the archive",
    "the river office", "the steering group", "the weather service", "the logistics desk", "the clinic",
    "the orchard cooperative", "the rail operator", "the university lab", "the museum", "the library board",
)
VERBS = (
    "recorded", "reported", "noticed", "estimated", "measured", "reviewed", "confirmed", "questioned",
    "documented", "predicted", "observed", "compared", "summarised", "challenged", "revised", "tracked",
)
OBJECTS = (
    "a steady rise in traffic", "fewer delays than last year", "a sharp drop in water levels",
    "higher costs for spare parts", "an unusual pattern of late deliveries", "the loss of two storage sites",
    "a backlog of inspection requests", "stronger demand in the eastern district", "a shortage of trained staff",
    "the effect of the early frost", "better yields on the southern slopes", "longer queues at the main gate",
    "a surplus of timber", "the closure of the old bridge", "new rules for night shifts", "a dispute over fees",
)
CONNECTIVES = (
    "Meanwhile,", "In contrast,", "As a result,", "By the end of the quarter,", "According to the minutes,",
    "Later that month,", "Despite the weather,", "For the first time,", "Once again,", "In the following weeks,",
)
ADJECTIVES = ("careful", "brief", "detailed", "preliminary", "revised", "independent", "annual", "informal")
PLACES = (
    "Ashford", "Belmont", "Carrow", "Dunmore", "Eastleigh", "Fenwick", "Glenhaven", "Holloway", "Inverness",
    "Juniper Point", "Kestrel Bay", "Larkspur", "Millbrook", "Northgate", "Oakridge", "Pembury",
)
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October")
TOPICS = (
    "harbour logistics", "orchard yields", "rail maintenance", "river levels", "clinic staffing",
    "library funding", "timber supply", "museum visitors", "road repairs", "school meals",
)
QUESTIONS = (
    "What are the three most important findings in this document?",
    "Which place is mentioned most often, and why does it matter?",
    "Summarise the section about costs in two sentences.",
    "What changed between the first and the last quarter?",
    "Which recommendation would you act on first, and why?",
    "List any figures that look inconsistent with each other.",
    "Who disagreed with the committee, and on what point?",
    "What should the next report measure that this one did not?",
    "Explain the main risk in plain words for a newcomer.",
    "Which of the teams seems to be under the most pressure?",
    "Draft a short reply to the steering group about these results.",
    "What would happen if the trend in the last section continued?",
)


class ProseGenerator:
    """Seeded sentences and paragraphs; ``document`` grows text to a token budget."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def sentence(self) -> str:
        r = self.rng
        kind = r.randrange(5)
        subj, verb, obj = r.choice(SUBJECTS), r.choice(VERBS), r.choice(OBJECTS)
        place, month = r.choice(PLACES), r.choice(MONTHS)
        n = r.randrange(2, 980)
        if kind == 0:
            s = f"In {month}, {subj} {verb} {obj} near {place}."
        elif kind == 1:
            s = f"{r.choice(CONNECTIVES)} {subj} {verb} {obj}, which affected about {n} households."
        elif kind == 2:
            adj = r.choice(ADJECTIVES)
            article = "An" if adj[0] in "aeiou" else "A"
            s = f"{article} {adj} note from {place} says that {subj} {verb} {obj} after {r.randrange(2, 40)} days."
        elif kind == 3:
            s = f"Figures for {place} show {n} cases in {month}, up from {max(n - r.randrange(1, 90), 1)} a year earlier."
        else:
            s = f"When asked, {subj} said the {r.choice(ADJECTIVES)} plan for {place} would be {verb} again in {month}."
        return s[0].upper() + s[1:]

    def paragraph(self) -> str:
        return " ".join(self.sentence() for _ in range(self.rng.randrange(3, 8)))

    def document(self, target_tokens: int, count_tokens: Callable[[str], int]) -> str:
        """A titled report of at least ``target_tokens`` tokens (overshooting by a paragraph or so)."""
        topic = self.rng.choice(TOPICS)
        text = f"Report on {topic}, {self.rng.choice(PLACES)} office, issue {self.rng.randrange(1, 200)}."
        n = count_tokens(text)
        while n < target_tokens:
            # Grow by the characters the measured chars/token ratio says are missing, then re-measure:
            # two or three encodes per document instead of one per paragraph.
            missing_chars = (target_tokens - n) * len(text) / n
            added = 0
            while added < missing_chars:
                para = self.paragraph()
                text += "\n\n" + para
                added += len(para) + 2
            n = count_tokens(text)
        return text

    def question(self) -> str:
        return self.rng.choice(QUESTIONS)
