"""The agent's policy: a linear softmax over the offered edits, trained by REINFORCE.

Small on purpose (numpy, no model download): what the example shows is the rollout
loop around it, and a learning curve that comes only from rewards measured in sandboxes.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np


@dataclass
class Decision:
    """One choice the policy made: what it saw, what it could do, what it did."""

    features: List[float]
    offered: List[bool]
    action: int


class LinearPolicy:
    """Scores ``features @ weights`` per edit; edits that are not offered get no mass."""

    def __init__(self, n_features: int, n_actions: int, learning_rate: float = 0.5):
        self.weights = np.zeros((n_features, n_actions))
        self.learning_rate = learning_rate

    @staticmethod
    def probabilities(weights: np.ndarray, features: Sequence[float],
                      offered: Sequence[bool]) -> np.ndarray:
        logits = np.asarray(features) @ weights
        logits = np.where(np.asarray(offered), logits, -np.inf)
        logits = logits - logits.max()
        exp = np.exp(logits)
        return exp / exp.sum()

    @classmethod
    def sample(cls, weights: np.ndarray, features: Sequence[float], offered: Sequence[bool],
               rng: np.random.Generator) -> int:
        if not any(offered):
            raise ValueError("no edit is offered: the task's source matches no edit pattern")
        probs = cls.probabilities(weights, features, offered)
        return int(rng.choice(len(probs), p=probs))

    def update(self, decisions: Sequence[Decision], rewards: Sequence[float],
               advantages: Optional[Sequence[float]] = None) -> float:
        """One policy-gradient step from a batch of (decision, reward), with the batch's
        mean reward as the baseline, or with the ``advantages`` given (GRPO-style, each
        reward against its group's: ``group_advantages``). Returns the gradient's norm."""
        scores = np.asarray(rewards, dtype=float)
        weighed = scores - scores.mean() if advantages is None \
            else np.asarray(advantages, dtype=float)
        grad = np.zeros_like(self.weights)
        for decision, advantage in zip(decisions, weighed):
            probs = self.probabilities(self.weights, decision.features, decision.offered)
            chosen = np.zeros_like(probs)
            chosen[decision.action] = 1.0
            grad += advantage * np.outer(decision.features, chosen - probs)
        grad /= max(len(decisions), 1)
        self.weights += self.learning_rate * grad
        return float(np.linalg.norm(grad))


def group_advantages(rewards: Sequence[float]) -> List[float]:
    """GRPO's advantage of each sample of one group (the same task, the same start):
    its reward against the group's mean, in units of the group's spread (0 for a
    group whose samples all scored alike: it teaches nothing)."""
    scores = np.asarray(rewards, dtype=float)
    spread = scores.std()
    if spread == 0:
        return [0.0] * len(scores)
    return list((scores - scores.mean()) / spread)
