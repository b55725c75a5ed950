//! The OCI image of `scripts/image`, built FROM scratch with buildah from the binary
//! under test, and its root filesystem run as envoyproxy/ratelimit's image is run:
//! `/bin/ratelimit` with their environment, as user 65532, in a chroot, in a network
//! namespace of its own (so its fixed ports, 8080 and 8081, take nobody's, and it sees
//! loopback only). Its Redis is a name from the image's /etc/hosts.

mod common;

use sluice_testkit::{TempDir, require};
use std::path::Path;
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

#[test]
fn the_image_runs_as_envoyproxy_ratelimits_image_does() {
    require("buildah", "buildah");
    let (curl, redis) = (require("curl", "curl"), require("redis-server", "redis-server"));
    let (unshare, chroot) = (require("unshare", "util-linux"), require("chroot", "coreutils"));
    let dir = TempDir::new("sluice-image");
    let rootfs = dir.path().join("rootfs");
    let tag = format!("localhost/sluice-test:{}", std::process::id());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/image");
    let built = Command::new(&script)
        .args(["--binary", common::bin(), "--tag", &tag, "--rootfs"])
        .arg(&rootfs)
        .output()
        .unwrap();
    let said = format!("{}{}", String::from_utf8_lossy(&built.stdout), String::from_utf8_lossy(&built.stderr));
    assert!(built.status.success() && said.contains("built"), "scripts/image: {said}");
    let inspect = Command::new("buildah").args(["inspect", "--type", "image", &tag]).output().unwrap();
    let config: serde_json::Value = serde_json::from_slice(&inspect.stdout).expect("buildah inspect");
    assert_eq!(config["OCIv1"]["config"]["User"], "65532:65532", "{config}");
    assert_eq!(config["OCIv1"]["config"]["Entrypoint"][0], "/bin/ratelimit");
    let _ = Command::new("buildah").args(["rmi", &tag]).output();
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
    let out = Command::new(unshare)
        .args(["--net", "--", "sh", "-c", SCRIPT])
        .env("DIR", dir.path())
        .env("ROOTFS", &rootfs)
        .env("REDIS", redis)
        .env("CURL", curl)
        .env("CHROOT", chroot)
        .env("SLUICE", common::bin())
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    let log = std::fs::read_to_string(dir.path().join("sluice.log")).unwrap_or_default();
    assert!(said.contains("healthcheck: 200"), "{said}\n{}\n{log}", String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("user: 65532"), "{said}");
    let statuses = said.lines().find(|l| l.contains("statuses")).unwrap_or_default();
    assert!(statuses.contains("200:") && !statuses.contains("429"), "gRPC on 8081: {said}\n{log}");
    assert!(log.contains("store=\"redis\""), "the store is Redis, by its name from /etc/hosts:\n{log}");
}
