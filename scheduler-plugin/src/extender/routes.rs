//! HTTP routing: which verb a path calls, the body limit, the readiness probes,
//! and the listener loop; filter's and prioritize's bodies read and written in
//! place ([`crate::protocol::wire`]).

use super::*;

impl Extender {
    /// `filter` from and to the wire: the node names are read in place from `body`
    /// and written from there (see [`Name`], [`wire`]). The outer error is the request's.
    pub(super) fn filter_json(
        &self,
        body: &[u8],
    ) -> serde_json::Result<serde_json::Result<Vec<u8>>> {
        let args = wire::read_args(body)?;
        let names = candidate_names(args.node_names, args.nodes.as_ref());
        let answer = self.filter_names(&args.pod, args.nodes, &names);
        Ok(encode_filter(&answer.for_kube_scheduler()))
    }

    /// `prioritize` from and to the wire, as [`Extender::filter_json`].
    pub(super) fn prioritize_json(
        &self,
        body: &[u8],
    ) -> serde_json::Result<serde_json::Result<Vec<u8>>> {
        let args = wire::read_args(body)?;
        let names = candidate_names(args.node_names, args.nodes.as_ref());
        Ok(encode_scores(&self.prioritize_names(&args.pod, &names)))
    }

    /// Serves one HTTP request.
    pub async fn handle(&self, request: Request<Incoming>) -> Response<Full<Bytes>> {
        let (method, path) = (request.method().clone(), request.uri().path().to_owned());
        let span = tracing::debug_span!("extender", %method, %path);
        let _entered = span.enter();
        let respond = |status: StatusCode, body: Vec<u8>| {
            let mut response = Response::new(Full::new(Bytes::from(body)));
            *response.status_mut() = status;
            response.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static("application/json"),
            );
            response
        };
        match (&method, path.trim_end_matches('/')) {
            (&Method::GET, "/healthz") => return respond(StatusCode::OK, b"ok".to_vec()),
            (&Method::GET, "/readyz") => {
                return if self.ready.load(Ordering::SeqCst) {
                    respond(StatusCode::OK, b"ok".to_vec())
                } else {
                    respond(
                        StatusCode::SERVICE_UNAVAILABLE,
                        b"cache not synced".to_vec(),
                    )
                };
            }
            (&Method::POST, _) => {}
            _ => return respond(StatusCode::NOT_FOUND, b"not found".to_vec()),
        }
        drop(_entered);
        let forwarded = request.headers().contains_key(FORWARDED_HEADER);
        let body = match http_body_util::Limited::new(request.into_body(), MAX_BODY_BYTES)
            .collect()
            .await
        {
            Ok(body) => body.to_bytes(),
            Err(e) if e.is::<http_body_util::LengthLimitError>() => {
                return respond(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!("{path}: request body over {MAX_BODY_BYTES} bytes").into_bytes(),
                );
            }
            Err(e) => {
                return respond(
                    StatusCode::BAD_REQUEST,
                    format!("reading body: {e}").into_bytes(),
                );
            }
        };
        let bad = |e: serde_json::Error| {
            respond(
                StatusCode::BAD_REQUEST,
                format!("{path}: invalid JSON: {e}").into_bytes(),
            )
        };
        let started = Instant::now();
        let encoded = match verb(&path) {
            "filter" => self.filter_json(&body),
            "prioritize" => self.prioritize_json(&body),
            "preempt" => serde_json::from_slice::<ExtenderPreemptionArgs>(&body)
                .map(|args| serde_json::to_vec(&self.preempt(args))),
            "bind" => match serde_json::from_slice::<ExtenderBindingArgs>(&body) {
                Ok(args) => Ok(serde_json::to_vec(&self.bind(&args, forwarded).await)),
                Err(e) => Err(e),
            },
            _ => return respond(StatusCode::NOT_FOUND, b"not found".to_vec()),
        };
        self.observer.request(verb(&path), started.elapsed());
        match encoded {
            Ok(Ok(bytes)) => respond(StatusCode::OK, bytes),
            Ok(Err(e)) | Err(e) => bad(e),
        }
    }
}

/// The verb a request path names: its last segment (kube-scheduler sends
/// `<urlPrefix>/<verb>`). Access checks ([`crate::transport::BindAccess`]) and routing
/// both use it, so they never disagree about which verb a path calls.
pub fn verb(path: &str) -> &str {
    path.trim_end_matches('/').rsplit('/').next().unwrap_or("")
}

/// The largest request body read: kube-scheduler's filter, prioritize and preempt
/// calls with node names (`nodeCacheCapable`) stay far below it even at 5,000 nodes;
/// a larger body is refused before it is held.
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// Serves the extender on `listener` until the task is dropped.
pub async fn serve(listener: tokio::net::TcpListener, extender: Extender) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                tracing::warn!(%error, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let extender = extender.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request| {
                let extender = extender.clone();
                async move { Ok::<_, Infallible>(extender.handle(request).await) }
            });
            let _ = crate::extender::http1_server()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}

/// The HTTP/1 server every listener uses: a client has 5 s to send its request
/// headers, so idle connections cannot pile up until file descriptors run out.
pub(crate) fn http1_server() -> hyper::server::conn::http1::Builder {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(std::time::Duration::from_secs(5));
    builder
}
