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

/// The keys of the Secret `name` as docs/operations.md creates it (`kubectl create secret
/// generic NAME --from-literal=KEY=...`).
fn secret_keys(name: &serde_json::Value) -> Vec<String> {
    let create = example("kubernetes-secret");
    assert!(create.contains(&format!("kubectl create secret generic {}", name.as_str().unwrap())), "{create}");
    let keys: Vec<String> =
        create.split("--from-literal=").skip(1).map(|rest| rest.split('=').next().unwrap().to_string()).collect();
    assert!(!keys.is_empty(), "{create}");
    keys
}

/// deploy/kubernetes, applied as it is (`kubectl apply -k`): every document parses, the
/// config its ConfigMap carries passes `sluice config check`, and the Deployment,
/// Service, PodDisruptionBudget, HorizontalPodAutoscaler and ServiceMonitor agree with it
/// and with each other.
#[test]
fn the_kubernetes_manifests_parse_and_agree() {
    let docs = common::kubernetes_documents();
    let kind = |k: &str| docs.iter().find(|d| d["kind"] == k).unwrap_or_else(|| panic!("no {k}"));
    let (config_map, deployment, service) = (kind("ConfigMap"), kind("Deployment"), kind("Service"));

    let pod = &deployment["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    // the image's entry point is /bin/ratelimit, which takes no arguments
    assert_eq!(container["command"], serde_json::json!(["/bin/sluice"]), "the Deployment names Sluice's command");
    let args: Vec<&str> = container["args"].as_array().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    assert_eq!(args[0], "serve");

    // the config it mounts is one Sluice accepts, with the Secret docs/operations.md
    // creates mounted where the Deployment mounts it; a placeholder left in it is refused
    let config = config_map["data"]["sluice.yaml"].as_str().expect("data.sluice.yaml");
    let secrets = pod["volumes"].as_array().unwrap().iter().find(|v| v["secret"].is_object()).expect("a Secret volume");
    let mounted = container["volumeMounts"].as_array().unwrap().iter().find(|m| m["name"] == secrets["name"]).unwrap();
    let at = mounted["mountPath"].as_str().unwrap();
    let dir = TempDir::new("sluice-k8s");
    let (file, secret_dir) = (dir.path().join("sluice.yaml"), dir.path().join("secrets"));
    std::fs::create_dir(&secret_dir).unwrap();
    let keys = secret_keys(&secrets["secret"]["secretName"]);
    for (i, key) in keys.iter().enumerate() {
        std::fs::write(secret_dir.join(key), format!("{i}-{}\n", "0123456789abcdef".repeat(2))).unwrap();
    }
    let named: Vec<&str> = config.matches(&format!("{at}/")).collect();
    assert_eq!(named.len(), keys.len(), "the config reads every key of the Secret, and no other file under {at}");
    std::fs::write(&file, config.replace(at, &secret_dir.display().to_string())).unwrap();
    let check = || Command::new(common::bin()).args(["config", "check"]).arg(&file).output().unwrap();
    let out = check();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::write(secret_dir.join(&keys[0]), "CHANGE-ME-to-openssl-rand-hex-16").unwrap();
    let out = check();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && said.contains("placeholder"), "a placeholder secret passed: {said}");

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
    // the image, or as kustomization.yaml's `images:` renames it (its newName and newTag)
    let named = image.rsplit('/').next().unwrap();
    assert!(named == "sluice" || named.starts_with("sluice:"), "{image}");
    assert_eq!(pod["securityContext"]["runAsUser"], 65532);
    assert_eq!(container["securityContext"]["readOnlyRootFilesystem"], true);

    // the budget, the autoscaler and the scrape name the same pods and ports
    let (pdb, hpa, monitor) = (kind("PodDisruptionBudget"), kind("HorizontalPodAutoscaler"), kind("ServiceMonitor"));
    assert_eq!(pdb["spec"]["selector"]["matchLabels"], deployment["spec"]["selector"]["matchLabels"]);
    // rendered with the autoscaling component, the Deployment leaves its count to the
    // autoscaler (a `kubectl apply` would reset it to the Deployment's)
    let least = hpa["spec"]["minReplicas"].as_u64().unwrap();
    let replicas = deployment["spec"]["replicas"].as_u64().unwrap_or(least);
    assert!(pdb["spec"]["minAvailable"].as_u64().unwrap() < replicas, "a drain can proceed");
    assert_eq!(hpa["spec"]["scaleTargetRef"]["name"], deployment["metadata"]["name"]);
    assert!(least >= replicas);
    let endpoint = &monitor["spec"]["endpoints"][0];
    assert_eq!((endpoint["port"].as_str(), endpoint["path"].as_str()), (Some("http"), Some("/metrics")));
    let wanted = monitor["spec"]["selector"]["matchLabels"].as_object().unwrap();
    let labels = service["metadata"]["labels"].as_object().cloned().unwrap_or_default();
    assert!(wanted.iter().all(|(k, v)| labels.get(k) == Some(v)), "the ServiceMonitor selects the Service: {labels:?}");
}
