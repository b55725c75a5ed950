//! The OCI image of `scripts/image`, built FROM scratch with buildah from the binary
//! under test, and its root filesystem run as envoyproxy/ratelimit's image is run:
//! `/bin/ratelimit` with their environment, as user 65532, in a chroot, in a network
//! namespace of its own (so its fixed ports, 8080 and 8081, take nobody's, and it sees
//! loopback only). Its Redis is a name from the image's /etc/hosts.

mod common;

use sluice_testkit::{TempDir, require};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Runs in the namespace: Redis, then the image's /bin/ratelimit, then the probes with
/// this machine's tools (the image has none).
const SCRIPT: &str = r#"
set -u
ip link set lo up
"$REDIS" --port 6379 --bind 127.0.0.1 --save '' --appendonly no >"$DIR/redis.log" 2>&1 &
redis=$!
env -i HOME=/ LOG_LEVEL=info USE_STATSD=false REDIS_SOCKET_TYPE=tcp REDIS_URL=redis.sluice.test:6379 \
  RUNTIME_ROOT=/data RUNTIME_SUBDIRECTORY=ratelimit RUNTIME_IGNOREDOTFILES=true RUNTIME_WATCH_ROOT=false \
  "$CHROOT" --userspec=65532:65532 "$ROOTFS" /bin/ratelimit >"$DIR/sluice.log" 2>&1 &
sluice=$!
for _ in $(seq 100); do
  "$CURL" -sf http://127.0.0.1:8080/healthcheck >/dev/null && break
  sleep 0.1
done
echo "healthcheck: $("$CURL" -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8080/healthcheck)"
echo "user: $(stat -c %u /proc/$sluice 2>/dev/null) exe: $(readlink /proc/$sluice/root)"
"$SLUICE" bench --grpc --target 127.0.0.1:8081 --duration 1s --concurrency 1 --clients 1 --domain api --key user | grep statuses
kill "$sluice" "$redis"
wait
"#;

/// Runs in a network and mount namespace: Redis, then /bin/ratelimit with Envoy
/// Gateway's whole generated environment (its `default.yaml` Deployment with Prometheus
/// and tracing on) on the image's root made read-only, as user 65534 (Envoy Gateway's
/// security context); then the probes, gRPC over TLS with the Secret's CA, and the
/// metrics port.
const ENVOY_GATEWAY: &str = r#"
set -u
ip link set lo up
mount --bind "$ROOTFS" "$ROOTFS" && mount -o remount,bind,ro "$ROOTFS"
touch "$ROOTFS/written" 2>/dev/null && echo "root: writable" || echo "root: read-only"
"$REDIS" --port 6379 --bind 127.0.0.1 --save '' --appendonly no >"$DIR/redis.log" 2>&1 &
redis=$!
env -i HOME=/ RUNTIME_ROOT=/data RUNTIME_SUBDIRECTORY=ratelimit RUNTIME_IGNOREDOTFILES=true \
  RUNTIME_WATCH_ROOT=false LOG_LEVEL=info USE_STATSD=false CONFIG_TYPE=GRPC_XDS_SOTW \
  CONFIG_GRPC_XDS_SERVER_URL=envoy-gateway:18001 CONFIG_GRPC_XDS_NODE_ID=envoy-ratelimit \
  GRPC_SERVER_USE_TLS=true GRPC_SERVER_TLS_CERT=/certs/tls.crt GRPC_SERVER_TLS_KEY=/certs/tls.key \
  GRPC_SERVER_TLS_CA_CERT=/certs/ca.crt CONFIG_GRPC_XDS_SERVER_USE_TLS=true \
  CONFIG_GRPC_XDS_CLIENT_TLS_CERT=/certs/tls.crt CONFIG_GRPC_XDS_CLIENT_TLS_KEY=/certs/tls.key \
  CONFIG_GRPC_XDS_SERVER_TLS_CACERT=/certs/ca.crt FORCE_START_WITHOUT_INITIAL_CONFIG=true \
  REDIS_SOCKET_TYPE=tcp REDIS_URL=redis.redis.svc:6379 USE_PROMETHEUS=true PROMETHEUS_ADDR=:19001 \
  PROMETHEUS_MAPPER_YAML=/etc/statsd-exporter/conf.yaml TRACING_ENABLED=true \
  TRACING_SERVICE_NAME=envoy-ratelimit TRACING_SERVICE_NAMESPACE=envoy-gateway-system \
  TRACING_SERVICE_INSTANCE_ID=envoy-ratelimit-0 TRACING_SAMPLING_RATE=1.0 \
  OTEL_EXPORTER_OTLP_ENDPOINT=http://trace-collector.envoy-gateway-system.svc.cluster.local:4318 \
  "$CHROOT" --userspec=65534:65534 "$ROOTFS" /bin/ratelimit >"$DIR/sluice.log" 2>&1 &
sluice=$!
for _ in $(seq 100); do
  "$CURL" -sf http://127.0.0.1:8080/healthcheck >/dev/null && break
  sleep 0.1
done
echo "healthcheck: $("$CURL" -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8080/healthcheck)"
echo "user: $(stat -c %u /proc/$sluice 2>/dev/null)"
printf '\0\0\0\0\0' >"$DIR/empty.grpc"
"$CURL" -s -i --http2 --cacert "$DIR/certs/ca.crt" -H 'content-type: application/grpc' -H 'te: trailers' \
  --data-binary @"$DIR/empty.grpc" https://localhost:8081/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit \
  | tr -d '\r' | grep -i '^grpc-'
echo "metrics: $("$CURL" -s http://127.0.0.1:19001/metrics | grep -c '^sluice_')"
kill "$sluice" "$redis"
wait
"#;

#[test]
fn the_image_runs_as_envoyproxy_ratelimits_image_does() {
    let dir = TempDir::new("sluice-image");
    let (rootfs, config) = build(&dir);
    assert_eq!(config["OCIv1"]["config"]["User"], "65532:65532", "{config}");
    assert_eq!(config["OCIv1"]["config"]["Entrypoint"][0], "/bin/ratelimit");
    // what it holds: both names, CA certificates, no shell
    for file in ["bin/ratelimit", "bin/sluice", "etc/ssl/certs/ca-certificates.crt", "etc/passwd"] {
        assert!(rootfs.join(file).exists(), "the image has no /{file}");
    }
    assert!(!rootfs.join("bin/sh").exists(), "the image has a shell");

    // their files and names, as a Deployment would mount them
    let config_dir = rootfs.join("data/ratelimit/config");
    std::fs::create_dir_all(&config_dir).unwrap();
    let rule = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 1000000}\n";
    std::fs::write(config_dir.join("api.yaml"), rule).unwrap();
    std::fs::write(rootfs.join("etc/hosts"), "127.0.0.1 localhost redis.sluice.test\n").unwrap();
    let (said, stderr, log) = run(&dir, &rootfs, &["--net"], SCRIPT);
    assert!(said.contains("healthcheck: 200"), "{said}\n{stderr}\n{log}");
    assert!(said.contains("user: 65532"), "{said}");
    let statuses = said.lines().find(|l| l.contains("statuses")).unwrap_or_default();
    assert!(statuses.contains("200:") && !statuses.contains("429"), "gRPC on 8081: {said}\n{log}");
    assert!(log.contains("store=\"redis\""), "the store is Redis, by its name from /etc/hosts:\n{log}");
}

/// The image's root filesystem run with Envoy Gateway's whole environment (what its
/// `internal/infrastructure/kubernetes/ratelimit/resource.go` generates, Prometheus and
/// tracing on), read-only and as Envoy Gateway's user: it starts before its control plane
/// answers (FORCE_START_WITHOUT_INITIAL_CONFIG), `/healthcheck` answers on 8080, gRPC over
/// TLS with the Secret's certificate on 8081 (UNAVAILABLE, waiting for the first push),
/// and the metrics on 19001. The control plane's and Redis's names come from /etc/hosts.
#[test]
fn the_image_runs_under_envoy_gateways_deployment() {
    let dir = TempDir::new("sluice-image-eg");
    let (rootfs, _) = build(&dir);
    // the `envoy-rate-limit` Secret, mounted at /certs
    let certs = dir.path().join("certs");
    std::fs::create_dir_all(&certs).unwrap();
    sluice_testkit::make_certs(&certs, "ca", &["server"]);
    std::fs::create_dir_all(rootfs.join("certs")).unwrap();
    for (from, to) in [("server.crt", "tls.crt"), ("server.key", "tls.key"), ("ca.crt", "ca.crt")] {
        let file = rootfs.join("certs").join(to);
        std::fs::copy(certs.join(from), &file).unwrap();
        // the Secret volume's defaultMode, 420 (0644)
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let hosts =
        "127.0.0.1 localhost redis.redis.svc envoy-gateway trace-collector.envoy-gateway-system.svc.cluster.local\n";
    std::fs::write(rootfs.join("etc/hosts"), hosts).unwrap();
    let (said, stderr, log) = run(&dir, &rootfs, &["--net", "--mount"], ENVOY_GATEWAY);
    let all = format!("{said}\n{stderr}\n{log}");
    assert!(said.contains("root: read-only"), "{all}");
    assert!(said.contains("healthcheck: 200") && said.contains("user: 65534"), "{all}");
    assert!(
        said.contains("grpc-status: 14"),
        "gRPC over TLS on 8081 answers UNAVAILABLE before the first push:\n{all}"
    );
    // grpc-message is percent-encoded
    let message = said.replace("%20", " ");
    assert!(message.contains("waiting for the first push from the xDS server at envoy-gateway:18001"), "{all}");
    let metrics = said.lines().find_map(|l| l.strip_prefix("metrics: ")).and_then(|n| n.trim().parse::<u32>().ok());
    assert!(metrics.is_some_and(|n| n > 10), "the metrics port 19001:\n{all}");
    for note in ["GRPC_SERVER_TLS_CA_CERT", "PROMETHEUS_MAPPER_YAML", "CONFIG_TYPE=GRPC_XDS_SOTW"] {
        assert!(log.contains(note), "{note} is said at start:\n{log}");
    }
}

/// Runs in a network and mount namespace: Redis as the Service `redis`, then the
/// Deployment's own command and arguments on the image's root made read-only, as the
/// Deployment's user; then a decision with an API token and one without, and the image's
/// entry point given the Deployment's arguments (what ran when the manifest named none).
const DEPLOYMENT: &str = r#"
set -u
ip link set lo up
mount --bind "$ROOTFS" "$ROOTFS" && mount -o remount,bind,ro "$ROOTFS"
"$REDIS" --port 6379 --bind 127.0.0.1 --save '' --appendonly no >"$DIR/redis.log" 2>&1 &
redis=$!
env -i HOME=/ "$CHROOT" --userspec="$USERSPEC" "$ROOTFS" $COMMAND_LINE >"$DIR/sluice.log" 2>&1 &
sluice=$!
for _ in $(seq 100); do
  "$CURL" -sf http://127.0.0.1:8080/readyz >/dev/null && break
  sleep 0.1
done
echo "readyz: $("$CURL" -s -o /dev/null -w '%{http_code}' http://127.0.0.1:8080/readyz)"
decide() {
  "$CURL" -s -o /dev/null -w '%{http_code}' "$@" -H 'content-type: application/json'     -d '{"domain":"api","descriptors":[{"entries":[{"key":"user","value":"alice"}]}]}'     http://127.0.0.1:8080/v1/ratelimit
}
echo "with token: $(decide -H "authorization: Bearer $TOKEN")"
echo "without: $(decide)"
kill "$sluice"
wait "$sluice"
echo "exit: $?"
env -i HOME=/ "$CHROOT" --userspec="$USERSPEC" "$ROOTFS" /bin/ratelimit $ARGS 2>"$DIR/entrypoint.log"
echo "entrypoint exit: $?"
echo "entrypoint said: $(cat "$DIR/entrypoint.log")"
kill "$redis"
wait
"#;

/// deploy/kubernetes's Deployment, run as it is on the image: its `command` and `args`
/// read from the manifest, the ConfigMap's config and the Secret's files (made as
/// docs/operations.md makes them, owned by the pod's group, mode 0440) mounted where it
/// mounts them, as its user, on a read-only root. It serves, requires the token, and
/// stops cleanly; the image's entry point given the same arguments says to call
/// /bin/sluice. (The manifest set `args` alone, and `/bin/ratelimit serve ...` exited 2.)
#[test]
fn the_kubernetes_deployment_runs_on_the_image() {
    let dir = TempDir::new("sluice-image-k8s");
    let (rootfs, _) = build(&dir);
    let docs = common::kubernetes_documents();
    let kind = |k: &str| docs.iter().find(|d| d["kind"] == k).unwrap_or_else(|| panic!("no {k}"));
    let pod = &kind("Deployment")["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let words = |v: &serde_json::Value| -> Vec<String> {
        v.as_array().map(|a| a.iter().map(|w| w.as_str().unwrap().to_string()).collect()).unwrap_or_default()
    };
    let (command, args) = (words(&container["command"]), words(&container["args"]));
    let mount = |volume: &str| -> PathBuf {
        let name = pod["volumes"].as_array().unwrap().iter().find(|v| v[volume].is_object()).unwrap()["name"].clone();
        let m = container["volumeMounts"].as_array().unwrap().iter().find(|m| m["name"] == name).unwrap();
        rootfs.join(m["mountPath"].as_str().unwrap().trim_start_matches('/'))
    };
    let (config_dir, secret_dir) = (mount("configMap"), mount("secret"));
    std::fs::create_dir_all(&config_dir).unwrap();
    let config = kind("ConfigMap")["data"]["sluice.yaml"].as_str().unwrap();
    std::fs::write(config_dir.join("sluice.yaml"), config).unwrap();
    std::fs::create_dir_all(&secret_dir).unwrap();
    let token = "7f3a9c0e5b2d4f6a8c1e3b5d7f9a0c2e";
    let group = pod["securityContext"]["fsGroup"].as_u64().expect("an fsGroup for the Secret's files");
    for (key, value) in
        [("admin-token", "a".repeat(32)), ("api-tokens", token.to_string()), ("key-secret", "k".repeat(64))]
    {
        let file = secret_dir.join(key);
        std::fs::write(&file, value).unwrap();
        std::os::unix::fs::chown(&file, Some(0), Some(group as u32)).unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o440)).unwrap();
    }
    std::fs::write(rootfs.join("etc/hosts"), "127.0.0.1 localhost redis\n").unwrap();
    let user = format!("{}:{}", pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]);
    let env = [
        ("COMMAND_LINE", [command.clone(), args.clone()].concat().join(" ")),
        ("ARGS", args.join(" ")),
        ("USERSPEC", user),
        ("TOKEN", token.to_string()),
    ];
    let (said, stderr, log) = run_with(&dir, &rootfs, &["--net", "--mount"], DEPLOYMENT, &env);
    let all = format!("{said}\n{stderr}\n{log}");
    assert!(said.contains("readyz: 200"), "{all}");
    assert!(said.contains("with token: 200") && said.contains("without: 401"), "{all}");
    assert!(said.contains("exit: 0\n"), "a clean stop on SIGTERM: {all}");
    assert!(said.contains("entrypoint exit: 2"), "{all}");
    assert!(said.contains("call /bin/sluice"), "the entry point says what to run: {all}");
}

/// Builds the image from the binary under test with scripts/image (buildah), leaving its
/// root filesystem in `dir/rootfs`; returns that and the image's config (`buildah
/// inspect`), the image itself removed.
fn build(dir: &TempDir) -> (PathBuf, serde_json::Value) {
    require("buildah", "buildah");
    let rootfs = dir.path().join("rootfs");
    let tag =
        format!("localhost/sluice-test-{}:{}", dir.path().file_name().unwrap().to_string_lossy(), std::process::id());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/image");
    let built = Command::new(&script)
        .args(["--binary", common::bin(), "--tag", &tag, "--rootfs"])
        .arg(&rootfs)
        .output()
        .unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&built.stdout), String::from_utf8_lossy(&built.stderr));
    assert!(built.status.success() && said.contains("built"), "scripts/image: {said}");
    let inspect = Command::new("buildah").args(["inspect", "--type", "image", &tag]).output().unwrap();
    let config = serde_json::from_slice(&inspect.stdout).expect("buildah inspect");
    let _ = Command::new("buildah").args(["rmi", &tag]).output();
    (rootfs, config)
}

/// Runs `script` in new `namespaces` (`unshare`), with the tools it calls named in its
/// environment; returns what it printed, its errors, and the server's log.
fn run(dir: &TempDir, rootfs: &Path, namespaces: &[&str], script: &str) -> (String, String, String) {
    run_with(dir, rootfs, namespaces, script, &[])
}

/// [`run`], with more variables in the script's environment.
fn run_with(
    dir: &TempDir,
    rootfs: &Path,
    namespaces: &[&str],
    script: &str,
    env: &[(&str, String)],
) -> (String, String, String) {
    let (curl, redis) = (require("curl", "curl"), require("redis-server", "redis-server"));
    let (unshare, chroot) = (require("unshare", "util-linux"), require("chroot", "coreutils"));
    let out = Command::new(unshare)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .args(namespaces)
        .args(["--", "sh", "-c", script])
        .env("DIR", dir.path())
        .env("ROOTFS", rootfs)
        .env("REDIS", redis)
        .env("CURL", curl)
        .env("CHROOT", chroot)
        .env("SLUICE", common::bin())
        .output()
        .unwrap();
    let log = std::fs::read_to_string(dir.path().join("sluice.log")).unwrap_or_default();
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned(), log)
}
