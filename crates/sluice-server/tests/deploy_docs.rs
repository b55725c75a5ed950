//! The deployment examples are checked, not just written: the systemd unit of
//! docs/operations.md passes `systemd-analyze verify` with no warning, deploy/kubernetes
//! renders (`kubectl kustomize`, where kubectl is installed) and every document parses,
//! the config its ConfigMap carries passes `sluice config check`, and every flag the
//! examples give `sluice serve` exists.

mod common;

use sluice_testkit::{TempDir, require};
use std::process::Command;

/// The fenced block after `<!-- checked: NAME -->` in docs/operations.md.
fn example(name: &str) -> String {
    common::doc_example("operations.md", name)
}

/// Every `--flag` of `args` is one `sluice serve --help` lists.
fn flags_exist(args: &[&str]) {
    let help = Command::new(common::bin()).args(["serve", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in args.iter().filter(|a| a.starts_with("--")) {
        assert!(help.contains(&format!("{flag} ")), "`sluice serve` has no {flag}:\n{help}");
    }
}

#[test]
fn the_systemd_unit_verifies() {
    let unit = example("systemd");
    let exec = unit.lines().find_map(|l| l.strip_prefix("ExecStart=")).expect("an ExecStart");
    let args: Vec<&str> = exec.split_whitespace().collect();
    assert_eq!((args[0], args[1]), ("/usr/local/bin/sluice", "serve"), "{exec}");
    flags_exist(&args[2..]);
    // verify needs the program to exist: the binary under test stands in for it
    let dir = TempDir::new("sluice-unit");
    let file = dir.path().join("sluice.service");
    std::fs::write(&file, unit.replace("/usr/local/bin/sluice", common::bin())).unwrap();
    let out = Command::new(require("systemd-analyze", "systemd")).arg("verify").arg(&file).output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && said.trim().is_empty(), "systemd-analyze verify:\n{said}");
}

/// The documents of deploy/kubernetes as `kubectl kustomize` renders them, where kubectl
/// is installed; else the files its kustomization.yaml lists, each parsed, so that
/// neither a machine without kubectl nor one with it skips the checks.
fn kubernetes_documents() -> Vec<serde_json::Value> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kubernetes");
    let parse = |text: &str| -> Vec<serde_json::Value> {
        text.split("\n---\n")
            .filter(|d| !d.trim().is_empty())
            .map(|d| serde_norway::from_str(d).unwrap_or_else(|e| panic!("not YAML ({e}):\n{d}")))
            .collect()
    };
    if let Ok(out) = Command::new("kubectl").arg("kustomize").arg(&dir).output() {
        assert!(out.status.success(), "kubectl kustomize: {}", String::from_utf8_lossy(&out.stderr));
        return parse(&String::from_utf8_lossy(&out.stdout));
    }
    let kustomization: serde_json::Value =
        serde_norway::from_str(&std::fs::read_to_string(dir.join("kustomization.yaml")).unwrap()).unwrap();
    let files = kustomization["resources"].as_array().expect("resources");
    files.iter().flat_map(|f| parse(&std::fs::read_to_string(dir.join(f.as_str().unwrap())).unwrap())).collect()
}

/// deploy/kubernetes, applied as it is (`kubectl apply -k`): every document parses, the
/// config its ConfigMap carries passes `sluice config check`, and the Deployment,
/// Service, PodDisruptionBudget, HorizontalPodAutoscaler and ServiceMonitor agree with it
/// and with each other.
#[test]
fn the_kubernetes_manifests_parse_and_agree() {
    let docs = kubernetes_documents();
    let kind = |k: &str| docs.iter().find(|d| d["kind"] == k).unwrap_or_else(|| panic!("no {k}"));
    let (config_map, deployment, service) = (kind("ConfigMap"), kind("Deployment"), kind("Service"));

    // the config it mounts is one Sluice accepts
    let config = config_map["data"]["sluice.yaml"].as_str().expect("data.sluice.yaml");
    let dir = TempDir::new("sluice-k8s");
    let file = dir.path().join("sluice.yaml");
    std::fs::write(&file, config).unwrap();
    let check = Command::new(common::bin()).args(["config", "check"]).arg(&file).output().unwrap();
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stderr));

    let pod = &deployment["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let args: Vec<&str> = container["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    assert_eq!(args[0], "serve");
    flags_exist(&args[1..]);
    let mount = container["volumeMounts"][0]["mountPath"].as_str().unwrap();
    let config_arg = args.iter().position(|a| *a == "--config").map(|i| args[i + 1]).unwrap();
    assert_eq!(config_arg, format!("{mount}/sluice.yaml"), "--config names the mounted file");
    assert_eq!(pod["volumes"][0]["configMap"]["name"], config_map["metadata"]["name"]);

    // the ports are the config's, and the probes the server's health routes
    let parsed: serde_json::Value = serde_norway::from_str(config).unwrap();
    let port = |addr: &serde_json::Value| addr.as_str().unwrap().rsplit(':').next().unwrap().parse::<u64>().unwrap();
    let ports = container["ports"].as_array().unwrap();
    let named = |n: &str| ports.iter().find(|p| p["name"] == n).unwrap()["containerPort"].as_u64().unwrap();
    assert_eq!((named("http"), named("grpc")), (port(&parsed["server"]["http"]), port(&parsed["server"]["grpc"])));
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    let shutdown = parsed["server"]["shutdown_grace"].as_str().unwrap().trim_end_matches('s').parse::<u64>().unwrap();
    assert!(grace > shutdown, "terminationGracePeriodSeconds must exceed server.shutdown_grace");
    assert_eq!(service["spec"]["selector"], deployment["spec"]["selector"]["matchLabels"]);
    let image = container["image"].as_str().unwrap();
    assert!(image == "sluice" || image.starts_with("sluice:"), "{image}");
    assert_eq!(pod["securityContext"]["runAsUser"], 65532);
    assert_eq!(container["securityContext"]["readOnlyRootFilesystem"], true);

    // the budget, the autoscaler and the scrape name the same pods and ports
    let (pdb, hpa, monitor) = (kind("PodDisruptionBudget"), kind("HorizontalPodAutoscaler"), kind("ServiceMonitor"));
    assert_eq!(pdb["spec"]["selector"]["matchLabels"], deployment["spec"]["selector"]["matchLabels"]);
    let replicas = deployment["spec"]["replicas"].as_u64().unwrap();
    assert!(pdb["spec"]["minAvailable"].as_u64().unwrap() < replicas, "a drain can proceed");
    assert_eq!(hpa["spec"]["scaleTargetRef"]["name"], deployment["metadata"]["name"]);
    assert!(hpa["spec"]["minReplicas"].as_u64().unwrap() >= replicas);
    let endpoint = &monitor["spec"]["endpoints"][0];
    assert_eq!((endpoint["port"].as_str(), endpoint["path"].as_str()), (Some("http"), Some("/metrics")));
    let wanted = monitor["spec"]["selector"]["matchLabels"].as_object().unwrap();
    let labels = service["metadata"]["labels"].as_object().cloned().unwrap_or_default();
    assert!(wanted.iter().all(|(k, v)| labels.get(k) == Some(v)), "the ServiceMonitor selects the Service: {labels:?}");
}
