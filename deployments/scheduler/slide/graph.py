"""The fact graph (docs/slide.md): every fact, its state and its neurons; the same on every replica, since
every replica gets the same calls in the same order and allocates the same way."""

import time

import numpy as np

from deployments.messages.slide import FACT_STATES, SlideFact, SlideQuestion

HOLDING = ("learning", "learned", "deleting")  # states whose neurons are the fact's


class FactGraph:
    def __init__(self, neurons_per_fact: int, capacity: int) -> None:
        self.neurons_per_fact, self.capacity = neurons_per_fact, capacity
        self.facts: list[SlideFact] = []
        self.next_id = 1

    def get(self, fact_id: int) -> SlideFact | None:
        return next((f for f in self.facts if f.id == fact_id), None)

    def held_neurons(self) -> set[int]:
        return {n for f in self.facts if f.state in HOLDING for n in f.neurons}

    def free_neurons(self, nonzero: np.ndarray) -> list[int]:
        """Neurons no fact holds whose weights are zero (a cleared graph's neurons keep what they learned)."""
        held = self.held_neurons()
        return [n for n in range(len(nonzero)) if n not in held and not nonzero[n]]

    def room(self, nonzero: np.ndarray) -> int:
        """Facts that can still be added."""
        return len(self.free_neurons(nonzero)) // self.neurons_per_fact

    def add(self, text: str, questions: list[SlideQuestion], nonzero: np.ndarray) -> SlideFact | str:
        """A new fact holding the lowest free neurons, learning; or why there is no room."""
        free = self.free_neurons(nonzero)
        if len(free) < self.neurons_per_fact:
            return (
                f"the pocket is full: its {self.capacity} facts' neurons are all in use "
                "(delete facts, or start the server with a larger slide_capacity)"
            )
        now = time.time()
        fact = SlideFact(self.next_id, text, questions, neurons=free[: self.neurons_per_fact], created=now, updated=now)
        self.next_id += 1
        self.facts.append(fact)
        return fact

    def set_state(self, fact_id: int, state: str, version: int, reason: str | None = None) -> SlideFact | None:
        if state not in FACT_STATES:
            raise ValueError(f"unknown fact state {state!r}")
        fact = self.get(fact_id)
        if fact is None:
            return None
        fact.state, fact.updated = state, time.time()
        if state in ("learned", "deleted"):
            fact.version = version
        if reason is not None or state in ("learned", "learning"):
            fact.reason = reason
        return fact

    def clear(self) -> int:
        removed = len(self.facts)
        self.facts = []
        return removed
