"""Routing policies: pure functions of (request, directory view, hardware profile, now) → Decision.

``make_policy(name, **options)`` builds one; ``POLICY_NAMES`` lists them. See README.md here.
"""

from gateway.policy.base import Policy
from gateway.policy.cost_model import TtftEstimator
from gateway.policy.registry import POLICY_NAMES, make_policy, policy_options

__all__ = ["POLICY_NAMES", "Policy", "TtftEstimator", "make_policy", "policy_options"]
