//! The gRPC listener's bounds (`grpc/listen.rs`): a connection limit, a deadline for a
//! connection's first call, an idle timeout, and health that stays answered whatever
//! the gRPC port is sent.

mod common;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::RateLimitQuotaUsageReports;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use std::io::Read;
use std::time::{Duration, Instant};

fn request(user: &str) -> RateLimitRequest {
    common::rls_request("d", &[("user", user)])
}

/// Opens N connections to HOST:PORT that send nothing, prints `opened K`, then reads
/// each until the server closes it (its settings frame is all it sends) or until D
/// seconds after they were all opened, and prints `closed K`. Run as a process of its
/// own, two of them, so that 20,000 connections are open at once: each process has this
/// machine's open-file limit too.
const FLOOD: &str = r#"
import socket, sys, time
host, port, n, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
held = []
for _ in range(n):
    try:
        held.append(socket.create_connection((host, port)))
    except OSError:
        pass
print("opened", len(held), flush=True)
by, closed = time.monotonic() + d, 0
for c in held:
    try:
        while True:
            c.settimeout(max(by - time.monotonic(), 0.001))
            if not c.recv(4096):
                closed += 1
                break
    except ConnectionResetError:
        closed += 1
    except OSError:
        pass
print("closed", closed, flush=True)
"#;

/// A line `word K` from a flood process.
fn flood_line(lines: &mut impl Iterator<Item = std::io::Result<String>>, word: &str) -> usize {
    let line = lines.next().expect("the flood process ended").unwrap();
    line.strip_prefix(word).and_then(|k| k.trim().parse().ok()).unwrap_or_else(|| panic!("{line:?}"))
}

/// `GET path` on a new connection: the status and how long it took.
fn timed_get(base: &str, path: &str) -> (u16, Duration) {
    use std::io::Write;
    let started = Instant::now();
    let addr = base.trim_start_matches("http://");
    let mut c = std::net::TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(c, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut head = [0u8; 64];
    let n = c.read(&mut head).unwrap_or(0);
    let status = std::str::from_utf8(&head[..n]).ok().and_then(|h| h.split(' ').nth(1)?.parse().ok()).unwrap_or(0);
    (status, started.elapsed())
}

/// 20,000 connections to the gRPC port that never send a byte, against a server with
/// this machine's open-file limit (20,000, which they exhausted before: health and
/// decisions timed out and the log said "Too many open files"): health answers within
/// 100 ms, HTTP and gRPC decisions are served, no more than `max_connections` stay open,
/// and every one of them is closed within the first-call deadline (2 s here; a margin
/// for the last accepted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_cannot_exhaust_the_grpc_port() {
    let _heavy = common::heavy().await;
    let s = common::start_with("  header_timeout: 2s\n", &common::rule(1_000_000));
    // an Envoy's connection, opened and used before the flood
    let mut envoy = RateLimitServiceClient::connect(format!("http://{}", s.grpc)).await.unwrap();
    envoy.should_rate_limit(request("before")).await.unwrap();

    let (host, port) = s.grpc.rsplit_once(':').unwrap();
    let floods: Vec<_> = (0..2)
        .map(|_| {
            let mut child = std::process::Command::new("python3")
                .args(["-c", FLOOD, host, port, "10000", "3.5"])
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("python3 runs the flood (apt-get install python3)");
            let lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().unwrap()));
            (child, lines)
        })
        .collect();
    let mut floods: Vec<_> =
        floods.into_iter().map(|(c, mut lines)| (c, flood_line(&mut lines, "opened"), lines)).collect();
    let opened: usize = floods.iter().map(|f| f.1).sum();
    assert!(opened >= 19_000, "only {opened} of 20,000 connections opened");

    // while they are open (none has reached the first-call deadline yet)
    let fds = std::fs::read_dir(format!("/proc/{}/fd", s.process.pid())).unwrap().count();
    assert!(fds < 4_096 + 300, "the server holds {fds} files with {opened} idle connections");
    for i in 0..10 {
        let (status, took) = timed_get(&s.base, "/healthz");
        assert!(status == 200 && took < Duration::from_millis(100), "health {status} in {took:?}:\n{}", s.log());
        let r = common::hit(&reqwest::Client::new(), &s.base, "d", &[("user", &format!("flood{i}"))]).await;
        assert_eq!(r.status(), 200, "{}", s.log());
    }
    envoy.should_rate_limit(request("during")).await.expect("the busy connection is still served");

    // every idle one is closed by the server (EOF or reset) by the deadline and a margin
    let closed: usize = tokio::task::spawn_blocking(move || {
        floods
            .iter_mut()
            .map(|(child, _, lines)| {
                let closed = flood_line(lines, "closed");
                child.wait().unwrap();
                closed
            })
            .sum()
    })
    .await
    .unwrap();
    let scrape = common::metrics(&reqwest::Client::new(), &s.base).await;
    assert_eq!(closed, opened, "idle connections closed within 3.5 s of the last one opened:\n{scrape}");
    assert!(common::series(&scrape, "sluice_grpc_connections_over_limit_total") > 0.0, "{scrape}");
    assert!(
        common::series(&scrape, "sluice_grpc_connections_closed_total{reason=\"first_call\"}") >= 3_000.0,
        "{scrape}"
    );
    assert!(s.log().contains("gRPC connection limit reached"), "{}", s.log());
    // the connection in use outlived the deadline, and now only it is open
    envoy.should_rate_limit(request("after")).await.expect("the busy connection is still served");
    let scrape = common::metrics(&reqwest::Client::new(), &s.base).await;
    assert_eq!(common::series(&scrape, "sluice_grpc_connections"), 1.0, "{scrape}");
}

/// A connection with no call open for `grpc_idle_timeout` is closed, and a call in
/// progress (an RLQS stream that sends nothing for a while) keeps its connection open
/// past it.
#[tokio::test]
async fn a_connection_without_calls_is_closed_at_the_idle_timeout() {
    let s = common::start_with("  header_timeout: 5s\n  grpc_idle_timeout: 1s\n", &common::rule(1_000));
    let client = reqwest::Client::new();
    let mut rls = RateLimitServiceClient::connect(format!("http://{}", s.grpc)).await.unwrap();
    rls.should_rate_limit(request("idle")).await.unwrap();
    let mut rlqs = RateLimitQuotaServiceClient::connect(format!("http://{}", s.grpc)).await.unwrap();
    // a stream open, no report sent: the call is in progress
    let stream = tokio::spawn(async move {
        let reports = futures_util::stream::pending::<RateLimitQuotaUsageReports>();
        let mut answers = rlqs.stream_rate_limit_quotas(reports).await?.into_inner();
        answers.message().await
    });
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let scrape = common::metrics(&client, &s.base).await;
    assert_eq!(common::series(&scrape, "sluice_grpc_connections_closed_total{reason=\"idle\"}"), 1.0, "{scrape}");
    assert_eq!(common::series(&scrape, "sluice_grpc_connections"), 1.0, "the stream's connection stays: {scrape}");
    assert!(!stream.is_finished(), "the stream was ended");
    stream.abort();
    // the closed one is opened again by the client, and served
    let mut answered = rls.should_rate_limit(request("idle")).await;
    if answered.is_err() {
        answered = rls.should_rate_limit(request("idle")).await;
    }
    answered.expect("served on a new connection");
}

/// `server.grpc_max_connection_age` (their `GRPC_MAX_CONNECTION_AGE`): a connection older
/// than it is asked to go (GOAWAY) though it is busy, its client comes back on a new
/// one, and a call open then finishes within the grace or is cut at its end (their
/// `_GRACE`), so that a fleet's connections spread again after a rolling restart.
#[tokio::test]
async fn connections_are_aged_out() {
    let section = "  header_timeout: 10s\n  grpc_max_connection_age: 1s\n  grpc_max_connection_age_grace: 1s\n";
    let s = common::start_with(section, &common::rule(1_000_000));
    let mut rls = RateLimitServiceClient::connect(format!("http://{}", s.grpc)).await.unwrap();
    let open = || async {
        let scrape = common::metrics(&reqwest::Client::new(), &s.base).await;
        common::series(&scrape, "sluice_grpc_connections")
    };
    rls.should_rate_limit(request("aged")).await.unwrap();
    assert_eq!(open().await, 1.0);
    // a stream that never ends holds its connection past the age, until the grace
    let mut rlqs = RateLimitQuotaServiceClient::connect(format!("http://{}", s.grpc)).await.unwrap();
    let stream = tokio::spawn(async move {
        let reports = futures_util::stream::pending::<RateLimitQuotaUsageReports>();
        let mut answers = rlqs.stream_rate_limit_quotas(reports).await?.into_inner();
        answers.message().await
    });
    let started = Instant::now();
    let deadline = started + Duration::from_secs(8);
    while open().await > 0.0 || !stream.is_finished() {
        assert!(Instant::now() < deadline, "{} connections open after {:?}", open().await, started.elapsed());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(started.elapsed() >= Duration::from_millis(900), "cut before its age: {:?}", started.elapsed());
    // the client comes back on a new connection
    let mut answered = rls.should_rate_limit(request("aged")).await;
    if answered.is_err() {
        answered = rls.should_rate_limit(request("aged")).await;
    }
    answered.expect("served on a new connection");
    assert_eq!(open().await, 1.0);
}

/// `server.grpc_uds` (envoyproxy/ratelimit's `GRPC_UDS`): gRPC on a Unix socket instead
/// of TCP, decided and counted as on TCP; a socket file left behind by a process before
/// is replaced at start.
#[tokio::test]
async fn grpc_is_served_on_a_unix_socket() {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    let dir = sluice_testkit::TempDir::new("sluice-uds");
    let socket = dir.path().join("rls.sock");
    // a stale socket from a process before
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    let s = common::start_with(&format!("  grpc_uds: {}\n", socket.display()), &common::rule(2));
    assert_eq!(s.grpc, format!("unix:{}", socket.display()), "the ready file names the socket");
    let mut rls = unix_client(&socket).await;
    let mut codes = Vec::new();
    for _ in 0..3 {
        codes.push(rls.should_rate_limit(request("uds")).await.unwrap().into_inner().overall_code);
    }
    assert_eq!(codes, [Code::Ok as i32, Code::Ok as i32, Code::OverLimit as i32]);
    let scrape = common::metrics(&reqwest::Client::new(), &s.base).await;
    assert_eq!(common::series(&scrape, "sluice_grpc_connections"), 1.0, "under the same bounds: {scrape}");
}

/// A client of the rate limit service on the Unix socket `path` (each new connection
/// opens it again).
async fn unix_client(path: &std::path::Path) -> RateLimitServiceClient<tonic::transport::Channel> {
    let path = path.to_path_buf();
    let connector = tower::service_fn(move |_: tonic::transport::Uri| {
        let path = path.clone();
        async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
    });
    let channel =
        tonic::transport::Endpoint::from_static("http://sluice.sock").connect_with_connector(connector).await.unwrap();
    RateLimitServiceClient::new(channel)
}

/// The same from envoyproxy/ratelimit's environment: `GRPC_UDS` puts gRPC on the socket,
/// and `GRPC_MAX_CONNECTION_AGE` with `_GRACE` close a connection there after its age
/// (the idle timeout is minutes away), its client served again on a new one.
#[tokio::test]
async fn their_environment_puts_grpc_on_a_socket_with_an_age() {
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
    let dir = sluice_testkit::TempDir::new("sluice-env-uds");
    let socket = dir.path().join("rls.sock");
    let rule = "domain: d\ndescriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 2}\n";
    let redis = sluice_testkit::RedisServer::start();
    let url = redis.addr().to_string();
    let vars = [
        ("REDIS_SOCKET_TYPE", "tcp"),
        ("REDIS_URL", url.as_str()),
        ("GRPC_UDS", socket.to_str().unwrap()),
        ("GRPC_MAX_CONNECTION_AGE", "1s"),
        ("GRPC_MAX_CONNECTION_AGE_GRACE", "1s"),
    ];
    let (_sluice, grpc) = common::their_way(&dir, rule, &vars);
    assert_eq!(grpc, format!("unix:{}", socket.display()));
    let ready = std::fs::read_to_string(dir.path().join("ready")).unwrap();
    let base = format!("http://{}", ready.lines().find_map(|l| l.strip_prefix("http=")).unwrap());
    let open =
        || async { common::series(&common::metrics(&reqwest::Client::new(), &base).await, "sluice_grpc_connections") };
    let mut rls = unix_client(&socket).await;
    let code = rls.should_rate_limit(request("env")).await.unwrap().into_inner().overall_code;
    assert_eq!((code, open().await), (Code::Ok as i32, 1.0));
    let started = Instant::now();
    while open().await > 0.0 {
        assert!(started.elapsed() < Duration::from_secs(8), "still open after {:?}", started.elapsed());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut answered = rls.should_rate_limit(request("env")).await;
    if answered.is_err() {
        answered = rls.should_rate_limit(request("env")).await;
    }
    let code = answered.expect("served on a new connection").into_inner().overall_code;
    assert_eq!(code, Code::Ok as i32, "the second of two");
    let code = rls.should_rate_limit(request("env")).await.unwrap().into_inner().overall_code;
    assert_eq!(code, Code::OverLimit as i32);
}
