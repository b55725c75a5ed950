//! A simulated service behind the admission, on a simulated clock: what the tests and
//! `sluice shed simulate --adaptive` run.
//!
//! The service runs `capacity` requests at once, each for `service_time` (give or take
//! a tenth, plus a real machine's noise: see `Sim::service_time`; all drawn from the
//! seed); more wait in its own queue, first come first served,
//! so its latency rises once more than `capacity` run, as a thread pool's does. Requests
//! arrive as a Poisson process at `load x capacity / service_time` a second, the load
//! following a schedule, each of a class drawn from `mix`. Deterministic for a seed.

use super::admission::{Admission, Entry, Ticket};
use super::gradient::{GradientParams, Micros, Outcome};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

/// What to simulate.
#[derive(Debug, Clone)]
pub struct Setup {
    /// Requests the service runs at once.
    pub capacity: u32,
    /// How long one takes, µs.
    pub service_time: Micros,
    /// Offered load as a multiple of capacity, and how long it lasts (µs), in order.
    pub schedule: Vec<(f64, Micros)>,
    /// Share of the offered requests in each class, least important first.
    pub mix: Vec<f64>,
    /// The controller's parameters; `None` puts nothing in front of the service.
    pub params: Option<GradientParams>,
    /// Length of one reported period, µs.
    pub period: Micros,
    pub seed: u64,
}

/// One reported period.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Period {
    /// End of the period, µs from the start.
    pub end: Micros,
    /// The offered load then, as a multiple of capacity.
    pub load: f64,
    /// The limit at the end of the period (0 with nothing in front).
    pub limit: u32,
    /// The no-load latency learned by the end of the period, µs (0 with nothing in front).
    pub base: Micros,
    /// The most requests in flight through the front during the period.
    pub in_flight: u32,
    /// Per class: offered, served and shed requests that arrived in the period.
    pub offered: Vec<u64>,
    pub served: Vec<u64>,
    pub shed: Vec<u64>,
    /// Latencies of the requests served in the period (arrival to answer), µs, sorted.
    pub latencies: Vec<Micros>,
    /// The longest a request served in the period waited in front of the service, µs.
    pub max_wait: Micros,
}

impl Period {
    /// The `q` quantile (0 to 1) of the latencies served in the period, µs.
    pub fn quantile(&self, q: f64) -> Micros {
        if self.latencies.is_empty() {
            return 0;
        }
        let i = ((self.latencies.len() as f64 * q).ceil() as usize).clamp(1, self.latencies.len()) - 1;
        self.latencies[i]
    }
}

/// A small deterministic generator (xorshift64*).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrive,
    Done(usize),
    Deadline(usize, Ticket),
}

struct Request {
    class: usize,
    arrived: Micros,
    started: Micros,
}

/// The simulation's state.
struct Sim {
    setup: Setup,
    rng: Rng,
    front: Option<Admission<usize>>,
    events: BinaryHeap<Reverse<(Micros, u64, Event)>>,
    seq: u64,
    requests: Vec<Request>,
    busy: u32,
    backlog: VecDeque<usize>,
    periods: Vec<Period>,
    /// When the next request arrives, µs, unrounded (rounding each gap would slow the
    /// arrivals of a fast service by half a µs each).
    next_arrival: f64,
}

/// Runs the simulation; one `Period` per `setup.period`.
pub fn run(setup: Setup) -> Vec<Period> {
    let classes = setup.mix.len().max(1);
    let front = setup.params.map(|p| Admission::new(p, classes, 0));
    let total: Micros = setup.schedule.iter().map(|(_, d)| d).sum();
    let mut sim = Sim {
        rng: Rng::new(setup.seed),
        front,
        events: BinaryHeap::new(),
        seq: 0,
        requests: Vec::new(),
        busy: 0,
        backlog: VecDeque::new(),
        periods: Vec::new(),
        next_arrival: 0.0,
        setup,
    };
    sim.schedule(0, Event::Arrive);
    while let Some(Reverse((now, _, event))) = sim.events.pop() {
        if now >= total {
            break;
        }
        match event {
            Event::Arrive => sim.arrive(now),
            Event::Done(id) => sim.done(now, id),
            Event::Deadline(id, ticket) => {
                if sim.front.as_mut().is_some_and(|f| f.withdraw(ticket, now)) {
                    sim.shed(id);
                }
            }
        }
    }
    sim.period_at(total.saturating_sub(1));
    sim.periods.iter_mut().for_each(|p| p.latencies.sort_unstable());
    sim.periods
}

impl Sim {
    fn schedule(&mut self, at: Micros, event: Event) {
        self.seq += 1;
        self.events.push(Reverse((at, self.seq, event)));
    }

    /// The load at `now`, or 0 past the schedule's end.
    fn load(&self, now: Micros) -> f64 {
        let mut end = 0;
        for &(load, length) in &self.setup.schedule {
            end += length;
            if now < end {
                return load;
            }
        }
        0.0
    }

    /// The period `now` falls in, created (and the ones before it) as needed.
    fn period_at(&mut self, now: Micros) -> &mut Period {
        let index = (now / self.setup.period) as usize;
        let classes = self.setup.mix.len().max(1);
        while self.periods.len() <= index {
            let end = (self.periods.len() as Micros + 1) * self.setup.period;
            let load = self.load(end - 1);
            let zeros = vec![0; classes];
            self.periods.push(Period {
                end,
                load,
                offered: zeros.clone(),
                served: zeros.clone(),
                shed: zeros,
                ..Period::default()
            });
        }
        &mut self.periods[index]
    }

    fn arrive(&mut self, now: Micros) {
        let s = &self.setup;
        let rate = self.load(now) * f64::from(s.capacity) / s.service_time as f64; // per µs
        if rate > 0.0 {
            // from the last arrival's unrounded time (it is `now` rounded up)
            let last = if self.next_arrival + 1.0 < now as f64 { now as f64 } else { self.next_arrival };
            self.next_arrival = last - (1.0 - self.rng.unit()).ln() / rate;
            self.schedule((self.next_arrival.ceil() as Micros).max(now + 1), Event::Arrive);
        } else {
            self.next_arrival = (now + s.period) as f64;
            self.schedule(now + s.period, Event::Arrive);
            return;
        }
        let class = self.class();
        let id = self.requests.len();
        self.requests.push(Request { class, arrived: now, started: now });
        self.period_at(now).offered[class] += 1;
        let Some(front) = self.front.as_mut() else {
            return self.start(now, id);
        };
        match front.enter(class, now, id) {
            Entry::Run => self.start(now, id),
            Entry::Wait { ticket, deadline, evicted } => {
                self.schedule(deadline, Event::Deadline(id, ticket));
                if let Some(e) = evicted {
                    self.shed(e);
                }
            }
            Entry::Shed(id) => self.shed(id),
        }
        self.note_in_flight(now);
    }

    fn class(&mut self) -> usize {
        let total: f64 = self.setup.mix.iter().sum();
        let mut x = self.rng.unit() * total;
        for (class, share) in self.setup.mix.iter().enumerate() {
            if x < *share {
                return class;
            }
            x -= share;
        }
        self.setup.mix.len().saturating_sub(1)
    }

    fn start(&mut self, now: Micros, id: usize) {
        self.requests[id].started = now;
        if self.busy < self.setup.capacity {
            self.busy += 1;
            let t = self.service_time();
            self.schedule(now + t, Event::Done(id));
        } else {
            self.backlog.push_back(id);
        }
    }

    /// `service_time` give or take a tenth, plus a machine's noise, which does not
    /// scale with the service: up to a millisecond from a timer's rounding, and, one
    /// request in fifty, a stall of a few milliseconds (on the machine that runs
    /// `scripts/bench-overload`, a 2 ms service answers in 3.6 ms at p50 and 5 to 7 ms
    /// at p99, a 50 ms one in 51.5 and 52 to 55 ms).
    fn service_time(&mut self) -> Micros {
        let s = self.setup.service_time as f64;
        let mut t = s * (0.9 + 0.2 * self.rng.unit()) + 1_000.0 * self.rng.unit();
        if self.rng.unit() < 0.02 {
            t += -3_000.0 * (1.0 - self.rng.unit()).ln();
        }
        t as Micros
    }

    fn done(&mut self, now: Micros, id: usize) {
        self.busy -= 1;
        if let Some(next) = self.backlog.pop_front() {
            self.busy += 1;
            let t = self.service_time();
            self.schedule(now + t, Event::Done(next));
        }
        let r = &self.requests[id];
        let (class, arrived, started) = (r.class, r.arrived, r.started);
        let p = self.period_at(arrived);
        p.served[class] += 1;
        let p = self.period_at(now);
        p.latencies.push(now - arrived);
        p.max_wait = p.max_wait.max(started - arrived);
        let Some(front) = self.front.as_mut() else { return };
        front.finish(now, now - started, Outcome::Served);
        while let Some(next) = self.front.as_mut().and_then(|f| f.next(now)) {
            self.start(now, next);
        }
        self.note_in_flight(now);
    }

    fn shed(&mut self, id: usize) {
        let (class, arrived) = (self.requests[id].class, self.requests[id].arrived);
        self.period_at(arrived).shed[class] += 1;
    }

    fn note_in_flight(&mut self, now: Micros) {
        let (limit, in_flight, base) = match &self.front {
            Some(f) => (f.gradient().limit(), f.in_flight(), f.gradient().base().unwrap_or(0.0) as Micros),
            None => (0, self.busy + self.backlog.len() as u32, 0),
        };
        let p = self.period_at(now);
        p.limit = limit;
        p.base = base;
        p.in_flight = p.in_flight.max(in_flight);
    }
}
