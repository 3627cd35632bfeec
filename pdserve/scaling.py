"""The autoscaling rule: how many replicas each worker role should run, from its queue.

Plain Python: no I/O and no clock of its own (``now`` is an argument), so it is tested in
milliseconds; :mod:`pdserve.autoscale` reads the broker, feeds it and applies what it says.

Each role's *need* is the largest of what its signals ask for, in replicas:

- ``lag``: messages waiting plus in hand (``num_pending + num_ack_pending`` of the role's
  consumer, what KEDA's JetStream scaler reads) over ``lag_per_replica``;
- ``tokens``: the work waiting, weighed in tokens (prefill: prompt tokens queued or
  admitted but not computed), over what one replica computes in ``backlog_seconds`` at its
  measured rate; long prompts count for what they cost, not as one message each;
- ``busy``: the pool's busy time (replicas' worth of forward passes, recently) over
  ``target_utilization``, which keeps a steadily loaded pool at its size after the backlog
  is gone;
- ``pages``: KV pages in use plus those the waiting work will take, over a replica's
  pages at ``page_utilization`` (decode).

The need is rounded up and held within ``[min_replicas, max_replicas]``; a need within
``tolerance`` of the current size changes nothing. Against flapping: a scale-up happens only
when every reading of the last ``scale_up_window`` seconds (and there were readings that
long) asked for more, and not within
``scale_up_cooldown`` of the role's last change; a scale-down goes only to the most that any
reading of the last ``scale_down_window`` seconds asked for, so one quiet moment does not
shrink a busy pool, and a pool grows back at once when load returns.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class RolePolicy:
    """Limits and targets of one role's pool. Defaults fit one small CPU machine."""

    min_replicas: int = 1
    max_replicas: int = 2
    lag_per_replica: int = 8
    backlog_seconds: float = 5.0
    target_utilization: float = 0.8
    page_utilization: float = 0.8
    default_tokens_per_second: float = 4000.0  # one replica's rate until one is measured

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(
                f"replicas: need 0 <= min <= max and max >= 1, got {self.min_replicas}..{self.max_replicas}"
            )
        if self.lag_per_replica < 1:
            raise ValueError("lag_per_replica must be at least 1")
        if self.backlog_seconds <= 0 or self.default_tokens_per_second <= 0:
            raise ValueError("backlog_seconds and default_tokens_per_second must be positive")
        if not 0 < self.target_utilization <= 1 or not 0 < self.page_utilization <= 1:
            raise ValueError("target_utilization and page_utilization must be in (0, 1]")


@dataclass(frozen=True)
class ScalingConfig:
    prefill: RolePolicy = RolePolicy()
    decode: RolePolicy = RolePolicy(lag_per_replica=96)
    tolerance: float = 0.1
    scale_up_window: float = 2.0
    scale_up_cooldown: float = 5.0
    scale_down_window: float = 30.0
    max_scale_up_step: int = 2

    def __post_init__(self) -> None:
        if not 0 <= self.tolerance < 1:
            raise ValueError("tolerance must be in [0, 1)")
        if min(self.scale_up_window, self.scale_up_cooldown, self.scale_down_window) < 0:
            raise ValueError("windows and cool-downs cannot be negative")
        if self.max_scale_up_step < 1:
            raise ValueError("max_scale_up_step must be at least 1")

    def policy(self, role: str) -> RolePolicy:
        return {"prefill": self.prefill, "decode": self.decode}[role]


@dataclass(frozen=True)
class PoolReading:
    """One role's pool and queue at one moment.

    ``replicas``: serving or starting, not draining; ``ready``: those reporting in the
    registry (``pages_total`` and ``busy`` are over these); ``pending``/``ack_pending``:
    the consumer's messages waiting and delivered-not-acked; ``tokens_waiting``: the work
    not started, in tokens; ``pages_waiting``: KV pages that work will need;
    ``busy``: replicas' worth of busy time lately (0.5 + 0.5 = 1.0);
    ``tokens_per_second``: one replica's measured rate per busy second (None: not yet).
    """

    replicas: int
    pending: int = 0
    ack_pending: int = 0
    tokens_waiting: int = 0
    ready: int = 0
    pages_used: int = 0
    pages_total: int = 0
    pages_waiting: int = 0
    busy: float = 0.0
    tokens_per_second: float | None = None


@dataclass(frozen=True)
class Decision:
    """What the rule says for one role: ``desired`` replicas (within limits, after the
    windows), the raw ``need`` behind it, the signal that set the need, and each signal's
    need in replicas."""

    role: str
    current: int
    desired: int
    need: float
    reason: str
    needs: dict[str, float]

    @property
    def direction(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "hold"


def role_needs(reading: PoolReading, policy: RolePolicy) -> dict[str, float]:
    """Replicas each signal asks for (unrounded)."""
    needs = {"lag": (reading.pending + reading.ack_pending) / policy.lag_per_replica}
    rate = reading.tokens_per_second or policy.default_tokens_per_second
    needs["tokens"] = reading.tokens_waiting / (rate * policy.backlog_seconds)
    needs["busy"] = reading.busy / policy.target_utilization
    if reading.ready > 0 and reading.pages_total > 0:
        per_replica = reading.pages_total / reading.ready
        needs["pages"] = (reading.pages_used + reading.pages_waiting) / (per_replica * policy.page_utilization)
    return needs


def target_replicas(need: float, current: int, policy: RolePolicy, tolerance: float) -> int:
    """``need`` rounded up within limits; ``current`` when ``need`` is within ``tolerance``."""
    if current > 0 and abs(need / current - 1.0) <= tolerance:
        return min(max(current, policy.min_replicas), policy.max_replicas)
    return min(max(math.ceil(need - 1e-9), policy.min_replicas), policy.max_replicas)


@dataclass
class _History:
    targets: deque[tuple[float, int]] = field(default_factory=deque)
    since: float | None = None  # the first reading
    last_change: float = -math.inf


class Autoscaler:
    """The rule with its memory: each role's recent targets and last change.
    :meth:`decide` is called once per reading; the caller applies ``desired``."""

    def __init__(self, config: ScalingConfig) -> None:
        self.config = config
        self._history = {role: _History() for role in ROLES}

    def decide(self, now: float, readings: Mapping[str, PoolReading]) -> dict[str, Decision]:
        return {role: self._decide(now, role, reading) for role, reading in readings.items()}

    def _decide(self, now: float, role: str, reading: PoolReading) -> Decision:
        config, policy, history = self.config, self.config.policy(role), self._history[role]
        needs = role_needs(reading, policy)
        reason = max(needs, key=lambda k: needs[k])
        need = needs[reason]
        current = reading.replicas
        target = target_replicas(need, current, policy, config.tolerance)
        keep = max(config.scale_up_window, config.scale_down_window)
        history.targets.append((now, target))
        if history.since is None:
            history.since = now
        while history.targets and history.targets[0][0] < now - keep:
            history.targets.popleft()
        desired = self._stabilize(now, current, target, policy, history)
        if desired != current:
            history.last_change = now
        if current < policy.min_replicas or current > policy.max_replicas:
            reason = "limits"
        return Decision(role, current, desired, need, reason, needs)

    def _stabilize(self, now: float, current: int, target: int, policy: RolePolicy, history: _History) -> int:
        config = self.config
        if current < policy.min_replicas or current > policy.max_replicas:
            return min(max(current, policy.min_replicas), policy.max_replicas)  # limits first, at once
        if target > current:
            if now - history.last_change < config.scale_up_cooldown:
                return current
            assert history.since is not None
            if now - history.since < config.scale_up_window:  # not read for that long yet
                return current
            agreed = min(t for at, t in _since(history.targets, now - config.scale_up_window))
            return min(max(agreed, current), current + config.max_scale_up_step)
        if target < current:
            assert history.since is not None
            if now - history.since < config.scale_down_window:  # not read for that long yet
                return current
            return min(max(t for _, t in _since(history.targets, now - config.scale_down_window)), current)
        return current


def _since(targets: Iterable[tuple[float, int]], start: float) -> list[tuple[float, int]]:
    return [(at, t) for at, t in targets if at >= start]


# ---- service rates from the workers' counters ------------------------------------------
@dataclass(frozen=True)
class WorkerSample:
    """A worker's totals as of its last heartbeat (``at``, seconds): busy seconds and the
    tokens it computed (prefill: prompt tokens not found in its cache; decode: generated)."""

    worker_id: str
    role: str
    at: float
    busy_seconds: float
    tokens: int


@dataclass(frozen=True)
class RoleRate:
    """``busy``: replicas' worth of busy time over the window; ``tokens_per_second``: tokens
    per busy second of one replica (None until there was enough busy time to tell)."""

    busy: float
    tokens_per_second: float | None


class ServiceRates:
    """Each worker's recent samples; :meth:`rates` turns them into a role's busy replicas and
    service rate over the last ``window`` seconds. A worker not heard of for ``window`` is
    forgotten."""

    MIN_BUSY_SECONDS = 0.2

    def __init__(self, window: float = 10.0) -> None:
        if window <= 0:
            raise ValueError("window must be positive")
        self.window = window
        self._samples: dict[str, deque[WorkerSample]] = {}

    def add(self, samples: Iterable[WorkerSample]) -> None:
        for s in samples:
            q = self._samples.setdefault(s.worker_id, deque())
            if not q or s.at > q[-1].at:
                q.append(s)

    def rates(self, now: float) -> dict[str, RoleRate]:
        busy: dict[str, float] = {}
        busy_seconds: dict[str, float] = {}
        tokens: dict[str, int] = {}
        for worker_id, q in list(self._samples.items()):
            while q and q[0].at < now - self.window and len(q) > 1 and q[1].at <= now - self.window:
                q.popleft()  # keep one sample at or before the window's start, as its base
            if not q or q[-1].at < now - self.window:
                del self._samples[worker_id]
                continue
            first, last = q[0], q[-1]
            role = last.role
            busy.setdefault(role, 0.0)
            if last.at > first.at:
                spent = max(last.busy_seconds - first.busy_seconds, 0.0)
                busy[role] += min(spent / (last.at - first.at), 1.0)
                busy_seconds[role] = busy_seconds.get(role, 0.0) + spent
                tokens[role] = tokens.get(role, 0) + max(last.tokens - first.tokens, 0)
        out = {}
        for role, b in busy.items():
            spent = busy_seconds.get(role, 0.0)
            rate = tokens.get(role, 0) / spent if spent >= self.MIN_BUSY_SECONDS and tokens.get(role) else None
            out[role] = RoleRate(b, rate)
        return out
