"""The load manager's pure decisions (``broker.cluster.load_manager``): scores and broker choice per
strategy, draining brokers, the CV, the gates of a rebalancing round (threshold, cool-downs,
``max_moves``), convergence from a skewed start, determinism, and the ``/cluster/load_balance``
value (``docs/etcd-layout.md`` §1.8)."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.cluster.load_manager import (
    REASON_BELOW_THRESHOLD,
    REASON_COOL_DOWN,
    REASON_NO_ACTIVE_BROKER,
    REASON_NO_IMPROVING_MOVE,
    REASON_REBALANCED,
    BrokerLoad,
    LoadBalanceDecision,
    LoadBalanceMove,
    Move,
    RebalanceAggressiveness,
    RebalancePlan,
    Strategy,
    TopicLoad,
    broker_scores,
    choose_broker,
    coefficient_of_variation,
    plan_rebalance,
    topic_loads,
)
from danube_pipeline.metadata import values

pytestmark = pytest.mark.unit


def topics(prefix: str, n: int) -> list[str]:
    return [f"/default/{prefix}-{i:03d}" for i in range(n)]


def broker(bid: int, n: int = 0, *, cpu: float = 0, mem: float = 0, state: str = "active", prefix: str | None = None,
           **kwargs: object) -> BrokerLoad:
    return BrokerLoad(bid, cpu, mem, topics(prefix or f"b{bid}", n), state=state, **kwargs)  # type: ignore[arg-type]


def plan(brokers: Sequence[BrokerLoad], strategy: str = "fair", aggressiveness: str = "aggressive", *,
         max_moves: int = 100, now_s: float = 1000.0, last_round_s: float | None = None, cooldown_s: float = 60.0,
         recently_moved: dict[str, float] | None = None, topic_cooldown_s: float = 300.0) -> RebalancePlan:
    return plan_rebalance(
        brokers, strategy, aggressiveness, max_moves=max_moves, now_s=now_s, last_round_s=last_round_s,
        cooldown_s=cooldown_s, recently_moved=recently_moved or {}, topic_cooldown_s=topic_cooldown_s,
    )


def apply(brokers: Sequence[BrokerLoad], moves: Sequence[Move]) -> list[BrokerLoad]:
    """The brokers after ``moves``: topic lists and per-topic rates follow the topics; the
    broker totals (and CPU, memory) stay as reported."""
    held = {b.broker_id: list(b.topics) for b in brokers}
    rates = {b.broker_id: dict(b.per_topic) if b.per_topic is not None else None for b in brokers}
    for topic, source, target in moves:
        held[source].remove(topic)
        held[target].append(topic)
        src, dst = rates[source], rates[target]
        if src is not None and dst is not None and topic in src:
            dst[topic] = src.pop(topic)
    return [
        BrokerLoad(b.broker_id, b.cpu_percent, b.memory_percent, held[b.broker_id], b.msg_per_s, b.bytes_per_s,
                   rates[b.broker_id], b.state)
        for b in brokers
    ]


# --- strategies and choice ---------------------------------------------------------------


def test_fair_scores_are_topic_counts_over_their_mean() -> None:
    scores = broker_scores([broker(1, 1), broker(2, 2), broker(3, 3, cpu=99, mem=99)], "fair")
    assert scores == pytest.approx({1: 0.5, 2: 1.0, 3: 1.5})


def test_fair_picks_fewest_topics_and_breaks_ties_by_lowest_id() -> None:
    brokers = [broker(7, 3), broker(5, 2, cpu=100, mem=100), broker(9, 2)]
    assert choose_broker("/default/new", brokers, "fair") == 5
    assert choose_broker("/default/new", list(reversed(brokers)), Strategy.FAIR) == 5


def test_balanced_weighs_cpu_and_memory_against_topic_count() -> None:
    # mean topics 11, CPU 50, memory 45: A = .5*10/11 + .25*90/50 + .25*80/45 = 1.35,
    # B = .5*12/11 + .25*10/50 + .25*10/45 = 0.65
    brokers = [broker(1, 10, cpu=90, mem=80), broker(2, 12, cpu=10, mem=10)]
    assert broker_scores(brokers, "balanced") == pytest.approx({1: 1.3490, 2: 0.6510}, abs=1e-4)
    assert choose_broker("/default/new", brokers, "fair") == 1
    assert choose_broker("/default/new", brokers, "balanced") == 2


def test_weighted_load_follows_traffic() -> None:
    hot = broker(1, 5, cpu=30, mem=30, msg_per_s=10_000.0, bytes_per_s=10_000_000.0)
    idle = broker(2, 20, cpu=30, mem=30, msg_per_s=100.0, bytes_per_s=100_000.0)
    assert choose_broker("/default/new", [hot, idle], "fair") == 1
    assert choose_broker("/default/new", [hot, idle], "balanced") == 1
    assert choose_broker("/default/new", [hot, idle], "weighted_load") == 2


def test_weighted_load_without_rates_ranks_by_cpu_memory_and_topics() -> None:
    brokers = [broker(1, 3, cpu=80, mem=50), broker(2, 3, cpu=20, mem=50), broker(3, 4, cpu=20, mem=50)]
    assert choose_broker("/default/new", brokers, "weighted_load") == 2


def test_draining_and_drained_brokers_never_chosen() -> None:
    brokers = [broker(1, 0, state="draining"), broker(2, 0, state="drained"), broker(3, 50, cpu=95, mem=95)]
    for strategy in Strategy:
        assert choose_broker("/default/new", brokers, strategy) == 3
    with pytest.raises(ValueError, match="no active broker"):
        choose_broker("/default/new", brokers[:2], "fair")


def test_topic_loads_share_what_the_totals_leave() -> None:
    b = BrokerLoad(1, 0, 0, ["/a/x", "/a/y", "/a/z"], msg_per_s=100.0, bytes_per_s=1000.0,
                   per_topic={"/a/x": TopicLoad(40.0, 400.0), "/a/gone": TopicLoad(1e9, 1e9)})
    assert topic_loads(b) == {"/a/x": TopicLoad(40.0, 400.0), "/a/y": TopicLoad(30.0, 300.0),
                              "/a/z": TopicLoad(30.0, 300.0)}
    even = BrokerLoad(1, 0, 0, ["/a/x", "/a/y"], msg_per_s=10.0, bytes_per_s=0.0)
    assert topic_loads(even) == {"/a/x": TopicLoad(5.0, 0.0), "/a/y": TopicLoad(5.0, 0.0)}


def test_broker_load_from_report_and_validation() -> None:
    report = values.LoadReport([values.ResourceUsage("CPU", 61), values.ResourceUsage("Memory", 3)],
                               ["/default/flights"], 1)
    load = BrokerLoad.from_report(16861613898696940338, report, state="draining", msg_per_s=5.0)
    assert (load.cpu_percent, load.memory_percent, load.topics, load.state, load.msg_per_s) == (
        61.0, 3.0, ["/default/flights"], "draining", 5.0)
    with pytest.raises(ValueError, match="state"):
        BrokerLoad(1, 0, 0, [], state="gone")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cpu_percent"):
        BrokerLoad(1, -1, 0, [])
    with pytest.raises(ValueError, match="twice"):
        BrokerLoad(1, 0, 0, ["/a/x", "/a/x"])
    with pytest.raises(ValueError, match="msg_per_s"):
        TopicLoad(math.nan, 0.0)
    with pytest.raises(ValueError, match="twice"):
        broker_scores([broker(1), broker(1)], "fair")
    with pytest.raises(ValueError):
        broker_scores([broker(1)], "round_robin")


# --- CV ----------------------------------------------------------------------------------


def test_coefficient_of_variation() -> None:
    assert coefficient_of_variation([]) == 0.0
    assert coefficient_of_variation([5.0]) == 0.0
    assert coefficient_of_variation([0.0, 0.0, 0.0]) == 0.0
    assert coefficient_of_variation([3.0, 3.0, 3.0]) == 0.0
    assert coefficient_of_variation([0.0, 2.0]) == pytest.approx(1.0)
    assert coefficient_of_variation([1.0, 2.0, 3.0]) == pytest.approx(math.sqrt(2 / 3) / 2)
    assert coefficient_of_variation(x for x in (30.0, 0.0, 0.0)) == pytest.approx(math.sqrt(2))


def test_thresholds_are_danubes() -> None:
    assert [a.threshold for a in RebalanceAggressiveness] == [0.4, 0.3, 0.2]
    assert RebalanceAggressiveness("balanced").threshold == 0.3


# --- the gates of a round ----------------------------------------------------------------


def test_no_moves_at_or_below_threshold() -> None:
    brokers = [broker(1, 3), broker(2, 7)]  # CV 0.4 exactly
    p = plan(brokers, aggressiveness="conservative")  # moves only above 0.4
    assert (p.moves, p.reason) == ([], REASON_BELOW_THRESHOLD)
    assert p.cv_before == p.cv_after == pytest.approx(0.4)
    p = plan(brokers, aggressiveness="balanced")
    assert p.reason == REASON_REBALANCED
    assert [(src, dst) for _, src, dst in p.moves] == [(2, 1), (2, 1)]
    assert p.cv_after == pytest.approx(0.0, abs=1e-12)


def test_no_moves_inside_the_round_cool_down() -> None:
    brokers = [broker(1, 30), broker(2), broker(3)]
    p = plan(brokers, now_s=1000.0, last_round_s=941.0, cooldown_s=60.0)
    assert (p.moves, p.reason, p.cv_after) == ([], REASON_COOL_DOWN, p.cv_before)
    assert plan(brokers, now_s=1000.0, last_round_s=940.0, cooldown_s=60.0).reason == REASON_REBALANCED


def test_topics_inside_their_cool_down_stay() -> None:
    heavy = broker(1, 4)
    brokers = [heavy, broker(2), broker(3)]
    recent = {t: 900.0 for t in heavy.topics[:3]}  # 100 s ago, cool-down 300 s
    p = plan(brokers, now_s=1000.0, recently_moved=recent, topic_cooldown_s=300.0)
    assert [t for t, _, _ in p.moves] == [heavy.topics[3]]
    everything = {t: 900.0 for t in heavy.topics}
    p = plan(brokers, now_s=1000.0, recently_moved=everything, topic_cooldown_s=300.0)
    assert (p.moves, p.reason) == ([], REASON_NO_IMPROVING_MOVE)
    p = plan(brokers, now_s=1200.0, recently_moved=everything, topic_cooldown_s=300.0)
    assert len(p.moves) == 2


def test_max_moves_is_respected() -> None:
    brokers = [broker(1, 30), broker(2), broker(3)]
    for max_moves in (0, 1, 4, 19):
        p = plan(brokers, max_moves=max_moves)
        assert len(p.moves) == max_moves
        assert p.reason == (REASON_REBALANCED if max_moves else REASON_NO_IMPROVING_MOVE)
    assert len(plan(brokers, max_moves=1000).moves) == 20  # 10 / 10 / 10: nothing left to gain


def test_greedy_never_swaps_the_imbalance() -> None:
    # one topic carries nearly all the traffic: moving it only moves the hot spot
    hot = BrokerLoad(1, 50, 50, ["/a/hot", "/a/warm"], 1010.0, 1010.0,
                     {"/a/hot": TopicLoad(1000.0, 1000.0), "/a/warm": TopicLoad(10.0, 10.0)})
    cold = BrokerLoad(2, 50, 50, [], 0.0, 0.0, {})
    p = plan([hot, cold], "weighted_load")
    assert [t for t, _, _ in p.moves] == ["/a/warm"]
    assert p.cv_after < p.cv_before
    single = BrokerLoad(1, 50, 50, ["/a/hot"], 1000.0, 1000.0, {"/a/hot": TopicLoad(1000.0, 1000.0)})
    p = plan([single, cold], "weighted_load")
    assert (p.moves, p.reason, p.cv_after) == ([], REASON_NO_IMPROVING_MOVE, p.cv_before)


def test_each_move_lowers_the_cv() -> None:
    rng = random.Random(7)
    brokers = []
    for bid in range(1, 9):
        names = topics(f"b{bid}", rng.randint(0, 40) * (bid % 3))
        per = {t: TopicLoad(rng.lognormvariate(3, 1.5), rng.lognormvariate(8, 1.5)) for t in names}
        brokers.append(BrokerLoad(bid, rng.uniform(0, 120), rng.uniform(0, 100), names,
                                  sum(r.msg_per_s for r in per.values()), sum(r.bytes_per_s for r in per.values()), per))
    for strategy in Strategy:
        full = plan(brokers, strategy, max_moves=40)
        assert full.moves
        previous = full.cv_before
        for k in range(1, len(full.moves) + 1):
            partial = plan(brokers, strategy, max_moves=k)
            assert partial.moves == full.moves[:k]  # a smaller budget is a prefix of the bigger plan
            assert partial.cv_after < previous
            previous = partial.cv_after


# --- draining brokers --------------------------------------------------------------------


def test_draining_brokers_are_emptied_whatever_the_gates() -> None:
    leaving = broker(1, 6, state="draining")
    gone = broker(4, 2, state="drained")
    brokers = [leaving, broker(2, 5), broker(3, 5), gone]
    recent = {t: 999.0 for t in leaving.topics}
    p = plan(brokers, aggressiveness="conservative", max_moves=0, now_s=1000.0, last_round_s=999.0,
             cooldown_s=60.0, recently_moved=recent)
    assert p.reason == REASON_COOL_DOWN
    assert p.drain_moves == len(p.moves) == 8
    assert sorted(t for t, _, _ in p.moves) == sorted(leaving.topics + gone.topics)
    assert {dst for _, _, dst in p.moves} == {2, 3}
    after = apply(brokers, p.moves)
    assert [len(b.topics) for b in after] == [0, 9, 9, 0]  # heaviest first onto the lowest: even
    assert p.cv_start == p.cv_after == pytest.approx(0.0, abs=1e-12)


def test_drain_moves_come_first_and_do_not_count_against_max_moves() -> None:
    brokers = [broker(1, 4, state="draining"), broker(2, 20), broker(3, 0)]
    p = plan(brokers, max_moves=3)
    assert p.drain_moves == 4
    assert all(src == 1 for _, src, _ in p.moves[:4])
    assert len(p.balance_moves) == 3
    assert all(src == 2 and dst == 3 for _, src, dst in p.balance_moves)
    assert p.cv_after < p.cv_start


def test_nothing_moves_without_an_active_broker() -> None:
    p = plan([broker(1, 3, state="draining"), broker(2, 0, state="drained")])
    assert (p.moves, p.reason) == ([], REASON_NO_ACTIVE_BROKER)


# --- convergence and determinism ---------------------------------------------------------


def test_skewed_start_converges_with_fair() -> None:
    brokers = [broker(1, 30), broker(2), broker(3)]
    now, last = 0.0, None
    recent: dict[str, float] = {}
    cvs = []
    for _ in range(3):
        p = plan(brokers, "fair", "aggressive", max_moves=10, now_s=now, last_round_s=last, cooldown_s=60.0,
                 recently_moved=recent, topic_cooldown_s=300.0)
        cvs.append(p.cv_after)
        brokers = apply(brokers, p.moves)
        for t, _, _ in p.moves:
            recent[t] = now
        if p.moves:
            last = now
        now += 60.0
        if coefficient_of_variation(broker_scores(brokers, "fair").values()) <= 0.2:
            break
    assert coefficient_of_variation(broker_scores(brokers, "fair").values()) <= 0.2
    assert len(cvs) <= 3
    assert sorted(len(b.topics) for b in brokers) == [10, 10, 10]


def test_same_input_same_plan_whatever_the_order() -> None:
    rng = random.Random(3)
    brokers = []
    for bid in (11, 3, 7, 5):
        names = topics(f"b{bid}", rng.randint(0, 25))
        per = {t: TopicLoad(rng.uniform(0, 100), rng.uniform(0, 1e5)) for t in names}
        brokers.append(BrokerLoad(bid, rng.uniform(0, 100), rng.uniform(0, 100), names, 0.0, 0.0, per,
                                  "draining" if bid == 7 else "active"))
    shuffled = [BrokerLoad(b.broker_id, b.cpu_percent, b.memory_percent, list(reversed(b.topics)), b.msg_per_s,
                           b.bytes_per_s, b.per_topic, b.state) for b in reversed(brokers)]
    for strategy in Strategy:
        first = plan(brokers, strategy, "aggressive", max_moves=8)
        assert plan(brokers, strategy, "aggressive", max_moves=8) == first
        assert plan(shuffled, strategy, "aggressive", max_moves=8) == first
        assert choose_broker("/x/y", brokers, strategy) == choose_broker("/x/y", shuffled, strategy)


# --- /cluster/load_balance ---------------------------------------------------------------


def test_decision_json_round_trip() -> None:
    p = plan([broker(16861613898696940338, 30), broker(2), broker(3)], max_moves=2)
    decision = LoadBalanceDecision.from_plan(p, epoch=7, timestamp=1767225600.9, strategy="fair")
    assert decision.timestamp == 1767225600
    raw = values.encode(decision)
    assert raw.startswith(b'{"epoch":7,"timestamp":1767225600,"strategy":"fair","cv_before":1.414214,')
    assert b'"from_broker":16861613898696940338' in raw
    back = LoadBalanceDecision.decode(raw)
    assert back == decision
    assert back.moves[0] == LoadBalanceMove(p.moves[0][0], 16861613898696940338, p.moves[0][2])
    assert LoadBalanceDecision.from_json(decision.to_json()) == decision


@pytest.mark.parametrize(
    "change",
    [
        {"epoch": -1},
        {"epoch": "7"},
        {"timestamp": 1.5},
        {"strategy": "least_loaded"},
        {"cv_after": None},
        {"moves": [{"topic": "/a/b", "from_broker": 1}]},
        {"moves": [{"topic": "/a/b", "from_broker": True, "to_broker": 2}]},
        {"moves": [3]},
        {"moves": {"topic": "/a/b", "from_broker": 1, "to_broker": 2}},
    ],
)
def test_decision_rejects_malformed_json(change: dict[str, object]) -> None:
    good = {"epoch": 1, "timestamp": 2, "strategy": "fair", "cv_before": 0.5, "cv_after": 0.1, "moves": []}
    LoadBalanceDecision.from_json(good)
    with pytest.raises(ValueError):
        LoadBalanceDecision.from_json({**good, **change})


# --- property ----------------------------------------------------------------------------


@st.composite
def clusters(draw: st.DrawFn) -> tuple[list[BrokerLoad], dict[str, float], int, str, str]:
    n = draw(st.integers(1, 6))
    ids = draw(st.lists(st.integers(1, 2**64 - 1), min_size=n, max_size=n, unique=True))
    states = draw(st.lists(st.sampled_from(["active", "active", "draining", "drained"]), min_size=n, max_size=n))
    n_topics = draw(st.integers(0, 30))
    owners = draw(st.lists(st.integers(0, n - 1), min_size=n_topics, max_size=n_topics))
    rate = st.floats(0, 1e5, allow_nan=False, allow_infinity=False)
    rates = draw(st.lists(st.tuples(rate, rate), min_size=n_topics, max_size=n_topics))
    with_rates = draw(st.booleans())
    brokers = []
    for i, bid in enumerate(ids):
        mine = [f"/ns/t{k}" for k, owner in enumerate(owners) if owner == i]
        per = {f"/ns/t{k}": TopicLoad(*rates[k]) for k, owner in enumerate(owners) if owner == i}
        brokers.append(BrokerLoad(
            bid, draw(st.integers(0, 150)), draw(st.integers(0, 100)), mine,
            sum(r.msg_per_s for r in per.values()), sum(r.bytes_per_s for r in per.values()),
            per if with_rates else None, states[i],  # type: ignore[arg-type]
        ))
    recent_topics = draw(st.lists(st.integers(0, max(0, n_topics - 1)), max_size=n_topics, unique=True))
    recent = {f"/ns/t{k}": draw(st.floats(0, 1000)) for k in recent_topics if n_topics}
    return (brokers, recent, draw(st.integers(0, 10)), draw(st.sampled_from(list(Strategy))),
            draw(st.sampled_from(list(RebalanceAggressiveness))))


@settings(deadline=None, database=None, max_examples=300)
@given(clusters())
def test_plans_only_target_active_brokers_and_never_raise_the_cv(
    case: tuple[list[BrokerLoad], dict[str, float], int, str, str],
) -> None:
    brokers, recent, max_moves, strategy, aggressiveness = case
    p = plan(brokers, strategy, aggressiveness, max_moves=max_moves, now_s=1000.0, recently_moved=recent,
             topic_cooldown_s=200.0)
    mode = {b.broker_id: b.state for b in brokers}
    owner = {t: b.broker_id for b in brokers for t in b.topics}
    leaving = {t for b in brokers if b.state != "active" for t in b.topics}
    assert all(mode[dst] == "active" for _, _, dst in p.moves)
    assert all(owner[t] == src != dst for t, src, dst in p.moves)
    assert len({t for t, _, _ in p.moves}) == len(p.moves)
    if "active" in mode.values():
        assert {t for t, _, _ in p.moves[: p.drain_moves]} == leaving
    assert len(p.balance_moves) <= max_moves
    assert all(1000.0 - recent.get(t, -math.inf) >= 200.0 for t, _, _ in p.balance_moves)
    assert p.cv_after <= p.cv_start + 1e-9
    if not leaving:
        assert p.cv_start == p.cv_before
        assert p.cv_after <= p.cv_before + 1e-9
