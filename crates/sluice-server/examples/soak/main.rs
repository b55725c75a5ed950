//! The promise under random faults (`scripts/soak`): real processes (2 to 4 `sluice
//! serve` instances, the store's servers, Sentinels where used) driven by clients over
//! HTTP and gRPC across every kind of rule, while a nemesis injects faults on a schedule
//! drawn from the seed; then a checker reads every decision and the fault log and
//! verifies the promises (docs/operations.md, "Promises"), naming the first violation.
//!
//! `cargo run --release -p sluice-server --example soak -- --minutes 60 --seed 7 --store
//! redis|replicas|sentinel|cluster [--regions N] [--sluice PATH] [--faults KIND,...]
//! [--plant split-secrets]`. `--regions N`: N regions of two instances, each on its own
//! redis-server, sharing a global limit through a global Redis reached over links that
//! delay 20 ms each way, which the nemesis cuts and heals; demand moves between regions.
//! The same seed
//! draws the same instances, traffic mix and fault schedule (what the processes and the
//! machine make of it differs run to run). Exits 1 on a violation.

mod check;
mod drive;
mod fleet;
mod nemesis;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// A small deterministic generator (xorshift): every choice of the run comes from it.
#[derive(Clone)]
pub struct Rng(pub u64);

impl Rng {
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }

    /// A number in `lo..=hi`.
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

/// What a run is asked for.
pub struct Args {
    pub minutes: f64,
    pub seed: u64,
    pub store: fleet::StoreKind,
    pub sluice: std::path::PathBuf,
    /// A bug planted on purpose, to show the checker catching it.
    pub plant: Option<String>,
    /// The kinds of fault to inject (all the store can take when empty).
    pub faults: Vec<String>,
    /// Regions sharing one global limit (0: one region, no global store).
    pub regions: usize,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        minutes: 1.0,
        seed: 1,
        store: fleet::StoreKind::Redis,
        sluice: std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/release/sluice")),
        plant: None,
        faults: Vec::new(),
        regions: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--minutes" => a.minutes = value()?.parse().map_err(|e| format!("--minutes: {e}"))?,
            "--seed" => a.seed = value()?.parse().map_err(|e| format!("--seed: {e}"))?,
            "--store" => a.store = fleet::StoreKind::parse(&value()?)?,
            "--sluice" => a.sluice = value()?.into(),
            "--plant" => a.plant = Some(value()?),
            "--faults" => a.faults = value()?.split(',').map(str::to_string).collect(),
            "--regions" => a.regions = value()?.parse().map_err(|e| format!("--regions: {e}"))?,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.regions == 1 || a.regions > 4 || a.regions > 0 && a.store != fleet::StoreKind::Redis {
        return Err("--regions takes 2 to 4, each region on a redis-server of its own (--store redis)".into());
    }
    if !a.sluice.exists() {
        return Err(format!("no sluice binary at {} (build it, or pass --sluice PATH)", a.sluice.display()));
    }
    Ok(a)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("soak: {e}");
            std::process::exit(2);
        }
    };
    let mut rng = Rng(args.seed.max(1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let started = Instant::now();
    let fleet = Arc::new(fleet::Fleet::start(&args, &mut rng).await);
    keep_logs_on_panic(fleet.dir().to_path_buf());
    eprintln!(
        "soak: seed {} store {} instances {} regions {} for {} min",
        args.seed,
        args.store.name(),
        fleet.size(),
        args.regions.max(1),
        args.minutes
    );
    let clock = check::Clock::now();
    let stop = Arc::new(AtomicBool::new(false));
    let log = drive::Log::default();
    let drivers = drive::spawn(fleet.clone(), log.clone(), stop.clone(), rng.clone(), clock);
    let length = Duration::from_secs_f64(args.minutes * 60.0);
    let faults = nemesis::run(fleet.clone(), rng, clock, length, &args.faults).await;
    stop.store(true, Ordering::Relaxed);
    for d in drivers {
        let _ = d.await;
    }
    let seen = check::Seen { regions: args.regions.max(1), ..log.take() };
    let report = check::check(&seen, &faults, clock);
    report.print(&seen, &faults);
    eprintln!("soak: {:.0} s in all; logs in {}", started.elapsed().as_secs_f64(), fleet.dir().display());
    let failed = !report.violations.is_empty();
    if failed {
        fleet.keep_logs();
    }
    // the fleet's processes are stopped when it is dropped: before exiting, which would
    // skip it (a run with violations left its instances and Redis servers running)
    drop(fleet);
    if failed {
        std::process::exit(1);
    }
}

/// A harness that fails (a store that never heals, a process that will not start) keeps
/// the run's logs as a violation does: the panic hook runs before the directory is
/// dropped.
fn keep_logs_on_panic(dir: std::path::PathBuf) {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        let kept = fleet::kept_dir();
        if std::fs::rename(&dir, &kept).is_ok() {
            eprintln!("soak: the harness failed; logs kept in {}", kept.display());
        }
    }));
}
