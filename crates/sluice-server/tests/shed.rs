//! `sluice shed simulate`: the worker utilization controller on a schedule, as an
//! operator would run it.

mod common;

use std::process::Command;

/// Runs the simulation; returns the CSV's header and rows.
fn simulate(args: &[&str]) -> (Vec<String>, Vec<Vec<f64>>) {
    let out = Command::new(common::bin()).args(["shed", "simulate"]).args(args).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines = text.lines();
    let header = lines.next().unwrap().split(',').map(String::from).collect();
    let rows = lines.map(|l| l.split(',').map(|v| v.parse().unwrap()).collect()).collect();
    (header, rows)
}

#[test]
fn sheds_slowly_recovers_gradually_and_holds_in_the_dead_zone() {
    let (header, rows) = simulate(&["--utilization", "1.0:300s,0.5:300s,0.75:60s"]);
    assert_eq!(header, ["t", "utilization", "shed", "amount", "class0", "class1", "class2", "class3"]);
    let at = |t: f64| rows.iter().find(|r| r[0] == t).unwrap();
    // utilization 1.0: nothing shed for the first 26 s, everything by 160 s
    assert!(rows.iter().filter(|r| r[0] <= 26.0).all(|r| r[2] == 0.0 && r[4..].iter().all(|&p| p == 0.0)));
    assert_eq!(at(160.0)[2], 1.0);
    assert_eq!(&at(160.0)[4..], &[1.0, 1.0, 1.0, 0.0], "every class but the critical one dropped");
    // after the drop to 0.5, shedding falls gradually: 60 s later still above half
    assert!(at(301.0)[2] < 1.0);
    assert!(at(360.0)[2] > 0.5, "{:?}", at(360.0));
    // inside the dead zone (0.75) the amount does not move
    let zone: Vec<f64> = rows.iter().filter(|r| r[0] >= 601.0).map(|r| r[2]).collect();
    assert!(zone.windows(2).all(|w| w[0] == w[1]), "{zone:?}");
    assert!(rows.iter().all(|r| r[7] == 0.0), "critical traffic is never shed");
}

#[test]
fn plots_and_refuses_bad_schedules() {
    let dir = sluice_testkit::TempDir::new("sluice-shed");
    let plot = dir.path().join("shed.svg");
    simulate(&["--utilization", "0.9:60s", "--classes", "3", "--plot", plot.to_str().unwrap()]);
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("polyline") && svg.contains("class 1 dropped"));
    for (args, says) in [
        (&["--utilization", "1.5:10s"][..], "outside 0 to 1"),
        // a schedule of three years grew to 8 GB in 20 s; a step of 0 never ended
        (&["--utilization", "1.0:100000000s"], "raise --step or shorten the schedule"),
        (&["--utilization", "1.0:10s", "--step", "0s"], "--step must be above 0"),
        (&["--load", "1:10s", "--step", "0s"], "--step must be above 0"),
    ] {
        let started = std::time::Instant::now();
        let out = Command::new(common::bin()).args(["shed", "simulate"]).args(args).output().unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && said.contains(says), "{args:?}: {said}");
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "{args:?} took {:?}", started.elapsed());
    }
}

/// docs/operations.md shows `sluice shed simulate ARGS --plot NAME.svg > NAME.csv` and
/// its chart `images/NAME.svg`, which is what that command draws today; returns it.
fn docs_chart(args: &[&str], name: &str) -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = std::fs::read_to_string(root.join("docs/operations.md")).unwrap();
    let command = format!("sluice shed simulate {} --plot {name}.svg > {name}.csv", args.join(" "));
    assert!(
        doc.contains(&command) && doc.contains(&format!("](images/{name}.svg)")),
        "docs/operations.md shows {command}"
    );
    let dir = sluice_testkit::TempDir::new("sluice-shed-docs");
    let plot = dir.path().join(format!("{name}.svg"));
    simulate(&[args, &["--plot", plot.to_str().unwrap()]].concat());
    let drawn = std::fs::read_to_string(&plot).unwrap();
    let committed = std::fs::read_to_string(root.join(format!("docs/images/{name}.svg"))).unwrap();
    assert!(drawn == committed, "docs/images/{name}.svg is stale: run {command} with --plot docs/images/{name}.svg");
    drawn
}

/// The worker utilization chart, on labelled axes (time ticks in seconds, a share from 0
/// to 1).
#[test]
fn the_docs_chart_is_what_the_documented_command_draws() {
    let drawn = docs_chart(&["--utilization", "1.0:300s,0.5:300s,0.75:60s"], "shed");
    for label in ["time (s)", "share (0 to 1)", ">0.5</text>", ">300</text>", ">600</text>", "class 2 dropped"] {
        assert!(drawn.contains(label), "the chart has no {label}");
    }
}

/// `--load`: the adaptive limit in front of a simulated service. Through an overload of
/// three times the capacity the limit settles near the capacity, the critical class is
/// served whole while the least important is shed, and nothing is shed once the load
/// has fallen back.
#[test]
fn the_adaptive_limit_on_a_load_schedule() {
    let (header, rows) =
        simulate(&["--load", "0.5:5s,3:10s,0.5:5s", "--capacity", "20", "--service-time", "5ms", "--seed", "3"]);
    let col = |name: &str| header.iter().position(|h| h == name).unwrap_or_else(|| panic!("no column {name}"));
    let (t, limit, shed0, shed3, offered0) =
        (col("t"), col("limit"), col("shed_class0"), col("shed_class3"), col("offered_class0"));
    for r in rows.iter().filter(|r| (8.0..=15.0).contains(&r[t])) {
        assert!((16.0..=32.0).contains(&r[limit]), "the limit {} at {} s", r[limit], r[t]);
        assert_eq!(r[shed3], 0.0, "critical shed at {} s", r[t]);
        assert!(r[shed0] > 0.5 * r[offered0], "test mode mostly shed at {} s", r[t]);
    }
    for r in rows.iter().filter(|r| r[t] >= 17.0) {
        let shed: f64 = (0..4).map(|c| r[col(&format!("shed_class{c}"))]).sum();
        assert_eq!(shed, 0.0, "shed at {} s, after the load fell", r[t]);
    }
}

#[test]
fn the_adaptive_simulation_refuses_what_it_cannot_run() {
    for (args, says) in [
        (&["--load", "3:10s", "--mix", "0.5,0.5"][..], "--mix needs 4 shares"),
        (&["--load", "3:10s", "--utilization", "0.5:10s"][..], "cannot be used with"),
        (&["--load", "200:10s"][..], "outside 0 to 100"),
        (&["--load", "3:10s", "--capacity", "0"][..], "must be above 0"),
        (&["--load", "100:100000s"][..], "at most 20000000 are simulated"),
    ] {
        let out = Command::new(common::bin()).args(["shed", "simulate"]).args(args).output().unwrap();
        assert!(!out.status.success(), "{args:?} ran");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// The adaptive chart: the limit, latency and shed share per class.
#[test]
fn the_docs_adaptive_chart_is_what_the_documented_command_draws() {
    let args = ["--load", "0.5:10s,3:15s,0.5:10s", "--capacity", "10", "--service-time", "2ms"];
    let drawn = docs_chart(&args, "adaptive");
    for label in ["time (s)", "requests", "latency (ms)", "share shed", "class 3 shed", "capacity"] {
        assert!(drawn.contains(label), "the chart has no {label}");
    }
}
