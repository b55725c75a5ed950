//! The controller and the admission, alone and on a simulated service.

use super::admission::{Admission, Entry};
use super::gradient::{Gradient, GradientParams, Outcome};
use super::sim::{Period, Rng, Setup, run};

/// Stripe's four classes, least important first: test mode, GETs, POSTs, critical.
const MIX: [f64; 4] = [0.2, 0.45, 0.25, 0.1];

fn setup(capacity: u32, service_ms: u64, schedule: &[(f64, u64)], seed: u64) -> Setup {
    Setup {
        capacity,
        service_time: service_ms * 1000,
        schedule: schedule.iter().map(|&(l, s)| (l, s * 1_000_000)).collect(),
        mix: MIX.to_vec(),
        params: Some(GradientParams::default()),
        period: 500_000,
        seed,
    }
}

/// The periods that end within `from..=to` seconds.
fn between(periods: &[Period], from: f64, to: f64) -> impl Iterator<Item = &Period> {
    periods.iter().filter(move |p| p.end as f64 / 1e6 > from && p.end as f64 / 1e6 <= to)
}

fn p99(periods: &[&Period]) -> u64 {
    let mut all: Vec<u64> = periods.iter().flat_map(|p| p.latencies.iter().copied()).collect();
    all.sort_unstable();
    all[(all.len() * 99).div_ceil(100) - 1]
}

/// The three steps (0.5x, 3x, 0.5x of capacity) on the four services, with
/// the same defaults for all: the limit settles near the capacity, critical requests
/// are served through the overload, admitted latency stays within twice the unloaded
/// p99 from 5 s after the step, and nothing is shed once the overload has drained.
#[test]
fn the_same_defaults_serve_every_service() {
    let seeds: u64 = std::env::var("SLUICE_SIM_SEEDS").map_or(2, |v| v.parse().unwrap());
    for (c, s, seed) in
        [(10, 2), (200, 2), (10, 50), (200, 50)].into_iter().flat_map(|(c, s)| (0..seeds).map(move |k| (c, s, k)))
    {
        let periods = run(setup(c, s, &[(0.5, 10), (3.0, 15), (0.5, 10)], u64::from(c) + s + 1000 * seed));
        let unloaded = p99(&between(&periods, 2.0, 10.0).collect::<Vec<_>>());
        let settled: Vec<&Period> = between(&periods, 15.0, 25.0).collect();
        for p in &settled {
            let limit = f64::from(p.limit);
            assert!(limit >= 0.8 * f64::from(c) && limit <= 1.6 * f64::from(c), "C {c} S {s} seed {seed}: {p:?}");
        }
        let loaded = p99(&settled);
        assert!(
            loaded <= 2 * unloaded,
            "C {c} S {s} seed {seed}: p99 {loaded} µs under overload, {unloaded} µs unloaded"
        );
        let overload: Vec<&Period> = between(&periods, 10.0, 25.0).collect();
        let offered: u64 = overload.iter().map(|p| p.offered[3]).sum();
        let served: u64 = overload.iter().map(|p| p.served[3]).sum();
        assert!(served as f64 >= 0.99 * offered as f64, "C {c} S {s} seed {seed}: critical {served} of {offered}");
        let shed_lower: u64 = overload.iter().map(|p| p.shed[0] + p.shed[1]).sum();
        assert!(shed_lower > 0, "C {c} S {s} seed {seed}: the overload shed nothing below");
        for p in between(&periods, 25.5, 30.0) {
            assert_eq!(p.shed.iter().sum::<u64>(), 0, "C {c} S {s} seed {seed}: shed after the load fell: {p:?}");
        }
    }
}

/// With nothing in front the same overload grows the latency without bound: the
/// simulated service is one that needs protecting.
#[test]
fn nothing_in_front_lets_latency_grow() {
    let mut s = setup(10, 2, &[(0.5, 2), (3.0, 3)], 1);
    s.params = None;
    let periods = run(s);
    let last = periods.last().unwrap();
    assert!(last.quantile(0.5) > 100 * 2000, "p50 {} µs", last.quantile(0.5));
}

/// Whatever the latencies, the limit stays within its floor and ceiling.
#[test]
fn the_limit_keeps_its_floor_and_ceiling() {
    let params = GradientParams { initial: 8, floor: 5, ceiling: 40, ..GradientParams::default() };
    for seed in 0..20 {
        let mut rng = Rng::new(seed);
        let mut g = Gradient::new(params, 0);
        let mut now = 0;
        for _ in 0..20_000 {
            now += (rng.unit() * 2_000.0) as u64;
            if rng.unit() < 0.5 {
                g.saturated();
            }
            let latency = (rng.unit().powi(3) * 500_000.0) as u64 + 1;
            let outcome = if rng.unit() < 0.02 { Outcome::Dropped } else { Outcome::Served };
            g.sample(now, latency, outcome);
            assert!((5..=40).contains(&g.limit()), "seed {seed}: {}", g.limit());
        }
    }
}

/// Feeds `g` one window of `latency` from `samples` requests, saturated or not, and
/// returns the limit after it.
fn window(g: &mut Gradient, now: &mut u64, latency: u64, saturated: bool) -> u32 {
    let end = *now + g.window_length();
    for i in 0..100 {
        if saturated {
            g.saturated();
        }
        *now += g.window_length() / 100;
        if let Some(limit) = g.sample((*now).max(end * u64::from(i == 99)), latency, Outcome::Served) {
            return limit;
        }
    }
    g.limit()
}

/// A service that became slower for its own reasons is not mistaken for a queue: two
/// cuts in a row do not bring latency down, so the no-load latency is learned again
/// instead of the limit falling to its floor.
#[test]
fn a_slower_service_is_not_a_queue() {
    let mut g = Gradient::new(GradientParams { initial: 100, ..GradientParams::default() }, 0);
    let mut now = 0;
    window(&mut g, &mut now, 1_000, true);
    let learned = g.limit();
    assert!(learned > 100, "slow start grows a saturated limit: {learned}");
    let cut = window(&mut g, &mut now, 3_000, true);
    assert!(cut < learned / 2, "latency tripled: {learned} -> {cut}");
    window(&mut g, &mut now, 3_000, true); // the window after a cut is not judged
    let again = window(&mut g, &mut now, 3_000, true); // the cut did nothing: once may be chance
    assert!(again < cut && g.base() == Some(1_000.0), "cut again: {again}, base {:?}", g.base());
    window(&mut g, &mut now, 3_000, true);
    window(&mut g, &mut now, 3_000, true); // twice: the service is slower
    assert!((2_900.0..=3_100.0).contains(&g.base().unwrap()), "base {:?}", g.base());
    for _ in 0..10 {
        window(&mut g, &mut now, 3_000, true);
    }
    assert!(g.limit() > cut, "grows again from the new base: {} after {cut}", g.limit());
}

/// A queueing service: the cut lands on the capacity the latency showed.
#[test]
fn a_cut_lands_on_the_capacity_measured() {
    let mut g = Gradient::new(GradientParams { initial: 50, ..GradientParams::default() }, 0);
    let mut now = 0;
    window(&mut g, &mut now, 1_000, false);
    assert_eq!(g.limit(), 50, "not saturated: the limit is not what holds requests back");
    // 50 admitted to a service of capacity 20 answer in 50/20 of the no-load latency
    let cut = window(&mut g, &mut now, 2_500, true);
    assert_eq!(cut, 20);
}

/// Between half the tolerance and the whole of it (1.125 to 1.25 times the base) the
/// limit rests, saturated or not: a band, as Vegas has, so that under a long overload it
/// does not saw between the capacity and the tolerance (each cut leaves the requests
/// above the new limit to drain, which is where the admitted p99 came from). Below the
/// band a saturated limit grows; above it, it is cut.
#[test]
fn the_limit_rests_in_a_band_above_the_base() {
    let mut g = Gradient::new(GradientParams { initial: 50, ..GradientParams::default() }, 0);
    let mut now = 0;
    window(&mut g, &mut now, 1_000, false);
    let cut = window(&mut g, &mut now, 2_000, true);
    window(&mut g, &mut now, 1_000, true); // the window after a cut is not judged
    for _ in 0..5 {
        assert_eq!(window(&mut g, &mut now, 1_200, true), cut, "1.2 times the base: the limit rests");
    }
    assert!(window(&mut g, &mut now, 1_100, true) > cut, "1.1 times the base and saturated: it grows");
}

/// The classes share one limit: a freed slot goes to the most important waiter, the
/// queue holds at most the limit, a newcomer displaces the least important waiter, and
/// the requests in flight never pass the limit.
#[test]
fn classes_share_one_limit_most_important_first() {
    let params = GradientParams { initial: 4, floor: 4, ceiling: 4, ..GradientParams::default() };
    let mut a: Admission<u32> = Admission::new(params, 4, 0);
    for id in 0..4 {
        assert_eq!(a.enter(1, 0, id), Entry::Run);
    }
    for (id, class) in [(10, 0), (11, 1), (12, 2), (13, 0)] {
        assert!(matches!(a.enter(class, 1, id), Entry::Wait { evicted: None, .. }));
    }
    // the queue is full (4): a critical newcomer displaces the oldest test-mode waiter
    assert!(matches!(a.enter(3, 2, 14), Entry::Wait { evicted: Some(10), .. }));
    // and a test-mode newcomer finds nobody less important to displace
    assert_eq!(a.enter(0, 3, 15), Entry::Shed(15));
    let mut order = vec![];
    for t in 0..4 {
        a.finish(10 + t, 10, Outcome::Served);
        order.push(a.next(10 + t).unwrap());
        assert!(a.in_flight() <= 4);
    }
    assert_eq!(order, vec![14, 12, 11, 13]);
}

/// Random arrivals, finishes and withdrawals: nobody starts while the requests in
/// flight are at the limit (so the classes together never pass it), and an arrival
/// never grows the queue past the limit.
#[test]
fn nobody_starts_at_the_limit() {
    for seed in 0..20 {
        let mut rng = Rng::new(seed);
        let params = GradientParams { initial: 6, floor: 2, ..GradientParams::default() };
        let mut a: Admission<u64> = Admission::new(params, 4, 0);
        let (mut now, mut running, mut tickets) = (0u64, 0u32, Vec::new());
        for id in 0..5_000u64 {
            now += (rng.unit() * 300.0) as u64;
            let (limit, before, queued) = (a.gradient().limit(), a.in_flight(), a.waiting());
            let r = rng.unit();
            if r < 0.5 {
                match a.enter((rng.unit() * 4.0) as usize, now, id) {
                    Entry::Run => {
                        assert!(before < limit, "seed {seed}: started at {before} of {limit}");
                        running += 1;
                    }
                    Entry::Wait { ticket, .. } => tickets.push(ticket),
                    Entry::Shed(_) => {}
                }
                // the queue grows only below the limit (after a cut it may hold more)
                assert!(a.waiting() <= limit.max(queued), "seed {seed}");
            } else if r < 0.9 && running > 0 {
                running -= 1;
                a.finish(now, (rng.unit() * 5_000.0) as u64 + 1, Outcome::Served);
                loop {
                    let (limit, before) = (a.gradient().limit(), a.in_flight());
                    if a.next(now).is_none() {
                        break;
                    }
                    assert!(before < limit, "seed {seed}: handed a slot at {before} of {limit}");
                    running += 1;
                }
            } else if let Some(ticket) = tickets.pop() {
                a.withdraw(ticket, now);
            }
            assert_eq!(a.in_flight(), running, "seed {seed}");
        }
    }
}
