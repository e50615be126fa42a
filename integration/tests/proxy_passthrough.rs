//! Byte-level transparency of the proxy, checked against a recording fake runtime.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue};
use http_body_util::BodyExt;
use hyper::body::Frame;
use k8s_cri::v1 as cri;
use prost::Message;
use tessera_integration::fake_runtime::{FakeRuntime, Script, grpc_headers, reply};
use tessera_integration::hooks::RecordingHook;
use tessera_integration::proxy::{RelayMode, RunningProxy};
use tessera_integration::raw::{RawClient, frame};
use tokio::sync::mpsc;

fn ok_trailers(extra: &[(&'static str, &'static str)]) -> HeaderMap {
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("0"));
    for (name, value) in extra {
        trailers.insert(*name, HeaderValue::from_static(value));
    }
    trailers
}

/// Answers every call with a fixed body and custom trailers.
fn echo_script() -> Script {
    Arc::new(|recorded| {
        let body = frame(format!("reply-to:{}", recorded.path).as_bytes());
        reply(
            grpc_headers(),
            body,
            ok_trailers(&[("x-runtime-trailer", "kept")]),
        )
    })
}

async fn setup(
    mode: RelayMode,
    script: Script,
    hooks: Vec<Arc<dyn tessera_runtime_proxy::Hook>>,
) -> (tempfile::TempDir, FakeRuntime, RunningProxy) {
    tessera_integration::init_tracing();
    let dir = tempfile::Builder::new()
        .prefix("tpas-")
        .tempdir_in("/tmp")
        .expect("tempdir");
    let fake = FakeRuntime::start(&dir.path().join("runtime.sock"), script).expect("fake runtime");
    let proxy =
        RunningProxy::start_mode(mode, &dir.path().join("proxy.sock"), fake.socket(), hooks)
            .await
            .expect("proxy");
    (dir, fake, proxy)
}

async fn unknown_method_passes_byte_for_byte_with_metadata_and_trailers(mode: RelayMode) {
    let (_dir, fake, proxy) = setup(mode, echo_script(), vec![]).await;
    let mut client = RawClient::connect(&proxy.socket).await.expect("connect");
    // Not valid protobuf on purpose: passthrough must not decode.
    let body = frame(&[0xff, 0x00, 0x13, 0x37, 0xde, 0xad]);
    let path = "/runtime.v1.RuntimeService/UpdatePodSandboxResources";
    let response = client
        .call(
            path,
            &[
                ("x-request-meta", "abc"),
                ("grpc-timeout", "5S"),
                ("user-agent", "kubelet/v1.33"),
            ],
            body.clone(),
        )
        .await
        .expect("call");
    let recorded = fake.forwarded();
    assert_eq!(recorded.len(), 1);
    assert_eq!(recorded[0].path, path);
    assert_eq!(recorded[0].body, body, "request bytes changed");
    assert_eq!(recorded[0].headers["x-request-meta"], "abc");
    assert_eq!(recorded[0].headers["grpc-timeout"], "5S");
    assert_eq!(recorded[0].headers["user-agent"], "kubelet/v1.33");
    assert_eq!(response.body, frame(format!("reply-to:{path}").as_bytes()));
    let trailers = response.trailers.expect("trailers");
    assert_eq!(trailers["grpc-status"], "0");
    assert_eq!(trailers["x-runtime-trailer"], "kept");
}

async fn error_status_message_and_details_are_unchanged(mode: RelayMode) {
    let script: Script = Arc::new(|_| {
        let mut headers = grpc_headers();
        // Trailers-only error, as grpc-go sends it.
        headers.insert("grpc-status", HeaderValue::from_static("5"));
        headers.insert(
            "grpc-message",
            HeaderValue::from_static("container %22x%22 not found"),
        );
        headers.insert(
            "grpc-status-details-bin",
            HeaderValue::from_static("CAUSBmRldGFpbA"),
        );
        let (_tx, rx) = mpsc::channel(1);
        (headers, rx)
    });
    let (_dir, _fake, proxy) = setup(mode, script, vec![]).await;
    let mut client = RawClient::connect(&proxy.socket).await.expect("connect");
    let start = cri::StartContainerRequest {
        container_id: "x".into(),
    }
    .encode_to_vec();
    // A passthrough method, then an intercepted one: the runtime's status, not the proxy's.
    for (path, body) in [
        ("/runtime.v1.RuntimeService/ContainerStatus", frame(b"")),
        ("/runtime.v1.RuntimeService/StartContainer", frame(&start)),
    ] {
        let response = client.call(path, &[], body).await.expect("call");
        assert_eq!(response.headers["grpc-status"], "5", "{path}");
        assert_eq!(
            response.headers["grpc-message"], "container %22x%22 not found",
            "{path}"
        );
        assert_eq!(
            response.headers["grpc-status-details-bin"], "CAUSBmRldGFpbA",
            "{path}"
        );
    }
}

/// Opens GetContainerEvents through a proxy in front of `script` and checks that
/// the first event ("event-1") arrives on its own; returns the still-open stream.
async fn watch_events(
    mode: RelayMode,
    script: Script,
) -> (
    tempfile::TempDir,
    FakeRuntime,
    RunningProxy,
    hyper::body::Incoming,
) {
    let (dir, fake, proxy) = setup(mode, script, vec![]).await;
    let mut client = RawClient::connect(&proxy.socket).await.expect("connect");
    let response = client
        .send(
            "/runtime.v1.RuntimeService/GetContainerEvents",
            &[],
            frame(&cri::GetEventsRequest {}.encode_to_vec()),
        )
        .await
        .expect("stream opens");
    let mut body = response.into_body();
    let first = tokio::time::timeout(Duration::from_secs(5), body.frame())
        .await
        .expect("first event arrives alone")
        .expect("frame")
        .expect("ok")
        .into_data()
        .expect("data");
    assert_eq!(first, frame(b"event-1"));
    (dir, fake, proxy, body)
}

async fn server_streaming_is_streamed_not_buffered(mode: RelayMode) {
    let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
    let release_rx = Arc::new(std::sync::Mutex::new(release_rx));
    let script: Script = Arc::new(move |recorded| {
        if !recorded.path.ends_with("/GetContainerEvents") {
            return echo_script()(recorded);
        }
        let (tx, rx) = mpsc::channel(4);
        let release = Arc::clone(&release_rx);
        tokio::spawn(async move {
            let _ = tx.send(Frame::data(frame(b"event-1"))).await;
            // The second event only goes out once the client has seen the first.
            let released = tokio::task::spawn_blocking(move || {
                release
                    .lock()
                    .map(|rx| rx.recv_timeout(Duration::from_secs(10)).is_ok())
                    .unwrap_or(false)
            });
            if released.await.unwrap_or(false) {
                let _ = tx.send(Frame::data(frame(b"event-2"))).await;
                let _ = tx.send(Frame::trailers(ok_trailers(&[]))).await;
            }
        });
        (grpc_headers(), rx)
    });
    let (_dir, _fake, _proxy, body) = watch_events(mode, script).await;
    release_tx.send(()).expect("release");
    let rest = body.collect().await.expect("rest");
    let trailers = rest.trailers().cloned().expect("trailers");
    assert_eq!(rest.to_bytes(), frame(b"event-2"));
    assert_eq!(trailers["grpc-status"], "0");
}

/// A CreateContainerRequest with fields unknown to k8s-cri at the top level and inside `config`.
fn create_request_with_unknown_fields() -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let config = cri::ContainerConfig {
        metadata: Some(cri::ContainerMetadata {
            name: "main".into(),
            attempt: 0,
        }),
        envs: vec![cri::KeyValue {
            key: "A".into(),
            value: "1".into(),
        }],
        ..Default::default()
    };
    let unknown_inner = vec![0xfa, 0x3e, 0x05, b'i', b'n', b'n', b'e', b'r']; // field 1999, LEN "inner"
    let unknown_outer = vec![0xf8, 0x3e, 0x2a]; // field 1999, varint 42
    let mut config_bytes = config.encode_to_vec();
    config_bytes.extend_from_slice(&unknown_inner);
    let sandbox = cri::PodSandboxConfig {
        metadata: Some(cri::PodSandboxMetadata {
            name: "p".into(),
            uid: "u".into(),
            namespace: "ns".into(),
            attempt: 0,
        }),
        ..Default::default()
    };
    let mut message = cri::CreateContainerRequest {
        pod_sandbox_id: "sb".into(),
        config: None,
        sandbox_config: Some(sandbox),
    }
    .encode_to_vec();
    message.push(0x12); // field 2 (config), LEN
    message.push(u8::try_from(config_bytes.len()).expect("small"));
    message.extend_from_slice(&config_bytes);
    message.extend_from_slice(&unknown_outer);
    (message, unknown_inner, unknown_outer)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack
        .windows(needle.len())
        .any(|window| window == needle)
}

async fn rewritten_create_container_keeps_unknown_fields(mode: RelayMode) {
    // v1alpha2 carries the same messages and must get the same treatment.
    for service in ["runtime.v1", "runtime.v1alpha2"] {
        check_create_rewrite(mode, &format!("/{service}.RuntimeService/CreateContainer")).await;
    }
}

async fn check_create_rewrite(mode: RelayMode, path: &str) {
    let create_reply: Script = Arc::new(|_| {
        let body = frame(
            &cri::CreateContainerResponse {
                container_id: "c1".into(),
            }
            .encode_to_vec(),
        );
        reply(grpc_headers(), body, ok_trailers(&[]))
    });
    let hook = RecordingHook::default();
    let (_dir, fake, _proxy_guard) = setup(mode, create_reply, vec![Arc::new(hook.clone())]).await;
    let mut client = RawClient::connect(&_proxy_guard.socket)
        .await
        .expect("connect");
    let (message, inner, outer) = create_request_with_unknown_fields();
    let response = client.call(path, &[], frame(&message)).await.expect("call");
    assert_eq!(response.trailers.expect("trailers")["grpc-status"], "0");

    let recorded = fake.forwarded();
    let forwarded = &recorded[0].body[5..];
    assert_ne!(
        forwarded,
        &message[..],
        "{path}: the hook's rewrite was not applied"
    );
    assert!(
        contains(forwarded, &inner),
        "unknown field inside config lost"
    );
    assert!(contains(forwarded, &outer), "unknown top-level field lost");
    let decoded = cri::CreateContainerRequest::decode(forwarded).expect("valid protobuf");
    let envs = decoded.config.expect("config").envs;
    assert!(
        envs.iter()
            .any(|kv| kv.key == "TESSERA_TEST_HOOK" && kv.value == "p"),
        "{envs:?}"
    );
    assert!(
        envs.iter().any(|kv| kv.key == "A" && kv.value == "1"),
        "{envs:?}"
    );
    assert_eq!(
        _proxy_guard
            .proxy
            .store()
            .container("c1")
            .map(|(c, _)| c.name),
        Some("main".to_owned())
    );
}

async fn malformed_intercepted_messages_get_named_errors_and_never_reach_the_runtime(
    mode: RelayMode,
) {
    let (_dir, fake, proxy) = setup(mode, echo_script(), vec![]).await;
    let mut client = RawClient::connect(&proxy.socket).await.expect("connect");
    let cases: [(&str, Bytes, &str); 4] = [
        (
            "truncated prefix",
            Bytes::from_static(&[0, 0, 0]),
            "shorter than the 5-byte message prefix",
        ),
        (
            "short message",
            Bytes::from_static(&[0, 0, 0, 0, 9, 1]),
            "prefix announces 9 bytes",
        ),
        (
            "compressed",
            Bytes::from_static(&[1, 0, 0, 0, 0]),
            "compressed gRPC message",
        ),
        (
            "bad protobuf",
            frame(&[0x0a, 0x7f, 0x01]),
            "error unmarshalling CreateContainer request",
        ),
    ];
    for (name, body, expected) in cases {
        let response = client
            .call("/runtime.v1.RuntimeService/CreateContainer", &[], body)
            .await
            .expect(name);
        assert_eq!(response.headers["grpc-status"], "13", "{name}");
        let message = tessera_runtime_proxy::status_message(&response.headers).unwrap_or_default();
        assert!(message.contains(expected), "{name}: {message}");
    }
    assert!(
        fake.forwarded().is_empty(),
        "a malformed request reached the runtime"
    );
}

async fn a_stream_kubelet_cancels_is_cancelled_at_the_runtime(mode: RelayMode) {
    let (closed_tx, mut closed_rx) = mpsc::channel::<()>(1);
    let script: Script = Arc::new(move |recorded| {
        if !recorded.path.ends_with("/GetContainerEvents") {
            return echo_script()(recorded);
        }
        let (tx, rx) = mpsc::channel(4);
        let closed_tx = closed_tx.clone();
        tokio::spawn(async move {
            let _ = tx.send(Frame::data(frame(b"event-1"))).await;
            // No more events: only the caller going away ends this stream.
            tx.closed().await;
            let _ = closed_tx.send(()).await;
        });
        (grpc_headers(), rx)
    });
    let (_dir, _fake, _proxy, body) = watch_events(mode, script).await;
    drop(body);
    tokio::time::timeout(Duration::from_secs(5), closed_rx.recv())
        .await
        .expect("the runtime's stream is cancelled when kubelet cancels");
}

async fn shutdown_drains_a_call_in_flight_and_takes_no_new_ones(mode: RelayMode) {
    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
    let release_rx = Arc::new(std::sync::Mutex::new(Some(release_rx)));
    let script: Script = Arc::new(move |recorded| {
        if !recorded.path.ends_with("/Version") {
            return echo_script()(recorded);
        }
        let gate = release_rx.lock().ok().and_then(|mut gate| gate.take());
        let Some(gate) = gate else {
            return echo_script()(recorded);
        };
        // The first call is answered only once the test says so.
        let (tx, rx) = mpsc::channel(2);
        tokio::spawn(async move {
            let _ = gate.await;
            let _ = tx.send(Frame::data(frame(b"late"))).await;
            let _ = tx.send(Frame::trailers(ok_trailers(&[]))).await;
        });
        (grpc_headers(), rx)
    });
    let (_dir, _fake, proxy) = setup(mode, script, vec![]).await;
    let socket = proxy.socket.clone();
    let mut client = RawClient::connect(&socket).await.expect("connect");
    let in_flight = tokio::spawn(async move {
        client
            .call("/runtime.v1.RuntimeService/Version", &[], frame(b""))
            .await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let shutdown = tokio::spawn(proxy.shutdown());
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!shutdown.is_finished(), "shut down with a call in flight");
    assert!(
        RawClient::connect(&socket).await.is_err(),
        "a new connection was accepted while draining"
    );
    release_tx.send(()).expect("release");
    let response = tokio::time::timeout(Duration::from_secs(5), in_flight)
        .await
        .expect("the call in flight ends")
        .expect("task")
        .expect("answered");
    assert_eq!(response.body, frame(b"late"));
    assert_eq!(response.trailers.expect("trailers")["grpc-status"], "0");
    tokio::time::timeout(Duration::from_secs(5), shutdown)
        .await
        .expect("drained")
        .expect("task");
}

/// Answers every call with the request's own bytes.
fn mirror_script() -> Script {
    Arc::new(|recorded| reply(grpc_headers(), recorded.body.clone(), ok_trailers(&[])))
}

async fn bodies_larger_than_every_flow_control_window_pass_intact(mode: RelayMode) {
    let (_dir, fake, proxy) = setup(mode, mirror_script(), vec![]).await;
    let mut client = RawClient::connect(&proxy.socket).await.expect("connect");
    // 4 × 6 MiB each way: past the proxy's 4 MiB stream and 16 MiB connection
    // windows and hyper's defaults on both ends, so credit must flow back.
    for round in 0..4u8 {
        let body: Bytes = (0..6 << 20)
            .map(|i: u32| (i % 251) as u8 ^ round)
            .collect::<Vec<u8>>()
            .into();
        let path = "/runtime.v1.ImageService/PullImage";
        let response = tokio::time::timeout(
            Duration::from_secs(20),
            client.call(path, &[], body.clone()),
        )
        .await
        .expect("no flow-control stall")
        .expect("call");
        assert_eq!(response.body.len(), body.len(), "round {round}");
        assert!(
            response.body == body,
            "round {round}: response bytes changed"
        );
        assert_eq!(response.trailers.expect("trailers")["grpc-status"], "0");
    }
    let forwarded = fake.forwarded();
    assert_eq!(forwarded.len(), 4);
    assert!(forwarded.iter().all(|r| r.body.len() == 6 << 20));
}

async fn a_request_body_that_arrives_in_pieces_reaches_the_runtime_whole(mode: RelayMode) {
    let (_dir, fake, proxy) = setup(mode, mirror_script(), vec![]).await;
    let mut client = RawClient::connect(&proxy.socket).await.expect("connect");
    let (tx, rx) = mpsc::channel(1);
    let pieces = [&b"\0\0\0\0\x0bhello"[..], b" stre", b"am"];
    let sender = tokio::spawn(async move {
        for piece in pieces {
            // Later pieces come after the proxy has already forwarded the headers.
            tokio::time::sleep(Duration::from_millis(50)).await;
            if tx.send(Bytes::from_static(piece)).await.is_err() {
                return;
            }
        }
    });
    let response = tokio::time::timeout(
        Duration::from_secs(10),
        client.call_streaming("/runtime.v1.RuntimeService/FutureClientStream", rx),
    )
    .await
    .expect("answered")
    .expect("call");
    sender.await.expect("sender");
    let whole = Bytes::from_static(b"\0\0\0\0\x0bhello stream");
    assert_eq!(fake.forwarded()[0].body, whole);
    assert_eq!(response.body, whole);
    assert_eq!(response.trailers.expect("trailers")["grpc-status"], "0");
}

async fn concurrent_calls_on_one_connection_each_get_their_own_answer(mode: RelayMode) {
    let (_dir, fake, proxy) = setup(mode, mirror_script(), vec![]).await;
    let client = RawClient::connect(&proxy.socket).await.expect("connect");
    // Kubelet multiplexes every call on one connection: 400 in flight at once.
    let calls = (0..400u32).map(|i| {
        let mut client = client.clone();
        tokio::spawn(async move {
            let body =
                frame(format!("call-{i}-{}", "x".repeat((i % 7) as usize * 1000)).as_bytes());
            let response = client
                .call(
                    "/runtime.v1.RuntimeService/ContainerStats",
                    &[],
                    body.clone(),
                )
                .await
                .expect("call");
            assert_eq!(response.body, body, "call {i} got another call's answer");
            assert_eq!(response.trailers.expect("trailers")["grpc-status"], "0");
        })
    });
    for call in futures_util::future::join_all(calls).await {
        call.expect("call task");
    }
    assert_eq!(fake.forwarded().len(), 400);
}

async fn runtime_down_is_unavailable_then_reconnects(mode: RelayMode) {
    tessera_integration::init_tracing();
    let dir = tempfile::Builder::new()
        .prefix("tpas-")
        .tempdir_in("/tmp")
        .expect("tempdir");
    let runtime_socket = dir.path().join("runtime.sock");
    let proxy = RunningProxy::start_mode(
        mode,
        &dir.path().join("proxy.sock"),
        &runtime_socket,
        vec![],
    )
    .await
    .expect("proxy");
    let mut client = RawClient::connect(&proxy.socket).await.expect("connect");
    let response = client
        .call("/runtime.v1.RuntimeService/Version", &[], frame(b""))
        .await
        .expect("answered");
    assert_eq!(response.headers["grpc-status"], "14");
    let message = tessera_runtime_proxy::status_message(&response.headers).unwrap_or_default();
    assert!(message.contains("runtime.sock"), "{message}");

    let fake = FakeRuntime::start(&runtime_socket, echo_script()).expect("runtime comes up");
    let response = client
        .call("/runtime.v1.RuntimeService/Version", &[], frame(b""))
        .await
        .expect("answered");
    assert_eq!(response.trailers.expect("trailers")["grpc-status"], "0");
    assert_eq!(fake.forwarded().len(), 1);
}

async fn caller_deadline_bounds_a_hung_runtime(mode: RelayMode) {
    let script: Script = Arc::new(|_| {
        let (tx, rx) = mpsc::channel(1);
        // Never answers; keeps the sender alive so the stream stays open.
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(30)).await;
            drop(tx);
        });
        (grpc_headers(), rx)
    });
    let (_dir, _fake, proxy) = setup(mode, script, vec![]).await;
    let mut client = RawClient::connect(&proxy.socket).await.expect("connect");
    let started = Instant::now();
    let request = cri::StopContainerRequest {
        container_id: "x".into(),
        timeout: 1,
    }
    .encode_to_vec();
    let response = client
        .call(
            "/runtime.v1.RuntimeService/StopContainer",
            &[("grpc-timeout", "300m")],
            frame(&request),
        )
        .await
        .expect("answered");
    assert_eq!(response.headers["grpc-status"], "4", "DeadlineExceeded");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );
}

async fn metrics_count_calls_by_method_and_code(mode: RelayMode) {
    let (_dir, _fake, proxy) = setup(mode, echo_script(), vec![]).await;
    let mut client = RawClient::connect(&proxy.socket).await.expect("connect");
    for _ in 0..3 {
        client
            .call("/runtime.v1.RuntimeService/Version", &[], frame(b""))
            .await
            .expect("call");
    }
    let text = proxy.metrics.encode();
    assert!(
        text.contains("tessera_proxy_requests_total{method=\"Version\",code=\"Ok\"} 3"),
        "{text}"
    );
    assert!(
        text.contains("tessera_proxy_request_duration_seconds_count{method=\"Version\"} 3"),
        "{text}"
    );
    // h2 shares one runtime connection (the store's resync included); the frame
    // relay gives each kubelet connection its own, besides the resync's.
    let connects = match mode {
        RelayMode::H2 => 1,
        RelayMode::Frames => 2,
    };
    assert!(
        text.contains(&format!("tessera_proxy_backend_connects_total {connects}")),
        "{text}"
    );
}

tessera_integration::each_relay_mode! {
    unknown_method_passes_byte_for_byte_with_metadata_and_trailers;
    error_status_message_and_details_are_unchanged;
    server_streaming_is_streamed_not_buffered;
    rewritten_create_container_keeps_unknown_fields;
    malformed_intercepted_messages_get_named_errors_and_never_reach_the_runtime;
    a_stream_kubelet_cancels_is_cancelled_at_the_runtime;
    shutdown_drains_a_call_in_flight_and_takes_no_new_ones;
    bodies_larger_than_every_flow_control_window_pass_intact;
    a_request_body_that_arrives_in_pieces_reaches_the_runtime_whole;
    concurrent_calls_on_one_connection_each_get_their_own_answer(flavor = "multi_thread", worker_threads = 2);
    runtime_down_is_unavailable_then_reconnects;
    caller_deadline_bounds_a_hung_runtime;
    metrics_count_calls_by_method_and_code;
}
