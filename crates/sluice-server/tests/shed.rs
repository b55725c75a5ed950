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
    let out = Command::new(common::bin()).args(["shed", "simulate", "--utilization", "1.5:10s"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("outside 0 to 1"));
}

/// docs/operations.md's chart is what its documented command draws today, on labelled
/// axes (time ticks in seconds, a share from 0 to 1).
#[test]
fn the_docs_chart_is_what_the_documented_command_draws() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = std::fs::read_to_string(root.join("docs/operations.md")).unwrap();
    let command = "sluice shed simulate --utilization 1.0:300s,0.5:300s,0.75:60s --plot shed.svg > shed.csv";
    assert!(
        doc.contains(command) && doc.contains("](images/shed.svg)"),
        "docs/operations.md shows the command and its chart"
    );
    let dir = sluice_testkit::TempDir::new("sluice-shed-docs");
    let plot = dir.path().join("shed.svg");
    simulate(&["--utilization", "1.0:300s,0.5:300s,0.75:60s", "--plot", plot.to_str().unwrap()]);
    let drawn = std::fs::read_to_string(&plot).unwrap();
    let committed = std::fs::read_to_string(root.join("docs/images/shed.svg")).unwrap();
    assert!(
        drawn == committed,
        "docs/images/shed.svg is stale: run the command above with --plot docs/images/shed.svg"
    );
    for label in ["time (s)", "share (0 to 1)", ">0.5</text>", ">300</text>", ">600</text>", "class 2 dropped"] {
        assert!(drawn.contains(label), "the chart has no {label}");
    }
}
