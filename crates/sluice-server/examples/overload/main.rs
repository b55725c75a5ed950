//! `scripts/bench-overload`'s two halves: a service that can run `--capacity` requests
//! at once for `--service-time` each (more wait for a slot, first come first served,
//! as in a thread pool) behind one of the fronts compared, and an open-loop load
//! generator that offers it a schedule of loads in Stripe's four classes and records
//! what every request saw.
//!
//!   overload service --capacity C --service-time-us S --front none|static|adaptive
//!   overload load --target HOST:PORT --capacity C --service-time-us S
//!                 --schedule 0.5:10,3:20,0.5:10 --out FILE.csv
//!
//! The service prints `listening HOST:PORT` once it listens. Both speak HTTP/2 without
//! TLS (h2c; the service HTTP/1.1 too), so a few connections carry any number of
//! requests at once, through Envoy as directly.

mod load;
mod service;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned();
    let number = |name: &str| -> u64 {
        let v = flag(name).unwrap_or_else(|| fail(&format!("{name} is required")));
        v.parse().unwrap_or_else(|_| fail(&format!("{name}: `{v}` is not a number")))
    };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    match args.first().map(String::as_str) {
        Some("service") => {
            let front = flag("--front").unwrap_or_else(|| "none".into());
            rt.block_on(service::run(number("--capacity") as usize, number("--service-time-us"), &front));
        }
        Some("load") => {
            let schedule = flag("--schedule").unwrap_or_else(|| fail("--schedule is required"));
            let schedule: Vec<(f64, f64)> = schedule
                .split(',')
                .map(|p| {
                    let (l, s) = p.split_once(':').unwrap_or_else(|| fail("--schedule: LOAD:SECONDS,..."));
                    (l.parse().unwrap_or_else(|_| fail("a load")), s.parse().unwrap_or_else(|_| fail("seconds")))
                })
                .collect();
            let plan = load::Plan {
                target: flag("--target").unwrap_or_else(|| fail("--target is required")),
                capacity: number("--capacity") as f64 / (number("--service-time-us") as f64 / 1e6),
                schedule,
                timeout: std::time::Duration::from_millis(flag("--timeout-ms").map_or(1_000, |v| v.parse().unwrap())),
            };
            let out = flag("--out").unwrap_or_else(|| fail("--out is required"));
            rt.block_on(load::run(&plan, &out));
        }
        _ => fail("overload service|load ... (see the source's header)"),
    }
}

fn fail(why: &str) -> ! {
    eprintln!("overload: {why}");
    std::process::exit(2)
}
